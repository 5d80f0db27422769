"""A preallocated, slot-indexed key/value cache and the batch descriptions that write into it.

Every running sequence owns one *slot* (a row of the cache) for its lifetime. A forward pass writes the new
tokens' keys and values at explicit positions of their slots and attends through an explicit mask, so the same
cache serves prefill, batched chain verification with ragged lengths, draft trees, and rollback: rejecting draft
tokens is just lowering the sequence's length (positions past it are dead and get overwritten), and keeping a
tree path is a gather of its positions (:meth:`KVCache.compact`).

The cache is handed to a transformers model as its ``cache`` argument (``past_key_values`` before transformers 5.25:
:func:`cache_kwarg` names the one the installed version takes); transformers' attention layers call
:meth:`KVCache.update` with the new keys/values of one layer and attend over what it returns (this is the only
method of ``transformers.Cache`` that Llama-family attention uses). No modeling code is copied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
from dataclasses import dataclass

import torch

TRIM_BYTES = 64 * 2**20  # a CPU store shrinking by this much hands its freed heap back to the OS


def cache_kwarg(forward) -> str:
    """The keyword under which ``forward`` (a transformers model's or attention layer's) takes its cache:
    ``"cache"`` from transformers 5.25 on, ``"past_key_values"`` before. Passing the wrong one is silent: the
    layer puts it in ``**kwargs`` and attends over the new keys alone (found on transformers 5.17)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one position of one slot takes in a store of this geometry (keys and values of every layer)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class DraftKV:
    """A draft's KV stores as the engine's KV budget counts them (:class:`~ssd_eagle.engine.scheduler.Scheduler`).

    Attributes:
        bytes_per_position: bytes of one position of one slot, keys and values of every draft layer (an EAGLE-3
            head: one layer; a draft LM: all of its layers), summed over the stores the draft keeps.
        slack: positions a request's draft store holds past its prompt + max_tokens (an SSD speculator: a round's
            branches, ``SpeculativeConfig.kv_slack("speculator")``; an SD draft following the target's store: 0,
            the target's reservation already has one round).
    """

    bytes_per_position: int
    slack: int = 0


