"""The target's ranks in lockstep: rank 0 broadcasts each forward's inputs, ranks 1 .. N-1 replay them.

Design choice: **rank 0 owns scheduling and broadcasts every forward** (vLLM's driver-worker pattern) rather than
every rank running the engine on identical inputs. The engine's inputs are not identical across ranks: the SSD
drafter's proposals reach rank 0 only (the speculator talks to rank 0), the server admits requests at times that
depend on network arrival, and the drafter falls back on timeouts measured by rank 0's clock. Broadcasting the one
thing the other ranks need -- the next :class:`~ssd_eagle.kv_cache.ForwardBatch` -- makes ranks 1 .. N-1 plain
model workers with no tokenizer, engine, drafter or clock, and greedy output equal to the single-process target by
construction (the same batches in the same order; only the sharded matmuls' reduction order differs).

Messages (on the target's group, source rank 0), all int64 except the mask:

    FORWARD    header [1, B, n, kv_len, m, compute_logits]      m = -1: logits at every position
               ints   input_ids [B*n], position_ids [B*n], write_positions [B*n], slots [B], num_tokens [B],
                      logits_index [B*m]
               visible uint8 [B, n, kv_len]: 1 where the batch's additive mask is 0 (the mask is rebuilt exactly)
    SHUTDOWN   header [2, 0, 0, 0, 0, 0]
    COMPACT    header [3, slot, m, dst_start, 0, 0], then src_positions [m]   (KVCache.compact, e.g. a tree path)
    COPY_SLOT  header [4, src, dst, length, 0, 0]                             (KVCache.copy_slot)

Cache maintenance is mirrored too: the engine reaches the cache through ``runner.kv``, which on rank 0 is a
:class:`MirroredKVCache` that broadcasts ``compact``/``copy_slot`` before applying them.

Tensors travel on the model's device (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ssd_eagle.kv_cache import ForwardBatch, KVCache
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.parallel.sharding import local_kv_heads

FORWARD, SHUTDOWN, COMPACT, COPY_SLOT = 1, 2, 3, 4
HEADER = 6
SRC = 0  # the driver's global rank


def use_local_kv_cache(runner: ModelRunner, initial_capacity: int = 256) -> ModelRunner:
    """Replace ``runner.kv`` by a cache of this rank's kv heads (same layers, slots, max_len, head_dim), in place.

    A TP-sharded attention layer hands the cache only its local heads (``num_key_value_heads / N``), so a cache
    built from the config's head count would not fit.
    """
    old = runner.kv
    runner.kv = KVCache(old.num_layers, old.num_slots, local_kv_heads(runner.model), old.keys[0].shape[-1],
                        old.max_len, runner.dtype, runner.device, initial_capacity)
    return runner


def _broadcast(tensor: torch.Tensor, group) -> torch.Tensor:
    dist.broadcast(tensor, SRC, group=group)
    return tensor


def send_geometry(group, device, num_slots: int, max_len: int) -> None:
    """Rank 0: tell the workers the cache geometry of the engine (slots, positions per slot)."""
    _broadcast(torch.tensor([num_slots, max_len], dtype=torch.long, device=device), group)


def recv_geometry(group, device) -> tuple[int, int]:
    """Ranks 1 .. N-1: ``(num_slots, max_len)`` from :func:`send_geometry`."""
    num_slots, max_len = _broadcast(torch.zeros(2, dtype=torch.long, device=device), group).tolist()
    return num_slots, max_len


class MirroredKVCache:
    """Rank 0's view of its :class:`~ssd_eagle.kv_cache.KVCache`: ``compact`` and ``copy_slot`` are broadcast to
    the worker ranks first; everything else is the cache's own."""

    def __init__(self, cache: KVCache, group, device):
        self.cache, self.group, self.device = cache, group, device

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def compact(self, slot: int, src_positions: torch.Tensor, dst_start: int) -> None:
        m = src_positions.numel()
        _broadcast(torch.tensor([COMPACT, slot, m, dst_start, 0, 0], device=self.device), self.group)
        _broadcast(src_positions.reshape(-1).to(device=self.device, dtype=torch.long).contiguous(), self.group)
        self.cache.compact(slot, src_positions, dst_start)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        _broadcast(torch.tensor([COPY_SLOT, src, dst, length, 0, 0], device=self.device), self.group)
        self.cache.copy_slot(src, dst, length)


