"""The speculator process: receives requests, answers from the speculation cache, then builds the next one.

Started by :class:`~ssd_eagle.ssd.client.RemoteSpeculator` with ``torch.multiprocessing`` (spawn). It joins a
two-rank process group with the verifier (rank 0 there, rank 1 here), pins itself to its own CPU cores or GPU, and
serves until SHUTDOWN. The draft model arrives as a module (its tensors in shared memory) and is moved to the
speculator's device. Answering before building is what lets drafting overlap the target's verification.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ssd_eagle.ssd import transport as t
from ssd_eagle.sampling_params import SamplingParams


@dataclass
class SpeculatorSettings:
    """Everything the speculator process needs besides the draft module (picklable)."""

    kind: str  # "draft_model" or "eagle3"
    num_speculative_tokens: int
    fanout: list[int]
    fanout_miss: list[int] | None
    backup: str
    fast_backup_batch: int
    saguaro_c: float
    prompt_lookup: tuple[int, int]
    num_slots: int
    max_len: int
    device: str = "cpu"
    threads: int = 1
    cpus: list[int] | None = None
    init_method: str = "tcp://127.0.0.1:29512"
    dist_backend: str = "gloo"
    float_dtype: torch.dtype = torch.float32
    vocab_size: int = 0
    tree_budget: int = 0
    tree_depth: int = 5
    tree_topk: int = 4
    fanout_power: float = 1.0
    cuda_graphs: bool = True  # fixed-shape, CUDA-graph draft steps on CUDA (False: --eager)


def build_speculator(settings: SpeculatorSettings, draft):
    """The :class:`~ssd_eagle.ssd.speculator.Speculator` for a draft module (used in-process and in the worker)."""
    from ssd_eagle.drafters.base import SaguaroSampling
    from ssd_eagle.drafters.backends import DraftLMBackend, Eagle3Backend
    from ssd_eagle.ssd.speculator import Speculator

    if settings.kind == "eagle3":
        backend = Eagle3Backend(draft, settings.num_slots, settings.max_len, None if settings.cuda_graphs else False)
    elif settings.kind == "draft_model":
        backend = DraftLMBackend(draft, settings.num_slots, settings.max_len,
                                 None if settings.cuda_graphs else False)
    else:
        raise ValueError(f"SSD needs a neural draft ('draft_model' or 'eagle3'), got {settings.kind!r}")
    from ssd_eagle.drafters.tree import TreeSettings

    saguaro = SaguaroSampling(settings.saguaro_c, tuple(settings.fanout)) if settings.saguaro_c < 1.0 else None
    tree = None
    if settings.tree_budget:
        tree = TreeSettings(settings.tree_budget, min(settings.tree_depth, settings.num_speculative_tokens),
                            settings.tree_topk)
    return Speculator(backend, settings.num_speculative_tokens, settings.fanout, settings.fanout_miss,
                      settings.backup, settings.fast_backup_batch, saguaro, settings.prompt_lookup, tree,
                      settings.fanout_power)


def worker_main(settings: SpeculatorSettings, draft) -> None:
    """Entry point of the speculator process."""
    if settings.cpus:
        os.sched_setaffinity(0, settings.cpus)
    torch.set_num_threads(settings.threads)
    dist.init_process_group(settings.dist_backend, init_method=settings.init_method, rank=1, world_size=2)
    device = torch.device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    draft = draft.to(device)
    speculator = build_speculator(settings, draft)
    channel_device = "cpu" if settings.dist_backend == "gloo" else device
    channel = t.Channel(peer=0, float_dtype=settings.float_dtype, device=channel_device)
    intervals: list[float] = []
    try:
        serve(speculator, channel, settings, intervals)
    finally:
        dist.destroy_process_group()


def serve(speculator, channel: t.Channel, settings: SpeculatorSettings, intervals: list[float]) -> None:
    """The request loop (also handy to drive from a test)."""
    from ssd_eagle.ssd.speculator import SpecRequest

    aux_width = None
    while True:
        command, ints, floats, _ = channel.recv()
        if command == t.SHUTDOWN:
            return
        if command == t.ADD:
            slot, seed, top_k, greedy, n = ints[:5].tolist()
            tokens = ints[5: 5 + n].tolist()
            temperature, top_p = floats[:2].tolist()
            aux = floats[2:].clone().view(n - 1, -1) if floats.numel() > 2 else None
            if aux is not None:
                aux_width = aux.shape[1]
            params = SamplingParams(temperature=0.0 if greedy else temperature, top_p=top_p, top_k=top_k,
                                    max_tokens=1)
            speculator.add(slot, tokens, params, seed, aux)
        elif command == t.REMOVE:
            speculator.remove(int(ints[0]))
        elif command == t.STATS:
            s = speculator.stats
            channel.send(t.STATS, torch.tensor([s.lookups, s.hits, s.builds, len(s.bonus_ranks), *s.bonus_ranks]),
                         torch.tensor([s.build_time, *intervals], dtype=torch.float64))
        elif command == t.PROPOSE:
            rows = int(ints[0])
            fields = ints[1: 1 + 4 * rows].view(rows, 4).tolist()
            accepted_ids = ints[1 + 4 * rows:].tolist()
            requests, offset, cursor = [], 0, 0
            for slot, k, bonus, budget in fields:
                aux = None
                if aux_width is not None and k >= 0:
                    aux = floats[offset: offset + (k + 1) * aux_width].clone().view(k + 1, aux_width)
                    offset += (k + 1) * aux_width
                accepted = accepted_ids[cursor: cursor + max(k, 0)]
                cursor += max(k, 0)
                requests.append(SpecRequest(slot, k, bonus, budget, aux, accepted))
            try:
                replies = speculator.propose(requests)
            except Exception:  # noqa: BLE001 - the verifier must hear back, whatever broke
                channel.send(t.ERROR)
                raise
            channel.send(t.REPLY, *encode_replies(replies))
            start = time.time()
            try:
                speculator.build()
            except Exception:  # noqa: BLE001 - a failed build only costs hits: every lookup will miss
                for seq in speculator.seqs.values():
                    seq.cache = {}
            intervals.extend([start, time.time()])
        else:
            raise RuntimeError(f"unknown command {command}")


def encode_replies(replies) -> tuple[torch.Tensor, torch.Tensor | None]:
    """REPLY payloads: ints ``[rows, then per row: hit, lookup_k, m, has_q, is_tree, m tokens, (m parents)]``,
    floats: the q of every row that has one, concatenated."""
    ints, qs = [len(replies)], []
    for r in replies:
        is_tree = r.parents is not None
        ints += [-1 if r.cache_hit is None else int(r.cache_hit), -1 if r.lookup_k is None else r.lookup_k,
                 len(r.tokens), int(r.q is not None), int(is_tree), *r.tokens, *(r.parents if is_tree else [])]
        if r.q is not None:
            qs.append(r.q.reshape(-1).cpu())
    return torch.tensor(ints, dtype=torch.long), (torch.cat(qs) if qs else None)


def decode_replies(ints: torch.Tensor, floats: torch.Tensor, vocab_size: int):
    from ssd_eagle.drafters.base import Proposal

    values = ints.tolist()
    replies, cursor, offset = [], 1, 0
    for _ in range(values[0]):
        hit, lookup_k, m, has_q, is_tree = values[cursor: cursor + 5]
        cursor += 5
        tokens = values[cursor: cursor + m]
        cursor += m
        parents = None
        if is_tree:
            parents = values[cursor: cursor + m]
            cursor += m
        q = None
        if has_q:
            q = floats[offset: offset + m * vocab_size].clone().view(m, vocab_size)
            offset += m * vocab_size
        replies.append(Proposal(tokens, q, None if hit < 0 else bool(hit), None if lookup_k < 0 else lookup_k,
                                 parents))
    return replies
