"""Static shapes and CUDA graphs for the decode-time forwards (verification, drafter steps).

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so every captured forward has fixed shapes:
the batch is padded to a *bucket* (1, 2, 4, 8, ...), the tokens of each row to a fixed *width* (1 for a drafter
step, K + 1 for a chain verification, 1 + tree budget for a tree), and the attended cache length to a power of
two (the mask hides what a row may not see), so short sequences do not pay for the whole preallocated cache. Padding rows write into a dedicated scratch
slot, padding tokens past a row's real tokens, where nothing live is stored. The inputs are copied into static
buffers before each replay and the outputs read from static buffers after it (gpt-fast and vLLM do the same).

On CUDA each (bucket, width) is captured once, lazily, and replayed; elsewhere, or with ``enabled=False``
(``--eager``), the very same fixed-shape code runs eagerly, which is how the CPU tests check it: the fixed-shape
forward must equal the dynamic one. Prefill is never captured (its shapes vary).
"""

from __future__ import annotations

from typing import Callable

import torch

from ssd_eagle.kv_cache import ForwardBatch, KVCache

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


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
    """

    def __init__(self, fn: Callable[..., dict[str, torch.Tensor]], kv: KVCache, scratch_slot: int,
                 dtype: torch.dtype, device: torch.device | str, buckets=DEFAULT_BUCKETS, widths=(1,),
                 extra_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, enabled: bool = True,
                 copy_outputs: bool = False):
        self.fn, self.kv, self.scratch = fn, kv, scratch_slot
        self.dtype, self.device = dtype, torch.device(device)
        self.buckets, self.widths = tuple(sorted(buckets)), None if widths is None else tuple(sorted(widths))
        self.extra_shapes = extra_shapes or {}
        self.use_graphs = enabled and self.device.type == "cuda"
        self.copy_outputs = copy_outputs and self.use_graphs
        kv.reserve(kv.max_len)
        lengths, L = [], 128
        while L < kv.max_len:
            lengths.append(L)
            L *= 2
        self.kv_lengths = tuple(lengths) + (kv.max_len,)
        self._buffers: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def shape_for(self, batch_size: int, width: int, kv_len: int) -> tuple[int, int, int] | None:
        """The (bucket, width, cache length) serving this batch, or None when it is not covered."""
        b = next((x for x in self.buckets if x >= batch_size), None)
        w = width if self.widths is None else next((x for x in self.widths if x >= width), None)
        L = next((x for x in self.kv_lengths if x >= kv_len + width), None)
        return None if b is None or w is None or L is None else (b, w, L)

    def __call__(self, batch: ForwardBatch, **extra: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Run ``batch`` in fixed shapes; outputs are sliced back to the real rows and tokens. Returns None when
        no (bucket, width) covers the batch (the caller then runs its dynamic path)."""
        B, n = batch.input_ids.shape
        shape = self.shape_for(B, n, max(batch.kv_len, int(batch.write_positions.max()) + 1))
        if shape is None:
            return None
        static = self._static_inputs(shape)
        self._fill(static, batch, extra)
        if self.use_graphs:
            graph, outputs = self._graphs.get(shape) or self._capture(shape, static)
            graph.replay()
        else:
            outputs = self._run(static)
        sliced = {name: t[:B, :n] if t.dim() >= 2 else t[:B] for name, t in outputs.items()}
        return {name: t.clone() for name, t in sliced.items()} if self.copy_outputs else sliced

    def _static_inputs(self, shape: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        if shape not in self._buffers:
            B, W, L = shape
            long = dict(dtype=torch.long, device=self.device)
            buf = {"input_ids": torch.zeros(B, W, **long), "position_ids": torch.zeros(B, W, **long),
                   "write_positions": torch.zeros(B, W, **long), "slots": torch.full((B,), self.scratch, **long),
                   "attn_mask": torch.zeros(B, 1, W, L, dtype=self.dtype, device=self.device)}
            for name, (trailing, dtype) in self.extra_shapes.items():
                buf[name] = torch.zeros(B, W, *trailing, dtype=dtype, device=self.device)
            self._padding(buf, 0)
            self._buffers[shape] = buf
        return self._buffers[shape]

    def _padding(self, buf: dict[str, torch.Tensor], first_row: int) -> None:
        """Rows from ``first_row`` on: scratch slot, a causal run from position 0 (finite values, harmless)."""
        W = buf["input_ids"].shape[1]
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

    def _fill(self, buf: dict[str, torch.Tensor], batch: ForwardBatch, extra: dict[str, torch.Tensor]) -> None:
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

    def _run(self, buf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = ForwardBatch(buf["input_ids"], buf["position_ids"], buf["slots"], buf["write_positions"],
                             buf["attn_mask"], buf["attn_mask"].shape[-1], None, None,
                             [buf["input_ids"].shape[1]] * buf["input_ids"].shape[0])
        extra = {name: buf[name] for name in self.extra_shapes}
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
