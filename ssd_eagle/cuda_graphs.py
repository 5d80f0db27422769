"""Static shapes and CUDA graphs for the decode-time forwards (verification, drafter steps).

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so every captured forward has fixed shapes:
the batch is padded to a *bucket* (1, 2, 4, 8, ...), the tokens of each row to a fixed *width* (1 for a drafter
step, K + 1 for a chain verification, 1 + tree budget for a tree), and the attended cache length to the next of a
fixed set (powers of two from 128; the mask hides what a row may not see), so short sequences do not pay for the
whole preallocated cache. Padding rows write into a dedicated scratch slot, padding tokens past a row's real
tokens, where nothing live is stored. The inputs are copied into static buffers before each replay and the outputs
read from static buffers after it (gpt-fast and vLLM do the same).

On CUDA each shape is captured once, lazily, and replayed; elsewhere, or with ``enabled=False``, the very same
fixed-shape code runs eagerly, which is how the CPU tests check it: the fixed-shape forward must equal the dynamic
one. The shape sets are fixed at start-up (:func:`shape_sets`: the captured ones, or the CPU's, where padding is
real work). Prefill is never captured (its shapes vary).
"""

from __future__ import annotations

from typing import Callable

import torch

from ssd_eagle.kv_cache import ForwardBatch, KVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
EAGER_KV_STEP = 16  # eager fixed shapes: attended cache lengths in steps of 16 (at most 15 padding columns)
EAGER_BUFFERS = 32  # eager fixed shapes: static buffer sets kept (least recently used dropped first)


def cache_lengths(max_len: int, step: int | None) -> tuple[int, ...]:
    """The attended cache lengths of :class:`StaticForward`, ascending, the last ``max_len``: multiples of
    ``step``, or powers of two from 128 (``step`` None).

    Raises:
        ValueError: a ``step`` below 1."""
    if step is not None and step < 1:
        raise ValueError(f"step must be positive, got {step}")
    lengths, L = [], step or 128
    while L < max_len:
        lengths.append(L)
        L = L + step if step else 2 * L
    return tuple(lengths) + (max_len,)


