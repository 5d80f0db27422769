"""The neural drafts, one implementation per model, shared by the SD drafters and the SSD speculator.

A backend owns a draft model and its :class:`~ssd_eagle.kv_cache.KVCache` (one slot per sequence) and offers
three operations, all of them stateless about sequences (the callers keep the bookkeeping):

- ``prefill(slot, token_ids, aux, start, end, pending)``: cache every committed token but the last, or (chunked)
  the token positions ``start .. end-1``;
- ``extend(slots, chunks, starts, features)``: a causal forward over new tokens per row (ragged), returning the
  draft's prediction after each row's last token (a chain's next token, or a tree's root distribution);
- ``step(slots, tokens, positions, write, visible, features)``: one forward over B rows of n tokens with explicit
  positions and visibility (tree levels, the speculator's branches).

Both run through ``forward(batch, features)``, the only place a draft model is called while drafting, and the
place where fixed shapes and CUDA graphs come in (:meth:`DraftBackend.use_fixed_shapes`, on by default on every
device): a :class:`~ssd_eagle.cuda_graphs.StaticForward` copies the batch into static buffers of a fixed shape,
its rows padded to the next row bucket (padding rows write into the cache's last slot, a scratch slot no sequence
uses) and its attended cache length to the next fixed length, keeps every width exactly (the steps' widths are
fixed by the settings: 1 per chain token, topk per tree level, the fan-out budget for the speculator's branches; an
``extend`` or a proposal forward gets one shape per width it has, at most K + 1 plus the tree budget), computes
logits only where asked, and on CUDA captures each shape once, lazily, and replays it. Elsewhere the same code runs
eagerly, with the CPU's shape sets (every row count, cache lengths in steps of 16:
:func:`~ssd_eagle.cuda_graphs.shape_sets`), since padding there is real work that buys nothing; the CPU tests pass
the captured sets to check the padding itself. More rows than the largest bucket run dynamically; prefill never
runs through it (its shapes vary without bound). ``fixed_shapes=False`` (``--eager``) keeps every forward dynamic.

Position convention. Token position t is the t-th token of a sequence (0-based). A causal draft LM stores token t
at cache position t (``offset = 0``). An EAGLE-3 head stores the pair ``(f_{t-1}, x_t)`` at cache position
``t - 1``, the pair's rotary position (``offset = 1``; EAGLE-3, Li et al. 2025: the feature of position t-1 goes
with the next token). Every argument of a backend is in *cache positions* (``starts``, ``positions``, ``write``
and the columns of ``visible``); callers convert token positions with ``t - offset`` once. The output at an input
of token position t is the draft's distribution of token t + 1.

Tensors: tokens, positions and write positions int64 ``[B, n]``; visibility bool ``[B, n, S]`` over cache
positions ``0..S-1`` (True = may attend); features (EAGLE-3) ``[B, n, H]`` in the backend's dtype, the fused
target aux states for committed tokens or the head's own output at the parent while drafting; logits
``[B, n, D]`` float32 over the draft's own vocabulary: column c scores target token ``vocab[c]``
(:attr:`DraftBackend.vocab`; a draft LM's D is V_target, an EAGLE-3 head's its reduced vocabulary), every other
token having probability 0; outputs ``[B, n, H]`` (EAGLE-3) or None (a draft LM).

Why the draft's vocabulary: everything drafted from these logits (argmax, softmax, sampling, top-k candidates)
costs D instead of V_target per row. SmolLM2's head (D = 8192 of 49152), 24 branches, one bf16 Zen 5 core: scatter
0.49 ms, argmax 0.98 -> 0.21 ms, softmax 1.06 -> 0.20, sampling 1.87 -> 0.54, top-8 1.48 -> 0.27 per step. The
drafts are the same (our heads' columns ascend with the target ids, so argmax and top-k ties break alike, and zero
columns change no cumulative sum; a softmax over D terms rounds differently from one over V only in the last bit),
and the verifier tests each token with the q it was drawn from (``Proposal.q_ids``), so the output law is the
target's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from ssd_eagle.cuda_graphs import StaticForward, shape_sets
from ssd_eagle.kv_cache import ForwardBatch, KVCache
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.models.draft_lm import draft_temperature_scale, draft_vocab_ids
from ssd_eagle.packed_linear import pack_linears, packs_on
from ssd_eagle.sampling import upcast_logits

DraftOut = tuple[torch.Tensor, "torch.Tensor | None"]  # (logits, outputs); see the module docstring
DRAFT_MAX_ROWS = 256  # most rows in fixed shapes: sequences (chains) or branches (the speculator's trees)


class DraftBackend(ABC):
    """A draft model behind the operations of the module docstring.

    Attributes:
        offset: cache position = token position - offset.
        vocab: int64 [D], the target token id of each logit column (ascending for the heads we train, any order
            for a third-party one), or None: the columns are the target's vocabulary (:meth:`token_ids` maps columns
            to token ids).
        needs_aux: the draft takes target features (EAGLE-3); hidden_size: their width H (None otherwise).
        aux_layer_ids: the target layers whose aux states the draft needs (None without features).
        dtype, device, kv: the draft's dtype, device and cache (its last slot is the scratch slot).
        forwards: calls of :meth:`forward` so far (``extend`` and ``step`` run through it; prefill does not).
        temperature_scale: the draft's temperature scale s (sampled rows draw from ``softmax(z / (T s))``,
            :mod:`ssd_eagle.drafters.chain`): the one its ``config.json`` records, 1.0 without one; a
            ``speculative_config.draft_temperature_scale`` replaces it (the SSD speculator sets 1.0 unless one is
            given: :func:`ssd_eagle.ssd.worker.build_speculator`).
        static: the fixed-shape runner of :meth:`use_fixed_shapes`, or None (dynamic shapes).
    """

    offset = 0
    needs_aux = False
    hidden_size: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    dtype: torch.dtype
    device: torch.device
    kv: KVCache
    forwards = 0
    static: StaticForward | None = None
    vocab: torch.Tensor | None = None
    temperature_scale: float = 1.0

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """The draft model (whose config, dtype and packing its costs depend on: :func:`ssd_eagle.planner.cost_key`)."""

    def set_vocab(self, ids: torch.Tensor | None, vocab_size: int) -> None:
        """Logit column c scores target token ``ids[c]`` (int64 [D]); None: the target's vocabulary."""
        self.vocab = None if ids is None or ids.numel() == vocab_size else ids.to(self.device)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The target token id of each logit column (int64, any shape)."""
        return columns if self.vocab is None else self.vocab[columns.to(self.vocab.device)]

    @abstractmethod
    def prefill(self, slot: int, token_ids: list[int], aux: torch.Tensor | None, start: int = 0,
                end: int | None = None, pending: torch.Tensor | None = None) -> torch.Tensor | None:
        """Cache the token positions ``start .. end-1`` (default: every committed token but the last, ``token_ids``
        = prompt + first sampled token); a prompt prefilled chunk by chunk calls it per chunk, ``start`` the
        previous ``end``. ``aux`` (EAGLE-3): the target's aux states of those positions [end - start, 3 * H_target];
        ``pending``: what the previous chunk's call returned. Returns the features not yet fed (EAGLE-3: position
        ``end - 1``'s, float [1, H], paired with the next token), or None.

        Raises:
            ValueError: an EAGLE-3 draft without ``aux``, or a later chunk without ``pending``."""

    @abstractmethod
    def write(self, slot: int, tokens: list[int], start: int, features: torch.Tensor | None) -> None:
        """Cache ``tokens`` at cache positions ``start ..`` of ``slot`` in one dynamic-shape forward that computes
        no logits (prefill and a drafter's catch-up). ``features`` (EAGLE-3): float [len(tokens), H], else None."""

    @abstractmethod
    def run(self, batch: ForwardBatch, features: torch.Tensor | None,
            logits_index: torch.Tensor | None = None) -> DraftOut:
        """The draft model on ``batch`` in its own shapes (what :meth:`forward` runs dynamically)."""

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None,
                logits_index: torch.Tensor | None = None) -> DraftOut:
        """Run ``batch``; logits at ``logits_index`` (int64 [B, m], None = every position) and the outputs at every
        position. In fixed shapes when :attr:`static` covers the batch, else dynamically."""
        self.forwards += 1
        out = None
        if self.static is not None:
            out = self.static(batch, logits_index, **({"features": features} if self.needs_aux else {}))
        if out is None:
            return self.run(batch, features, logits_index)
        return out["logits"], out.get("outputs")

    def use_fixed_shapes(self, enabled: bool = True, buckets: tuple[int, ...] | None = None,
                         kv_lengths: tuple[int, ...] | None = None) -> None:
        """Run the draft's forwards in fixed shapes (module docstring; CUDA graphs on CUDA), or dynamically
        (``enabled=False``: ``--eager``). ``buckets`` (row counts) and ``kv_lengths`` (attended cache lengths) as
        in :class:`~ssd_eagle.cuda_graphs.StaticForward`; None: the device's sets,
        :func:`~ssd_eagle.cuda_graphs.shape_sets` (up to ``DRAFT_MAX_ROWS`` rows)."""
        if not enabled:
            self.static = None
            return
        rows, lengths = shape_sets(self.device.type == "cuda", DRAFT_MAX_ROWS, self.kv.max_len)
        extra = {"features": ((self.hidden_size,), self.dtype)} if self.needs_aux else None

        def fn(batch: ForwardBatch, features: torch.Tensor | None = None,
               logits_index: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            logits, outputs = self.run(batch, features, logits_index)
            return {"logits": logits} if outputs is None else {"logits": logits, "outputs": outputs}

        self.static = StaticForward(fn, self.kv, scratch_slot=self.kv.num_slots - 1, dtype=self.dtype,
                                    device=self.device, buckets=buckets or rows, widths=None, extra_shapes=extra,
                                    copy_outputs=True, kv_lengths=kv_lengths or lengths)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [m, 3 * H_target] -> draft features [m, H] (EAGLE-3 only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no target features")

    def append_features(self, pending: torch.Tensor | None, aux: torch.Tensor) -> torch.Tensor:
        """``pending`` [m, H] (or None) followed by the fused features of ``aux`` [k + 1, 3 * H_target], the target's
        states of the verified inputs now committed (EAGLE-3 only)."""
        new = self.fuse(aux)
        return new if pending is None else torch.cat([pending, new])

    def extend(self, slots: list[int], chunks: list[list[int]], starts: list[int],
               features: list[torch.Tensor] | torch.Tensor | None = None) -> DraftOut:
        """Causal forward of ``chunks[b]`` at cache positions ``starts[b]..`` of slot ``slots[b]``.

        Args:
            features: EAGLE-3: per row float [len(chunks[b]), H] (or one padded [B, n, H]), else None.

        Returns:
            (logits [B, D], outputs [B, H] or None) after each row's last token.
        """
        batch = ForwardBatch.causal(chunks, slots, starts, self.dtype, self.device)
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        logits, hidden = self.forward(batch, self.pad_features(features, batch.input_ids.shape[1]), last[:, None])
        rows = torch.arange(len(chunks), device=self.device)
        return logits[:, 0], (hidden[rows, last] if hidden is not None else None)

    def step(self, slots: list[int], tokens: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
             visible: torch.Tensor, features: torch.Tensor | None = None) -> DraftOut:
        """One forward of ``tokens`` [B, n] with rotary ``positions``, stored at ``write``, attending ``visible``
        (module docstring). Returns (logits [B, n, D], outputs [B, n, H] or None)."""
        batch = ForwardBatch.build(tokens, positions, write, slots, visible, self.dtype, self.device,
                                   [tokens.shape[1]] * len(slots))
        return self.forward(batch, features)

    def chain_feed(self, slots: list[int], first: list[int]) -> Callable[..., DraftOut]:
        """The ``feed`` of :func:`~ssd_eagle.drafters.chain.draft_chain` for chains continuing the committed text:
        chain index i of row r sits at cache position ``first[r] + i``."""
        def feed(rows: list[int], tokens: torch.Tensor, features: torch.Tensor | None, index: int) -> DraftOut:
            return self.extend([slots[r] for r in rows], tokens[:, None].tolist(), [first[r] + index for r in rows],
                               None if features is None else features[:, None])
        return feed

    def pad_features(self, features: list[torch.Tensor] | torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Per-row features [m_b, H] right-padded with zeros to one [B, n, H] (a tensor or None is returned as is)."""
        if features is None or isinstance(features, torch.Tensor):
            return features
        out = torch.zeros(len(features), n, self.hidden_size, dtype=self.dtype, device=self.device)
        for row, f in enumerate(features):
            out[row, : f.shape[0]] = f
        return out


class DraftLMBackend(DraftBackend):
    """A transformers causal LM with the target's vocabulary (classic SD's draft model); ``num_slots`` sequence
    slots (plus the scratch slot), ``fixed_shapes`` as in :meth:`DraftBackend.use_fixed_shapes`.

    A draft vocabulary recorded in the model's config (:func:`~ssd_eagle.models.draft_lm.draft_vocab_ids`) keeps
    only those rows of the output layer (a copy, D x H): logits are [.., D] and :attr:`vocab` maps them, as for an
    EAGLE-3 head. The output layer is most of a small draft's step: SmolLM2's 4-layer draft 17.7 -> 10.8 ms a
    token with 8192 of 49152 rows (bf16, one thread, Xeon with AMX).
    """

    def __init__(self, model, num_slots: int, max_len: int, fixed_shapes: bool = True):
        self.runner = ModelRunner(model, num_slots + 1, max_len)
        self.kv = self.runner.kv
        self.dtype, self.device = self.runner.dtype, self.runner.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        ids = draft_vocab_ids(model.config)
        if ids is not None:
            head = self.runner.lm_head
            rows = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None, device=self.device,
                             dtype=head.weight.dtype)
            with torch.no_grad():
                rows.weight.copy_(head.weight[ids.to(head.weight.device)])
                if head.bias is not None:
                    rows.bias.copy_(head.bias[ids.to(head.bias.device)])
            self.runner.lm_head = rows.requires_grad_(False)
            if self.runner.packed_weights:
                pack_linears(rows)
        self.set_vocab(ids, self.vocab_size)
        self.temperature_scale = draft_temperature_scale(getattr(model.config, "ssd_eagle", None))
        self.use_fixed_shapes(fixed_shapes)

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    def prefill(self, slot: int, token_ids: list[int], aux=None, start: int = 0, end: int | None = None,
                pending=None) -> None:
        end = len(token_ids) - 1 if end is None else end
        if end > start:
            self.write(slot, token_ids[start:end], start, None)
        return None

    def write(self, slot: int, tokens: list[int], start: int, features=None) -> None:
        batch = ForwardBatch.causal([tokens], [slot], [start], self.dtype, self.device)
        self.runner.forward(batch, compute_logits=False)

    def run(self, batch: ForwardBatch, features=None, logits_index=None) -> DraftOut:
        return self.runner.forward(batch, logits_index=logits_index).logits, None


class Eagle3Backend(DraftBackend):
    """An EAGLE-3 head (:class:`~ssd_eagle.models.eagle3.Eagle3DraftModel`) with the target's embeddings;
    ``num_slots`` sequence slots (plus the scratch slot), ``fixed_shapes`` as in
    :meth:`DraftBackend.use_fixed_shapes`."""

    offset = 1
    needs_aux = True

    def __init__(self, head, num_slots: int, max_len: int, fixed_shapes: bool = True):
        self.head = head.eval()
        head.follow_device()
        cfg = head.config
        param = head.lm_head.weight
        self.dtype, self.device = param.dtype, param.device
        self.kv = KVCache(1, num_slots + 1, cfg.num_key_value_heads, cfg.head_dim, max_len, self.dtype,
                          self.device)
        self.hidden_size = cfg.hidden_size
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)
        self.vocab_size = cfg.vocab_size
        self.set_vocab(head.draft_target_ids, cfg.vocab_size)
        self.temperature_scale = cfg.draft_temperature_scale or 1.0
        if packs_on(self.device):
            pack_linears(head)
        self.use_fixed_shapes(fixed_shapes)

    @property
    def model(self) -> nn.Module:
        return self.head

    @torch.inference_mode()
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.head.fuse(aux.to(device=self.device, dtype=self.dtype))

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], aux: torch.Tensor | None, start: int = 0,
                end: int | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
        if aux is None or (start > 0 and pending is None):
            raise ValueError("an EAGLE-3 draft needs the target's aux hidden states of the prompt (and, after the "
                             "first chunk, the features the previous chunk left pending)")
        end = len(token_ids) - 1 if end is None else end
        fused = self.fuse(aux)  # features of token positions start .. end-1
        if start > 0:
            fused = torch.cat([pending, fused])  # from start - 1: position t's entry is the pair (f_{t-1}, x_t)
        first = max(start, 1)  # token position 0 has no entry (no feature before it)
        if end > first:  # pairs (f_{t-1}, x_t) for first <= t < end go to the cache; the last feature stays pending
            self.write(slot, token_ids[first:end], first - 1, fused[:-1])
        return fused[-1:]

    @torch.inference_mode()
    def write(self, slot: int, tokens: list[int], start: int, features: torch.Tensor) -> None:
        batch = ForwardBatch.causal([tokens], [slot], [start], self.dtype, self.device)
        self.head(batch.input_ids, features[None], batch.position_ids, batch.attn_mask, self.kv.bind(batch))

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, features: torch.Tensor, logits_index=None) -> DraftOut:
        out = self.head(batch.input_ids, features, batch.position_ids, batch.attn_mask, self.kv.bind(batch))
        selected = out if logits_index is None else out.gather(
            1, logits_index[..., None].expand(-1, -1, out.shape[-1]))
        return upcast_logits(self.head.compute_logits(selected)), out