def trim_host_memory() -> None:
    """Return the freed heap to the OS (glibc's ``malloc_trim``; nothing where the C library has none). Freed CPU
    tensors otherwise stay in the process's heap, and its RSS would keep the peak of the longest request."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class KVCache:
    """Per-layer tensors ``[num_rows, num_kv_heads, capacity, head_dim]``, grown on demand up to ``max_len``.

    Args:
        num_layers: layers of the model this cache serves.
        num_slots: concurrent sequences (slots ``0 .. num_slots-1``).
        num_kv_heads, head_dim: attention geometry.
        max_len: the most positions a slot can ever hold (tokens of the longest sequence plus draft positions).
        dtype, device: of the keys/values (the model's).
        initial_capacity: positions allocated at first; grown by a quarter (in multiples of 256 positions) when a
            forward needs more, so a large batch does not double its memory for one long sequence, but never past
            ``limit`` unless a forward needs it.

    :meth:`resize` reallocates the store to fewer rows (the slots ``0 .. num_rows-1`` in use) or positions, and
    :meth:`fit` does so for the live sequences' needs, so its memory follows them instead of the longest one ever
    seen (the target's store and the drafts' stores alike).

    Raises:
        ValueError: a forward needs more than ``max_len`` positions.
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, initial_capacity: int = 256):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.num_rows = num_slots
        self.capacity = min(initial_capacity, max_len)
        self.limit = max_len  # growth ceiling (the engine sets the longest reservation of its live requests)
        shape = (num_slots, num_kv_heads, self.capacity, head_dim)
        with torch.inference_mode(False):  # normal tensors, updatable in and out of inference mode
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._batch: ForwardBatch | None = None

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one slot takes (keys and values of every layer)."""
        k = self.keys[0]
        return bytes_per_position(self.num_layers, k.shape[1], k.shape[3], k.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds now (``num_rows x capacity`` positions)."""
        return self.num_rows * self.capacity * self.bytes_per_position

    def reserve(self, needed: int) -> None:
        """Make every slot hold at least ``needed`` positions, keeping the contents.

        Raises:
            ValueError: ``needed`` exceeds ``max_len``.
        """
        if needed <= self.capacity:
            return
        if needed > self.max_len:
            raise ValueError(f"a forward needs {needed} cache positions but max_len is {self.max_len}")
        grown = min(-(-max(needed, self.capacity * 5 // 4) // 256) * 256, self.max_len)
        past_limit = min(-(-needed // 256) * 256, self.max_len)  # (whole growth steps: no realloc per round)
        self.resize(self.num_rows, max(past_limit, min(grown, self.limit)))

    def fit(self, num_rows: int, capacity: int, limit: int | None = None, shrink_below: float = 1.0) -> None:
        """Follow the live sequences: keep the rows ``0 .. num_rows-1`` (their highest slot + 1), shrink to at most
        ``capacity`` positions (never grows them here: :meth:`reserve` does on demand) and grow no further than
        ``limit`` (default ``capacity``; clamped to ``[capacity, max_len]``) unless a forward needs it.

        With ``shrink_below`` < 1 the store keeps its rows and positions where they already cover the live
        sequences, unless the fitted store would hold at most that share of its bytes: a full batch then does not
        copy its whole store each time its highest slot or longest request ends and the next one is admitted, at
        the price of memory up to ``1 / shrink_below`` times the live sequences' need.

        Raises:
            ValueError: ``num_rows`` not in ``[1, num_slots]``, ``capacity`` < 1, or ``shrink_below`` not in
                ``(0, 1]``.
        """
        if not 0.0 < shrink_below <= 1.0:
            raise ValueError(f"shrink_below must be in (0, 1], got {shrink_below}")
        capacity = min(capacity, self.max_len)
        self.limit = min(max(limit or capacity, capacity), self.max_len)
        rows, capacity = num_rows, min(self.capacity, capacity)
        if rows <= self.num_rows and rows * capacity > shrink_below * self.num_rows * self.capacity:
            rows, capacity = self.num_rows, self.capacity  # (covers the live sequences already)
        elif capacity > shrink_below * self.capacity:  # growing by rows: the positions too would shrink only a little
            capacity = self.capacity
        self.resize(rows, capacity)

    def resize(self, num_rows: int, capacity: int) -> None:
        """Reallocate every layer to ``[num_rows, kv_heads, capacity, head_dim]``, keeping what fits (slots past
        ``num_rows`` and positions past ``capacity`` are dropped). Frees memory when shrinking (a large CPU
        shrink also trims the heap, :func:`trim_host_memory`).

        Raises:
            ValueError: ``num_rows`` not in ``[1, num_slots]`` or ``capacity`` not in ``[1, max_len]``.
        """
        if not (1 <= num_rows <= self.num_slots and 1 <= capacity <= self.max_len):
            raise ValueError(f"cannot resize to {num_rows} rows x {capacity} positions "
                             f"(at most {self.num_slots} x {self.max_len})")
        if (num_rows, capacity) == (self.num_rows, self.capacity):
            return
        rows, cap, before = min(num_rows, self.num_rows), min(capacity, self.capacity), self.nbytes
        with torch.inference_mode(False):  # growing inside a forward must not make the store an inference tensor,
            for layer in range(self.num_layers):  # which compact() / copy_slot() could not update outside one
                for store in (self.keys, self.values):
                    old = store[layer]
                    new = old.new_empty(num_rows, old.shape[1], capacity, old.shape[3])
                    new[:rows, :, :cap] = old[:rows, :, :cap]
                    new[:rows, :, cap:].zero_()  # (each byte written once; dead positions stay finite: a masked
                    new[rows:].zero_()  # score of a NaN key would still poison the softmax)
                    store[layer] = new
        self.num_rows, self.capacity = num_rows, capacity
        if self.keys[0].device.type == "cpu" and before - self.nbytes >= TRIM_BYTES:
            trim_host_memory()

    def bind(self, batch: ForwardBatch) -> KVCache:
        """Set the batch the next forward belongs to (slots, write positions, attended length)."""
        if self.capacity < self.max_len:  # (once full, no host sync: CUDA-graph capture forbids one)
            self.reserve(max(batch.kv_len, batch.max_write_position + 1))
        self._batch = batch
        return self

    # transformers' Cache interface (the part Llama-family attention uses)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[B, kv_heads, n, head_dim]`` keys/values at the bound positions; return the attended range
        ``[B, kv_heads, kv_len, head_dim]`` of the bound slots."""
        b = self._batch
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        if b.contiguous_write is not None:  # one row writing one contiguous run: plain slice copies
            slot, start = b.contiguous_write
            n = key_states.shape[2]
            k_store[slot, :, start : start + n].copy_(key_states[0])
            v_store[slot, :, start : start + n].copy_(value_states[0])
        else:
            heads = torch.arange(k_store.shape[1], device=k_store.device)
            index = (b.slots[:, None, None], heads[None, :, None], b.write_positions[:, None, :])
            k_store.index_put_(index, key_states)
            v_store.index_put_(index, value_states)
        if b.slot_range is not None:
            lo, hi = b.slot_range
            return k_store[lo:hi, :, : b.kv_len], v_store[lo:hi, :, : b.kv_len]
        return k_store[b.slots, :, : b.kv_len], v_store[b.slots, :, : b.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._batch.kv_len if self._batch is not None else 0

    # used by transformers' mask creation when a forward passes no mask (see ForwardBatch.maskless)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._batch.kv_len - self._batch.input_ids.shape[1]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._batch.kv_len, 0

    # cache maintenance
    def compact(self, slot: int, src_positions: torch.Tensor, dst_start: int) -> None:
        """Move positions ``src_positions`` (int64 [m], ascending) of ``slot`` to ``dst_start .. dst_start+m-1``
        (keeping an accepted tree path)."""
        m = src_positions.numel()
        for store in (*self.keys, *self.values):
            store[slot, :, dst_start : dst_start + m] = store[slot, :, src_positions]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for store in (*self.keys, *self.values):
            store[dst, :, :length] = store[src, :, :length]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Keys and values of positions ``start .. end-1`` of ``slot``: a new tensor
        ``[num_layers, 2, kv_heads, end - start, head_dim]`` (0 = keys, 1 = values)."""
        return torch.stack([torch.stack((k[slot, :, start:end], v[slot, :, start:end]))
                            for k, v in zip(self.keys, self.values)])

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[num_layers, 2, kv_heads, n, head_dim]``, as :meth:`read` returns) at positions
        ``start .. start+n-1`` of ``slot``, growing the store when needed."""
        n = kv.shape[3]
        self.reserve(start + n)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[slot, :, start : start + n] = kv[layer, 0]
            v[slot, :, start : start + n] = kv[layer, 1]


@dataclass
class ForwardBatch:
    """One forward's worth of new tokens for B slots, padded to n per row.

    Attributes:
        input_ids: int64 [B, n].
        position_ids: int64 [B, n], the rotary positions.
        slots: int64 [B], the cache rows.
        write_positions: int64 [B, n], where each token's key/value is stored in its slot.
        attn_mask: [B, 1, n, kv_len] additive float mask (0 visible, dtype min hidden) in the model's dtype.
        kv_len: cache positions attended (a prefix of every slot).
        slot_range: (lo, hi) when ``slots`` is ``lo..hi-1`` ascending, so reads are views, not gathers.
        contiguous_write: (slot, start) when B == 1 and the row writes ``start .. start+n-1``.
        num_tokens: real (unpadded) tokens per row, python ints.
        causal: plain causal visibility (see :attr:`maskless`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    slots: torch.Tensor
    write_positions: torch.Tensor
    attn_mask: torch.Tensor
    kv_len: int
    slot_range: tuple[int, int] | None
    contiguous_write: tuple[int, int] | None
    num_tokens: list[int]
    plain_causal: bool = False  # built by :meth:`causal` (plain causal visibility)

    @property
    def max_write_position(self) -> int:
        return int(self.write_positions.max())

    @property
    def maskless(self) -> bool:
        """One row of plain causal attention that SDPA can do without a mask: a single new token attending to the
        whole cached prefix, or a whole prompt from position 0 (transformers then uses SDPA's own causal modes,
        which are faster and skip repeating grouped key/value heads)."""
        if self.contiguous_write is None or self.input_ids.shape[0] != 1:
            return False
        n = self.input_ids.shape[1]
        return self.kv_len == self.contiguous_write[1] + n and (n == 1 or self.contiguous_write[1] == 0) \
            and self.plain_causal

    @classmethod
    def causal(cls, tokens: list[list[int]], slots: list[int], starts: list[int], dtype: torch.dtype,
               device: torch.device | str, pad_id: int = 0) -> ForwardBatch:
        """New tokens ``tokens[b]`` for slot ``slots[b]`` whose first ``starts[b]`` positions are cached.

        Token i of row b sits at position ``starts[b] + i`` and sees positions ``0 .. starts[b] + i``. Rows are
        right-padded to the longest; pad tokens continue their row causally (finite values, never attended by a
        real token) and write past the row's real tokens, where nothing live is stored.
        """
        num = [len(t) for t in tokens]
        n = max(num)
        ids = torch.full((len(tokens), n), pad_id, dtype=torch.long)
        for row, t in enumerate(tokens):
            ids[row, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        start = torch.as_tensor(starts, dtype=torch.long)
        positions = start[:, None] + torch.arange(n)[None, :]
        kv_len = int(positions.max()) + 1
        visible = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]
        batch = cls.build(ids, positions, positions, slots, visible, dtype, device, num)
        batch.plain_causal = True
        return batch

    @classmethod
    def tree(cls, roots: list[int], nodes: list[list[int]], parents: list[list[int]], slots: list[int],
             starts: list[int], dtype: torch.dtype, device: torch.device | str) -> ForwardBatch:
        """A root token plus a draft tree per row, in one forward (EAGLE / SpecInfer tree attention).

        Row b's root ``roots[b]`` sits at position ``starts[b]`` (its first ``starts[b]`` positions are cached).
        Node i (1-based; ``nodes[b][i-1]``, parent ``parents[b][i-1]``, 0 = the root, parents listed before
        children) is written at ``starts[b] + i``, has rotary position ``starts[b] + depth(i)``, and sees the
        cached prefix plus its ancestors and itself. A chain is the tree with ``parents = [0, 1, 2, ...]``.
        """
        B = len(roots)
        n = 1 + max(len(t) for t in nodes)
        ids = torch.zeros(B, n, dtype=torch.long)
        depth = torch.zeros(B, n, dtype=torch.long)
        anc = torch.zeros(B, n, n, dtype=torch.bool)  # anc[b, i, j]: node j is node i or one of its ancestors
        for b in range(B):
            ids[b, 0] = roots[b]
            anc[b, 0, 0] = True
            for i, (tok, par) in enumerate(zip(nodes[b], parents[b]), start=1):
                if not 0 <= par < i:
                    raise ValueError(f"tree parents must precede their children, got parent {par} for node {i}")
                ids[b, i] = tok
                depth[b, i] = depth[b, par] + 1
                anc[b, i] = anc[b, par]
                anc[b, i, i] = True
            for i in range(len(nodes[b]) + 1, n):  # padding: a chain below the root, harmless and finite
                depth[b, i] = i
                anc[b, i, : i + 1] = True
        start = torch.as_tensor(starts, dtype=torch.long)
        write = start[:, None] + torch.arange(n)[None, :]
        kv_len = int(write.max()) + 1
        cols = torch.arange(kv_len)[None, None, :]
        prefix = cols < start[:, None, None]
        offset = (cols - start[:, None, None]).clamp(min=0, max=n - 1)
        in_tree = (cols >= start[:, None, None]) & (cols < (start + n)[:, None, None])
        visible = prefix | (in_tree & anc.gather(2, offset.expand(B, n, kv_len)))
        return cls.build(ids, start[:, None] + depth, write, slots, visible, dtype, device,
                         [1 + len(t) for t in nodes])

    @classmethod
    def build(cls, input_ids: torch.Tensor, position_ids: torch.Tensor, write_positions: torch.Tensor,
              slots: list[int], visible: torch.Tensor, dtype: torch.dtype, device: torch.device | str,
              num_tokens: list[int]) -> ForwardBatch:
        """General constructor from a boolean visibility ``[B, n, kv_len]`` (True = may attend)."""
        kv_len = visible.shape[-1]
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        slot_t = torch.as_tensor(slots, dtype=torch.long)
        lo = slots[0]
        slot_range = (lo, lo + len(slots)) if list(slots) == list(range(lo, lo + len(slots))) else None
        contiguous = None
        if len(slots) == 1:
            w = write_positions[0]
            if bool((w == w[0] + torch.arange(w.numel())).all()):
                contiguous = (slots[0], int(w[0]))
        return cls(input_ids.to(device), position_ids.to(device), slot_t.to(device), write_positions.to(device),
                   mask[:, None].to(device), kv_len, slot_range, contiguous, list(num_tokens))
