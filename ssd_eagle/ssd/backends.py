"""The draft models a speculator can run, behind one interface.

Both are described in *token positions*: token position t is the t-th token of the sequence. A causal draft LM
stores the key/value of token t at cache position t. An EAGLE-3 head stores the pair ``(feature_{t-1}, token_t)``
at cache position ``t - 1`` (the pair's rotary position), so its ``offset`` is 1. With that convention the
speculator's bookkeeping is the same for both: ``num_cached`` is the first token position whose cache entry is not
valid for the committed text, and a forward over tokens at positions ``p..p+n-1`` returns, at each input, the draft
distribution of the token that follows it.

EAGLE-3 also needs a feature per input: the fused target aux states for committed tokens (``pending``), or the
head's own output at the previous position while drafting.
"""

from __future__ import annotations

import torch

from ssd_eagle.kv_cache import ForwardBatch, KVCache
from ssd_eagle.model_runner import ModelRunner


class DraftBackend:
    """Interface: ``offset``, ``hidden_size`` (None when the draft takes no features), ``dtype``, ``device``,
    ``prefill`` and ``forward``."""

    offset = 0
    hidden_size: int | None = None
    needs_aux = False
    aux_layer_ids: tuple[int, ...] | None = None

    def prefill(self, slot: int, token_ids: list[int], aux: torch.Tensor | None) -> torch.Tensor | None:
        """Cache every committed token but the last; return the features still pending (EAGLE) or None."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``batch`` (cache positions already offset); return draft logits in the *target* vocabulary
        [B, n, V] and the per-position outputs [B, n, H] to feed back (None for a draft LM)."""
        raise NotImplementedError

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DraftLMBackend(DraftBackend):
    """A transformers causal LM with the target's vocabulary."""

    def __init__(self, model, num_slots: int, max_len: int):
        self.runner = ModelRunner(model, num_slots, max_len)
        self.kv = self.runner.kv
        self.dtype, self.device = self.runner.dtype, self.runner.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    def prefill(self, slot: int, token_ids: list[int], aux=None) -> None:
        if len(token_ids) > 1:
            batch = ForwardBatch.causal([token_ids[:-1]], [slot], [0], self.dtype, self.device)
            self.runner.forward(batch, compute_logits=False)
        return None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, features=None):
        return self.runner.forward(batch).logits, None


class Eagle3Backend(DraftBackend):
    """An EAGLE-3 head (:class:`~ssd_eagle.models.eagle3.Eagle3DraftModel`) with the target's embeddings."""

    offset = 1
    needs_aux = True

    def __init__(self, head, num_slots: int, max_len: int):
        self.head = head.eval()
        cfg = head.config
        param = head.lm_head.weight
        self.dtype, self.device = param.dtype, param.device
        self.kv = KVCache(1, num_slots, cfg.num_key_value_heads, cfg.head_dim, max_len, self.dtype, self.device)
        self.hidden_size = cfg.hidden_size
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)
        self.vocab_size = cfg.vocab_size

    @torch.inference_mode()
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.head.fuse(aux.to(device=self.device, dtype=self.dtype))

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise ValueError("an EAGLE-3 speculator needs the target's aux hidden states of the prompt")
        fused = self.fuse(aux)  # features of token positions 0 .. N-2 (pairs with tokens 1 .. N-1)
        n = fused.shape[0]
        if n > 1:  # pairs (f_i, x_{i+1}) for i < n-1 go to the cache; the last stays pending
            batch = ForwardBatch.causal([token_ids[1:n]], [slot], [0], self.dtype, self.device)
            self.head(batch.input_ids, fused[None, : n - 1], batch.position_ids, batch.attn_mask,
                      self.kv.bind(batch))
        return fused[n - 1:]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, features: torch.Tensor):
        out = self.head(batch.input_ids, features, batch.position_ids, batch.attn_mask, self.kv.bind(batch))
        return self.head.to_target_logits(self.head.compute_logits(out)), out
