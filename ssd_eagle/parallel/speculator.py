"""The SSD speculator as a rank of the launch, and the verifier's handle on it.

:class:`~ssd_eagle.ssd.client.RemoteSpeculator` spawns its speculator and creates a two-rank default group for the
pair. Here the speculator is rank N of the job started by torchrun, and the pair talks in its own group
``new_group([0, N])`` (:class:`JoinedSpeculator`, a subclass that joins instead of spawning). The message layouts,
the request loop and the fallback to ordinary decoding are unchanged (:mod:`ssd_eagle.ssd.transport`,
:func:`ssd_eagle.ssd.worker.serve`, :class:`~ssd_eagle.ssd.client.SSDDrafter`).

Start-up on the pair group (source rank 0), once:

    1. one pickled object: ``{"settings": SpeculatorSettings, "spec": SpeculativeConfig, "target_config": ...,
       "embedding": (shape, dtype) or None}`` -- or None when rank 0 gave up before building its engine;
    2. for an EAGLE-3 head, the target's input embedding table ``[vocab, hidden]`` in the target's dtype (the head
       embeds tokens with it; it is whole on every target rank, see :mod:`ssd_eagle.parallel.sharding`).

The speculator loads its draft itself (``spec.model``) on its own device. Channel ``peer`` values are *global*
ranks (``torch.distributed.send``/``irecv`` take global ranks whatever the group), so rank 0 talks to peer N.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ssd_eagle.parallel.topology import Topology
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.client import RemoteSpeculator
from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator, serve

log = logging.getLogger(__name__)
SRC = 0


def speculator_settings(config, target_config, dtype: torch.dtype, max_model_len: int,
                        cuda: bool) -> SpeculatorSettings:
    """:func:`ssd_eagle.ssd.speculator_settings` with the transport of a launch (``device`` is filled in by the
    speculator rank)."""
    from ssd_eagle.ssd import speculator_settings as base_settings

    settings = base_settings(config, target_config, dtype, max_model_len)
    settings.dist_backend = "nccl" if cuda else "gloo"
    return settings


def eagle3_aux_layer_ids(path: str, target_config) -> tuple[int, ...]:
    """The aux layer ids an EAGLE-3 checkpoint declares (read from its config; no weights are loaded)."""
    import json
    from pathlib import Path

    from ssd_eagle.models.eagle3_formats import CONFIG_NAME, eagle3_config_from_dict

    cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
    return tuple(eagle3_config_from_dict(cfg, target_config).aux_layer_ids)


class JoinedSpeculator(RemoteSpeculator):
    """A :class:`~ssd_eagle.ssd.client.RemoteSpeculator` whose speculator is already a rank of this job.

    Sends the start-up message (module docstring), then talks over ``group`` exactly as the parent does.

    Args:
        settings: the speculator's settings (:func:`speculator_settings`).
        spec: the speculative config (the speculator loads ``spec.model``).
        target_config: the target's transformers config (vocabulary, EAGLE-3 validation).
        group: the pair group; peer: the speculator's global rank.
        embedding: the target's input embedding weight ``[vocab, hidden]`` (EAGLE-3 only), or None.
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
        device: where the channel's buffers live (the verifier's CUDA device with NCCL, else CPU).
    """

    def __init__(self, settings: SpeculatorSettings, spec, target_config, group, peer: int,
                 embedding: torch.Tensor | None = None, timeout: float = 60.0, device: str | torch.device = "cpu"):
        self.settings, self.timeout = settings, timeout
        self.process = None
        self.peer, self.group = peer, group
        meta = None if embedding is None else (tuple(embedding.shape), embedding.dtype)
        dist.broadcast_object_list([{"settings": settings, "spec": spec, "target_config": target_config,
                                     "embedding": meta}], src=SRC, group=group)
        if embedding is not None:
            dist.broadcast(embedding.detach().contiguous(), SRC, group=group)
        self.channel = t.Channel(peer=peer, group=group, float_dtype=settings.float_dtype, device=device)
        self.closed = False

    def _check_alive(self) -> None:
        if self.closed:
            raise t.SpeculatorUnavailable("the speculator was shut down")

    def close(self) -> None:
        """Tell the speculator rank to stop (it then leaves its loop; the process group stays up)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.channel.send(t.SHUTDOWN)
        except RuntimeError as err:
            log.warning("could not reach the speculator rank to shut it down: %s", err)


def decline_speculator(topo: Topology) -> None:
    """Rank 0: release a waiting speculator rank when no engine will be built (sends None as the start-up)."""
    dist.broadcast_object_list([None], src=SRC, group=topo.pair_group)


def load_speculator_draft(spec, target_config, dtype: torch.dtype, device: torch.device,
                          embedding: torch.Tensor | None) -> nn.Module:
    """The draft module on the speculator rank: a causal LM or an EAGLE-3 head with the given embedding table.

    Raises:
        ValueError: not a neural draft; a draft LM whose vocabulary differs from the target's; a head that does not
            fit the target.
    """
    if spec.method == "draft_model":
        from ssd_eagle.assets import load_model

        model, _ = load_model(spec.model, dtype=dtype, device=device)
        vocab = model.get_output_embeddings().weight.shape[0]
        if vocab != target_config.get_text_config().vocab_size:
            raise ValueError(f"draft model vocabulary ({vocab}) must equal the target's")
        return model
    if spec.method == "eagle3":
        from ssd_eagle.models.eagle3_formats import load_eagle3

        head = load_eagle3(spec.model, target_config=target_config, dtype=dtype, device=device)
        head.set_embeddings(nn.Embedding.from_pretrained(embedding, freeze=True))
        return head
    raise ValueError(f"SSD needs a neural draft (method 'draft_model' or 'eagle3'), got {spec.method!r}")


def run_speculator_rank(topo: Topology, device_kind: str) -> bool:
    """Rank N: receive the start-up, load the draft, serve rank 0 until SHUTDOWN. Returns False when rank 0 sent
    no start-up (it built no engine).

    A failure while serving is logged and answered with ERROR (the verifier then decodes without drafts); the
    rank stays up until SHUTDOWN, so torchrun does not tear the job down.
    """
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
    channel = t.Channel(peer=0, group=topo.pair_group, float_dtype=settings.float_dtype,
                        device=device if settings.dist_backend == "nccl" else "cpu")
    try:
        draft = load_speculator_draft(start["spec"], start["target_config"], settings.float_dtype, device, embedding)
        speculator = build_speculator(settings, draft)
        serve(speculator, channel, settings, [])
    except Exception:  # noqa: BLE001 - report, keep answering, let rank 0 decide when to stop
        log.exception("the speculator failed; rank 0 continues with ordinary decoding")
        _drain(channel)
    return True


def _drain(channel: t.Channel) -> None:
    """Answer every request with ERROR (statistics with zeros) until SHUTDOWN."""
    while True:
        command, _, _, _ = channel.recv()
        if command == t.SHUTDOWN:
            return
        if command == t.PROPOSE:
            channel.send(t.ERROR)
        elif command == t.STATS:
            channel.send(t.STATS, torch.zeros(4, dtype=torch.long), torch.zeros(1, dtype=torch.float64))
