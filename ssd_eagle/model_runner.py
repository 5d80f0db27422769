"""Runs a transformers causal LM (the target, or a draft LM) over new tokens with a :class:`KVCache`.

The model is used as transformers builds it: its decoder body is called with our cache and a prepared 4-D mask,
and its output embedding is applied only at the positions whose logits are needed (on SmolLM2 the output layer
alone costs about as much as the whole body for one token). The EAGLE-3 aux hidden states are read with forward
pre-hooks on the decoder layers, in the layer-id convention of ``docs/design.md`` section 2:

    id i = the residual stream at the *input* of decoder layer i = ``hidden_states[i]`` of transformers'
    ``output_hidden_states`` (``hidden_states[0]`` is the embedding output, ``hidden_states[L]`` for an L-layer
    model the final-normed output). The default ids for an L-layer target are ``(2, L // 2, L - 3)``.

This is also vLLM's convention for ``eagle_aux_hidden_state_layer_ids``.

A batch of single-token rows (a decode round) attends over the longest row's cache length, padded by the mask.
On CPU the target attends through :func:`ragged_decode_attention` instead, registered with transformers'
``AttentionInterface``: each row attends over its own cached prefix, so a batch mixing short and long contexts does
not pay for the padding (attention over the padded length was most of a regeneration step: 96 rows, contexts of
50 to 2000 tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ssd_eagle.kv_cache import ForwardBatch, KVCache, cache_kwarg
from ssd_eagle.packed_linear import has_fp16_weights, pack_linears, packs_on, unpack_linears
from ssd_eagle.sampling import upcast_logits

RAGGED_ATTENTION = "ssd_eagle_ragged_sdpa"
RAGGED_MIN_PADDING = 0.2  # share of a padded batch's attention that is padding before rows attend one by one
RAGGED_MIN_KV_LEN = 256  # (below, the padding costs less than a call per row)


def ragged_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (``sdpa_attention_forward``), except for single-token rows whose additive mask
    shows each a prefix of the keys: each row then attends over its own prefix only, with grouped key/value heads
    packed as transformers packs them (no copy of the cache).

    Args:
        query: [B, heads, q_len, head_dim]; key, value: [B, kv_heads, kv_len, head_dim] (views of the cache).
        attention_mask: [B, 1, q_len, kv_len] additive (0 visible) or boolean, or None.

    Returns:
        ([B, q_len, heads, head_dim], None), as ``sdpa_attention_forward``.
    """
    lengths = _prefix_lengths(attention_mask, query, dropout)
    if lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    B, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out = query.new_empty(B, kv_heads, heads // kv_heads, dim)
    grouped = query.reshape(B, kv_heads, heads // kv_heads, dim)  # (transformers' pack_gqa for one query token)
    for row, n in enumerate(lengths):
        out[row] = torch.nn.functional.scaled_dot_product_attention(
            grouped[row: row + 1], key[row: row + 1, :, :n], value[row: row + 1, :, :n], scale=scaling)[0]
    return out.reshape(B, 1, heads, dim), None


def _prefix_lengths(mask: torch.Tensor | None, query: torch.Tensor, dropout: float) -> list[int] | None:
    """Each row's visible prefix length when every row is one token seeing a prefix of the keys, the batch attends
    over at least ``RAGGED_MIN_KV_LEN`` keys and padding is at least ``RAGGED_MIN_PADDING`` of its attention; else
    None."""
    if mask is None or dropout or query.shape[2] != 1 or query.shape[0] == 1 or mask.shape[1] != 1 \
            or mask.shape[-1] < RAGGED_MIN_KV_LEN or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    visible = mask[:, 0, 0] if mask.dtype == torch.bool else mask[:, 0, 0] == 0
    lengths = visible.sum(-1)
    kv_len = visible.shape[-1]
    if int(lengths.sum()) > (1 - RAGGED_MIN_PADDING) * kv_len * len(lengths) or int(lengths.min()) < 1 \
            or not torch.equal(visible, torch.arange(kv_len, device=mask.device) < lengths[:, None]):
        return None
    return lengths.tolist()


AttentionInterface.register(RAGGED_ATTENTION, ragged_decode_attention)
AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)  # (masks built by transformers: as SDPA's)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (low, mid, high) capture points for an L-layer target, input-of-layer convention.

    ``(2, L//2, L-3)`` when those are strictly increasing (L >= 7); for shallower models ``(0, L//2, L)``, which
    stays distinct and non-negative down to L = 2.

    Raises:
        ValueError: L < 2.
    """
    if num_layers < 2:
        raise ValueError(f"an EAGLE-3 target needs at least 2 layers, got {num_layers}")
    ids = (2, num_layers // 2, num_layers - 3)
    if ids[0] < ids[1] < ids[2]:
        return ids
    return (0, num_layers // 2, num_layers)


@dataclass
class RunnerOutput:
    """What one forward returns.

    Attributes:
        logits: float32 (float64 for a float64 model) [B, m, V] at the requested positions (m = n when all were
            requested; :func:`~ssd_eagle.sampling.upcast_logits`).
        aux_hidden: float [B, n, 3 * H] (low, mid, high concatenated) or None when not requested.
        hidden: float [B, n, H], the body's final-normed hidden states.
    """

    logits: torch.Tensor | None
    aux_hidden: torch.Tensor | None
    hidden: torch.Tensor


class ModelRunner:
    """Owns a causal LM and its :class:`KVCache`.

    Args:
        model: a transformers ``*ForCausalLM`` (Llama family, or any whose attention calls ``cache.update``).
        num_slots: concurrent sequences.
        max_len: positions per slot (sequence length plus draft/tree positions).
        aux_layer_ids: capture these aux hidden states when a forward asks for them (None: no hooks).
        compile: run the decoder body through ``torch.compile`` (inductor, dynamic shapes). On one CPU core it
            cuts a SmolLM2 decode step from ~70 to ~50 ms, at the price of about a minute of compilation per new
            input shape (cached on disk by inductor).
        ragged_attention: on CPU (not compiled), attend through :func:`ragged_decode_attention` (the engine's
            target, whose decode rounds batch many contexts).
        packed_weights: run the model's bf16 linear layers from weights reordered once for oneDNN
            (:func:`~ssd_eagle.packed_linear.pack_linears`; ~1.3x a SmolLM2 decode step on a CPU with AMX). None:
            on CPU, not compiled, where :func:`~ssd_eagle.packed_linear.packs_on`.
    """

    def __init__(self, model: nn.Module, num_slots: int, max_len: int,
                 aux_layer_ids: tuple[int, ...] | None = None, initial_capacity: int = 256,
                 compile: bool = False, ragged_attention: bool = False, packed_weights: bool | None = None):
        self.model = model.eval()
        self.config = model.config
        self.body = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        cfg = self.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        # a tensor-parallel shard holds only its kv heads (a DTensor weight knows its local shape)
        k_weight = self.body.layers[0].self_attn.k_proj.weight
        kv_heads = k_weight.to_local().shape[0] // head_dim if hasattr(k_weight, "to_local") \
            else cfg.num_key_value_heads
        self.kv = KVCache(self.num_layers, num_slots, kv_heads, head_dim, max_len, self.dtype, self.device,
                          initial_capacity)
        self._cache_kwarg = cache_kwarg(self.body.forward)
        self.aux_layer_ids = tuple(aux_layer_ids) if aux_layer_ids is not None else None
        self._captured: dict[int, torch.Tensor] | None = None
        if self.aux_layer_ids is not None:
            self._install_aux_hooks(self.aux_layer_ids)
        if ragged_attention and self.device.type == "cpu" and not compile \
                and self.config._attn_implementation == "sdpa" and not hasattr(k_weight, "to_local"):  # (CUDA graphs and compiled graphs keep plain SDPA)
            self.model.set_attn_implementation(RAGGED_ATTENTION)
        if packed_weights is None:
            packed_weights = packs_on(self.device) and not compile
        if packed_weights:
            self.packed_weights = pack_linears(self.model) > 0
        else:  # (another runner may have packed this model: compiled graphs cannot trace the packed kernel)
            unpack_linears(self.model)
            self.packed_weights = False
        if compile:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.body = torch.compile(self.body, dynamic=True)

    @functools.cached_property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the target is served in (``--dtype``; what ``/health`` reports): float16 for a float32 model
        whose linear weights are all float16 values (``--dtype float16`` on a CPU,
        :func:`~ssd_eagle.assets.load_model`), else :attr:`dtype`, the dtype it computes in. Read once (a scan of
        the weights)."""
        return torch.float16 if self.dtype == torch.float32 and has_fp16_weights(self.model) else self.dtype

    def _install_aux_hooks(self, ids: tuple[int, ...]) -> None:
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > self.num_layers:
            raise ValueError(f"aux_layer_ids must be distinct and in [0, {self.num_layers}], got {list(ids)}")
        for layer_id in ids:
            if layer_id == self.num_layers:
                self.body.norm.register_forward_hook(self._make_hook(layer_id, output=True))
            else:
                self.body.layers[layer_id].register_forward_pre_hook(self._make_hook(layer_id), with_kwargs=True)

    def _make_hook(self, layer_id: int, output: bool = False):
        def pre_hook(module, args, kwargs):
            if self._captured is not None:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        def post_hook(module, args, result):
            if self._captured is not None:
                self._captured[layer_id] = result
        return post_hook if output else pre_hook

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None = None,
                capture_aux: bool = False, compute_logits: bool = True) -> RunnerOutput:
        """Run the new tokens of ``batch``; their keys/values land in the cache.

        Args:
            batch: tokens, positions, slots and mask (see :class:`ForwardBatch`).
            logits_index: int64 [B, m] positions (0..n-1) whose logits to compute; None = all n.
            capture_aux: also return the aux hidden states (needs ``aux_layer_ids``).
            compute_logits: False skips the output layer (e.g. prefill of a drafter that needs no logits).
        """
        if capture_aux and self.aux_layer_ids is None:
            raise ValueError("capture_aux needs aux_layer_ids")
        self._captured = {} if capture_aux else None
        try:
            out = self.body(input_ids=batch.input_ids, position_ids=batch.position_ids,
                            attention_mask=None if batch.maskless else batch.attn_mask, use_cache=True,
                            **{self._cache_kwarg: self.kv.bind(batch)})
            aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if capture_aux else None
        finally:
            self._captured = None
        hidden = out.last_hidden_state
        logits = None
        if compute_logits:
            selected = hidden if logits_index is None else hidden.gather(
                1, logits_index[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = upcast_logits(self.lm_head(selected))
        return RunnerOutput(logits=logits, aux_hidden=aux, hidden=hidden)