def shape_sets(graphs: bool, max_rows: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(row buckets, attended cache lengths) of a :class:`StaticForward`, fixed at start-up.

    Captured (``graphs``): powers of two up to ``max_rows`` and cache lengths in powers of two (a few graphs per
    width; the SSD reference fixes its batch buckets the same way). Eager (CPU): every row count and cache lengths
    in steps of ``EAGER_KV_STEP``, because there padding is real work and buys nothing; the CPU tests pass the
    captured sets explicitly to check the padding itself.
    """
    if graphs:
        rows = tuple(2 ** i for i in range(max_rows.bit_length()) if 2 ** i <= max_rows)
        return rows, cache_lengths(max_len, None)
    return tuple(range(1, max_rows + 1)), cache_lengths(max_len, EAGER_KV_STEP)


class StaticForward:
    """Fixed-shape (and, on CUDA, graph-captured) execution of ``fn(batch, **extra) -> dict[str, Tensor]``.

    Args:
        fn: the forward; it must read only ``batch``'s tensors and ``extra`` and write the cache through
            ``kv.update`` (a transformers body with our cache, or an EAGLE-3 head).
        kv: the cache ``fn`` writes; it is grown to its full ``max_len`` at once (addresses must not move).
        scratch_slot: a cache slot no sequence uses, for padding rows.
        buckets: batch sizes captured; a larger batch runs dynamically.
        widths: tokens per row captured (a row is padded to the next width); None: every width exactly as it
            comes, never padded (the drafts' steps, whose widths are fixed by their settings: 1 for a chain, topk
            for a tree level, the fan-out budget for the speculator's branches).
        extra_shapes: name -> (trailing shape, dtype) of extra per-token inputs (e.g. EAGLE-3 features
            ``(H,)``); they are padded like the tokens.
        enabled: capture CUDA graphs (only on CUDA devices).
        copy_outputs: return copies of the graph's output buffers (callers that keep outputs across calls,
            such as the drafts' trees, need them: the next replay overwrites the buffers).
        kv_lengths: the attended cache lengths (ascending, the last ``kv.max_len``; a batch's is padded to the
            next). None: powers of two from 128 (:func:`cache_lengths`; see :func:`shape_sets` for eager runs).

    Raises:
        ValueError: ``kv_lengths`` not ending at ``kv.max_len``.
    """

    def __init__(self, fn: Callable[..., dict[str, torch.Tensor]], kv: KVCache, scratch_slot: int,
                 dtype: torch.dtype, device: torch.device | str, buckets=DEFAULT_BUCKETS, widths=(1,),
                 extra_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, enabled: bool = True,
                 copy_outputs: bool = False, kv_lengths: tuple[int, ...] | None = None):
        self.fn, self.kv, self.scratch = fn, kv, scratch_slot
        self.dtype, self.device = dtype, torch.device(device)
        self.buckets, self.widths = tuple(sorted(buckets)), None if widths is None else tuple(sorted(widths))
        self.extra_shapes = extra_shapes or {}
        self.use_graphs = enabled and self.device.type == "cuda"
        # whether batches get padded: rows into the scratch slot (and, by the speculator, its branches to the fan-out
        # budget, one captured width). Eager CPU shape sets run every row count and width as it comes, so there the
        # scratch slot is never written and the cache may be resized (KVCache.fit)
        self.pads = self.use_graphs or self.buckets != tuple(range(1, self.buckets[-1] + 1))
        self.copy_outputs = copy_outputs and self.use_graphs
        if self.use_graphs:
            kv.reserve(kv.max_len)  # a graph bakes in the cache's addresses
        self.kv_lengths = tuple(kv_lengths or cache_lengths(kv.max_len, None))
        if self.kv_lengths[-1] != kv.max_len:
            raise ValueError(f"kv_lengths must end at the cache's max_len {kv.max_len}, got {self.kv_lengths}")
        self._buffers: dict[tuple[int, int, int, int], dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def shape_for(self, batch_size: int, width: int, kv_len: int) -> tuple[int, int, int] | None:
        """The (bucket, width, cache length) serving this batch, or None when it is not covered."""
        b = next((x for x in self.buckets if x >= batch_size), None)
        w = width if self.widths is None else next((x for x in self.widths if x >= width), None)
        L = next((x for x in self.kv_lengths if x >= kv_len + width), None)
        return None if b is None or w is None or L is None else (b, w, L)

    def __call__(self, batch: ForwardBatch, logits_index: torch.Tensor | None = None,
                 **extra: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Run ``batch`` in fixed shapes; outputs are sliced back to the real rows and tokens. ``logits_index``
        (int64 [B, m], positions 0..n-1; None: every position) is passed on to ``fn`` (each m is a shape of its
        own). Returns None when no (bucket, width) covers the batch (the caller then runs its dynamic path)."""
        B, n = batch.input_ids.shape
        shape = self.shape_for(B, n, max(batch.kv_len, int(batch.write_positions.max()) + 1))
        if shape is None:
            return None
        key = shape + (0 if logits_index is None else logits_index.shape[1],)
        static = self._static_inputs(key)
        self._fill(static, batch, extra, logits_index)
        if self.use_graphs:
            graph, outputs = self._graphs.get(key) or self._capture(key, static)
            graph.replay()
        else:
            outputs = self._run(static, batch if shape[:2] == (B, n) else None)
        sliced = {name: t[:B, :n] if t.dim() >= 2 else t[:B] for name, t in outputs.items()}
        return {name: t.clone() for name, t in sliced.items()} if self.copy_outputs else sliced

    def _static_inputs(self, key: tuple[int, int, int, int]) -> dict[str, torch.Tensor]:
        """The buffers of ``key``. A graph keeps its buffers for good (their addresses are baked in); eager runs
        keep the ``EAGER_BUFFERS`` most recently used sets (their fine shape sets would otherwise pile up)."""
        if not self.use_graphs and key in self._buffers:
            self._buffers[key] = self._buffers.pop(key)  # most recently used last
        if not self.use_graphs and key not in self._buffers and len(self._buffers) >= EAGER_BUFFERS:
            self._buffers.pop(next(iter(self._buffers)))
        if key not in self._buffers:
            B, W, L, m = key
            long = dict(dtype=torch.long, device=self.device)
            buf = {"input_ids": torch.zeros(B, W, **long), "position_ids": torch.zeros(B, W, **long),
                   "write_positions": torch.zeros(B, W, **long), "slots": torch.full((B,), self.scratch, **long),
                   "attn_mask": torch.zeros(B, 1, W, L, dtype=self.dtype, device=self.device)}
            for name, (trailing, dtype) in self.extra_shapes.items():
                buf[name] = torch.zeros(B, W, *trailing, dtype=dtype, device=self.device)
            if m:
                buf["logits_index"] = torch.zeros(B, m, **long)
            self._padding(buf, 0)
            self._buffers[key] = buf
        return self._buffers[key]

    def _padding(self, buf: dict[str, torch.Tensor], first_row: int) -> None:
        """Rows from ``first_row`` on: scratch slot, a causal run from position 0 (finite values, harmless)."""
        B, W = buf["input_ids"].shape
        if first_row == B:
            return
        steps = torch.arange(W, device=self.device)
        buf["slots"][first_row:] = self.scratch
        buf["input_ids"][first_row:] = 0
        buf["position_ids"][first_row:] = steps
        buf["write_positions"][first_row:] = steps
        mask = buf["attn_mask"][first_row:]
        cols = torch.arange(mask.shape[-1], device=self.device)
        hidden = cols[None, None, None, :] > steps[None, None, :, None]
        mask.zero_().masked_fill_(hidden.expand_as(mask), torch.finfo(self.dtype).min)
        for name in self.extra_shapes:
            buf[name][first_row:] = 0
        if "logits_index" in buf:
            buf["logits_index"][first_row:] = 0

    def _fill(self, buf: dict[str, torch.Tensor], batch: ForwardBatch, extra: dict[str, torch.Tensor],
              logits_index: torch.Tensor | None) -> None:
        B, n = batch.input_ids.shape
        W = buf["input_ids"].shape[1]
        self._padding(buf, B)
        buf["slots"][:B] = batch.slots
        buf["input_ids"][:B, :n] = batch.input_ids
        buf["position_ids"][:B, :n] = batch.position_ids
        buf["write_positions"][:B, :n] = batch.write_positions
        mask = buf["attn_mask"][:B]
        mask.fill_(torch.finfo(self.dtype).min)
        mask[:, :, :n, : batch.kv_len] = batch.attn_mask
        if W > n:  # padding columns: continue each row after its last write, seeing only themselves
            last = batch.write_positions[:, -1:]
            extra_cols = (last + torch.arange(1, W - n + 1, device=self.device)).clamp(max=mask.shape[-1] - 1)
            buf["write_positions"][:B, n:] = extra_cols
            buf["position_ids"][:B, n:] = batch.position_ids[:, -1:]
            rows = torch.arange(B, device=self.device)[:, None]
            mask[rows, 0, torch.arange(n, W, device=self.device)[None, :], extra_cols] = 0.0
        for name, value in extra.items():
            buf[name][:B, :n] = value
        if logits_index is not None:
            buf["logits_index"][:B] = logits_index

    def _run(self, buf: dict[str, torch.Tensor], dynamic: ForwardBatch | None = None) -> dict[str, torch.Tensor]:
        """``fn`` on the static buffers. ``dynamic``: the batch they hold when it fills them without padding rows
        or columns (eager runs only): its host-side facts, a view instead of a gather of the slots and a slice copy
        instead of a scatter of the writes, still hold and are used (a graph bakes in neither)."""
        B, W = buf["input_ids"].shape
        slot_range, contiguous = (dynamic.slot_range, dynamic.contiguous_write) if dynamic is not None \
            else (None, None)
        batch = ForwardBatch(buf["input_ids"], buf["position_ids"], buf["slots"], buf["write_positions"],
                             buf["attn_mask"], buf["attn_mask"].shape[-1], slot_range, contiguous, [W] * B)
        extra = {name: buf[name] for name in self.extra_shapes}
        if "logits_index" in buf:
            extra["logits_index"] = buf["logits_index"]
        return self.fn(batch, **extra)

    def _capture(self, shape, static):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy initialisations must not happen during capture
                self._run(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._run(static)
        self._graphs[shape] = (graph, outputs)
        return graph, outputs


def runner_forward_fn(runner, capture_aux: bool):
    """``fn`` for :class:`StaticForward` over a :class:`~ssd_eagle.model_runner.ModelRunner`: logits at every
    position (and the aux hidden states)."""
    def fn(batch: ForwardBatch) -> dict[str, torch.Tensor]:
        out = runner.forward(batch, capture_aux=capture_aux)
        result = {"logits": out.logits}
        if capture_aux:
            result["aux_hidden"] = out.aux_hidden
        return result
    return fn