class DriverRunner:
    """Rank 0's :class:`~ssd_eagle.model_runner.ModelRunner`: each forward is broadcast to the other target ranks
    before it runs here. Everything else (``dtype``, ``device``, ``kv``, ...) is the wrapped runner's.

    Args:
        runner: rank 0's runner over its shard (its cache of local kv heads, see :func:`use_local_kv_cache`).
        group: the target's process group.
    """

    def __init__(self, runner: ModelRunner, group):
        self.runner = runner
        self.group = group
        self.closed = False
        self.forwards = 0  # forwards broadcast so far (each worker rank runs the same number)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    @property
    def kv(self) -> MirroredKVCache:
        return MirroredKVCache(self.runner.kv, self.group, self.runner.device)

    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None = None, capture_aux: bool = False,
                compute_logits: bool = True):
        """Broadcast, then run :meth:`ModelRunner.forward` (same arguments and result)."""
        if self.closed:
            raise RuntimeError("the target's worker ranks were shut down")
        device = self.runner.device
        B, n = batch.input_ids.shape
        m = -1 if logits_index is None else logits_index.shape[1]
        _broadcast(torch.tensor([FORWARD, B, n, batch.kv_len, m, int(compute_logits)], device=device), self.group)
        parts = [batch.input_ids, batch.position_ids, batch.write_positions, batch.slots,
                 torch.as_tensor(batch.num_tokens, device=device)]
        if logits_index is not None:
            parts.append(logits_index)
        _broadcast(torch.cat([p.reshape(-1).to(device=device, dtype=torch.long) for p in parts]), self.group)
        _broadcast((batch.attn_mask[:, 0] == 0).to(torch.uint8).contiguous(), self.group)
        self.forwards += 1
        return self.runner.forward(batch, logits_index=logits_index, capture_aux=capture_aux,
                                   compute_logits=compute_logits)

    def shutdown(self) -> None:
        """Release the worker ranks from :func:`worker_loop` (idempotent)."""
        if not self.closed:
            self.closed = True
            _broadcast(torch.tensor([SHUTDOWN, 0, 0, 0, 0, 0], device=self.runner.device), self.group)


def worker_loop(runner: ModelRunner, group) -> int:
    """Ranks 1 .. N-1: replay rank 0's forwards until it shuts down; returns how many ran.

    Logits and aux states are computed only as far as the collectives need (the output layer's all-gather), and
    dropped: rank 0 alone samples and verifies.
    """
    device = runner.device
    header = torch.zeros(HEADER, dtype=torch.long, device=device)
    count = 0
    while True:
        command, B, n, kv_len, m, compute_logits = _broadcast(header, group).tolist()
        if command == SHUTDOWN:
            return count
        if command == COMPACT:  # B = slot, n = number of positions, kv_len = destination start
            src = _broadcast(torch.empty(n, dtype=torch.long, device=device), group)
            runner.kv.compact(B, src, kv_len)
            continue
        if command == COPY_SLOT:  # B = source slot, n = destination slot, kv_len = length
            runner.kv.copy_slot(B, n, kv_len)
            continue
        if command != FORWARD:
            raise RuntimeError(f"unknown command {command} from the driver rank")
        size = 3 * B * n + 2 * B + max(m, 0) * B
        # ForwardBatch.build works on CPU tensors and moves the result to the device (as the engine's batches do)
        ints = _broadcast(torch.empty(size, dtype=torch.long, device=device), group).cpu()
        visible = _broadcast(torch.empty(B, n, kv_len, dtype=torch.uint8, device=device), group).cpu().bool()
        ids, pos, write, slots, num, index = torch.split(ints, [B * n, B * n, B * n, B, B, max(m, 0) * B])
        batch = ForwardBatch.build(ids.view(B, n), pos.view(B, n), write.view(B, n), slots.tolist(), visible,
                                   runner.dtype, device, num.tolist())
        runner.forward(batch, logits_index=index.view(B, m).to(device) if m >= 0 else None, capture_aux=False,
                       compute_logits=bool(compute_logits))
        count += 1
