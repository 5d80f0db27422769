"""The SSD speculator as a rank of the launch, and the verifier's handle on it.

:class:`~ssd_eagle.ssd.client.RemoteSpeculator` spawns its speculator and opens a two-rank link of its own. Here
the speculator is rank N of the job started by torchrun, and the pair talks in the job's group ``new_group([0, N])``
(:class:`JoinedSpeculator`, a link that joins instead of spawning). The messages, the request loop and the
fallback to ordinary decoding are the same (:mod:`ssd_eagle.ssd.protocol`, :func:`ssd_eagle.ssd.worker.serve`,
:class:`~ssd_eagle.ssd.client.SSDDrafter`).

Start-up on the pair group (source rank 0), once:

    1. one pickled object: ``{"settings": SpeculatorSettings, "spec": SpeculativeConfig, "target_config": ...,
       "embedding": (shape, dtype) or None}`` -- or None when rank 0 gave up before building its engine;
    2. for an EAGLE-3 head, the target's input embedding table ``[vocab, hidden]`` in the target's dtype (the head
       embeds tokens with it; it is whole on every target rank, see :mod:`ssd_eagle.parallel.sharding`).

The speculator loads its draft itself (``spec.model``, :func:`ssd_eagle.engine.factory.load_draft`) on its own
device. The channel addresses the peer by its rank in the pair group (rank 0 is 0 there, rank N is 1).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ssd_eagle.parallel.topology import Topology
from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.client import SpeculatorLink
from ssd_eagle.ssd.speculator import SpeculatorStats
from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator, serve

log = logging.getLogger(__name__)
SRC = 0


class JoinedSpeculator(SpeculatorLink):
    """The verifier's handle on a speculator that is already a rank of this job.

    Sends the start-up message (module docstring), then talks over ``group`` as every
    :class:`~ssd_eagle.ssd.client.SpeculatorLink` does. :meth:`close` tells the speculator rank to stop (it then
    leaves its loop; the process group stays up).

    Args:
        settings: the speculator's settings (:func:`ssd_eagle.ssd.speculator_settings`).
        spec: the speculative config (the speculator loads ``spec.model``).
        target_config: the target's transformers config (vocabulary, EAGLE-3 validation).
        group: the pair group.
        embedding: the target's input embedding weight ``[vocab, hidden]`` (EAGLE-3 only), or None.
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
        device: where the channel's buffers live (the verifier's CUDA device with NCCL, else CPU).
    """

    def __init__(self, settings: SpeculatorSettings, spec, target_config, group,
                 embedding: torch.Tensor | None = None, timeout: float = 60.0, device: str | torch.device = "cpu"):
        meta = None if embedding is None else (tuple(embedding.shape), embedding.dtype)
        dist.broadcast_object_list([{"settings": settings, "spec": spec, "target_config": target_config,
                                     "embedding": meta}], src=SRC, group=group)
        if embedding is not None:
            dist.broadcast(embedding.detach().contiguous(), SRC, group=group)
        super().__init__(t.Channel(group, t.SPECULATOR, settings.float_dtype, device), settings.vocab_size, timeout)


def decline_speculator(topo: Topology) -> None:
    """Rank 0: release a waiting speculator rank when no engine will be built (sends None as the start-up)."""
    dist.broadcast_object_list([None], src=SRC, group=topo.pair_group)


def run_speculator_rank(topo: Topology, device_kind: str) -> bool:
    """Rank N: receive the start-up, load the draft, serve rank 0 until SHUTDOWN. Returns False when rank 0 sent
    no start-up (it built no engine).

    A failure while serving is logged and answered with ERROR (the verifier then decodes without drafts); the
    rank stays up until SHUTDOWN, so torchrun does not tear the job down.
    """
    from ssd_eagle.engine.factory import load_draft

    box = [None]
    dist.broadcast_object_list(box, src=SRC, group=topo.pair_group)
    start = box[0]
    if start is None:
        return False
    settings: SpeculatorSettings = start["settings"]
    device = topo.device(device_kind)
    settings.device = str(device)
    torch.set_num_threads(settings.threads)
    embedding = None
    if start["embedding"] is not None:
        shape, dtype = start["embedding"]
        embedding = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(embedding, SRC, group=topo.pair_group)
    channel = t.Channel(topo.pair_group, t.VERIFIER, settings.float_dtype,
                        device if settings.dist_backend == "nccl" else "cpu")
    try:
        draft = load_draft(start["spec"], target_config=start["target_config"], dtype=settings.float_dtype,
                           device=device, embeddings=embedding)
        speculator = build_speculator(settings, draft)
        serve(speculator, channel, [])
    except Exception:  # noqa: BLE001 - report, keep answering, let rank 0 decide when to stop
        log.exception("the speculator failed; rank 0 continues with ordinary decoding")
        _drain(channel)
    return True


def _drain(channel: t.Channel) -> None:
    """Answer every request with ERROR (statistics with zeros) until SHUTDOWN."""
    while True:
        command = channel.recv().command
        if command == p.SHUTDOWN:
            return
        if command == p.PROPOSE:
            channel.send(p.Message(p.ERROR))
        elif command == p.STATS:
            channel.send(p.encode_stats(SpeculatorStats(), []))
