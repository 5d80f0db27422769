"""A small draft LM made from the target: its first layers plus its final norm and output layer, distilled with KL
to the target's next-token distribution (the SSD paper's standalone-draft setting; what a transformers user passes
as ``assistant_model``). Built with transformers' ``LlamaForCausalLM``; no modeling code is copied.

What trains: the kept decoder layers and the final norm. The token embeddings and the output layer stay the
target's (frozen): the draft embeds with the target's table and scores with the target's output layer, so neither
is duplicated during training nor stored in checkpoints.

Export layouts (:func:`save_draft_lm`):

* **plain**: a complete transformers folder (``config.json``, ``model.safetensors``, ``generation_config.json``)
  that ``AutoModelForCausalLM.from_pretrained`` loads. The output layer is tied to the embeddings exactly when the
  target's is (the draft's head *is* the target's head), so a tied target's 49152x576 table is stored once --
  but even once it is 28.3 M parameters, 56.6 MB in bf16.
* **compact**: only the trained tensors (``draft_lm.safetensors``) plus ``config.json`` with an ``ssd_eagle.
  shared_from_target`` record (tensor names, target name, and a SHA-256 of the target's embedding table).
  ``from_pretrained`` refuses the folder loudly (no ``model.safetensors``) instead of initialising the missing
  embedding at random; :func:`ssd_eagle.models.draft_lm.load_draft_lm` (what the engines call) fills it from the
  target (checking the hash), and
  ``python -m train.export --materialize`` writes the plain folder.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from ssd_eagle.io import atomic_write
from ssd_eagle.models.draft_lm import (COMPACT_WEIGHTS, DIGEST_KEY, EMBED_NAME, HEAD_NAME, assemble_draft_lm,
                                       embedding_digest)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def draft_lm_config(target_config, num_layers: int) -> LlamaConfig:
    """The draft's ``LlamaConfig``: the target's (text) config with ``num_layers`` layers.

    ``tie_word_embeddings`` is set explicitly, not inherited: True exactly when the target ties its output layer to
    its embeddings, since the draft's output layer is the target's.

    Raises:
        ValueError: ``num_layers`` not in [1, L]; a target that is not Llama-architecture.
    """
    t = _text_config(target_config)
    if getattr(t, "model_type", "llama") != "llama":
        raise ValueError(f"the draft LM is built with LlamaForCausalLM; target model_type is {t.model_type!r}")
    if not 1 <= num_layers <= t.num_hidden_layers:
        raise ValueError(f"draft_lm_layers must be in [1, {t.num_hidden_layers}], got {num_layers}")
    values = t.to_dict()
    for key in ("architectures", "_name_or_path", "_model_name_or_path", "transformers_version", "model_type",
                "quantization_config", "layer_types", "dtype", "torch_dtype"):
        values.pop(key, None)
    values["num_hidden_layers"] = num_layers
    values["tie_word_embeddings"] = bool(getattr(t, "tie_word_embeddings", False))
    cfg = LlamaConfig(**values)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


class DraftLMBody(nn.Module):
    """The trainable part of the draft LM: transformers' ``LlamaModel`` without its embedding table.

    The forward takes the target's (frozen) token embeddings and returns the final-normed hidden states; the loss
    scores them with the target's output layer (:func:`kl_loss`).

    Args:
        config: the draft's :func:`draft_lm_config`.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        model = LlamaForCausalLM(config).model
        model.embed_tokens = None  # the target's table is used; keep it out of optimizer and ZeRO partitions
        self.model = model

    @classmethod
    def from_target(cls, target, num_layers: int, dtype: torch.dtype = torch.float32) -> DraftLMBody:
        """Copy the target's first ``num_layers`` decoder layers and its final norm."""
        cfg = draft_lm_config(target.config, num_layers)
        body = cls(cfg).to(dtype)
        src = target.get_decoder()
        with torch.no_grad():
            for i in range(num_layers):
                body.model.layers[i].load_state_dict(src.layers[i].state_dict())
            body.model.norm.load_state_dict(src.norm.state_dict())
        return body

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n, H] target embeddings -> [B, n, H] final-normed hidden states (causal)."""
        return self.model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False).last_hidden_state

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained tensors under ``LlamaForCausalLM`` names (``model.layers.*``, ``model.norm.weight``)."""
        return {f"model.{k}": v for k, v in self.model.state_dict().items()}


class _FusedKL(torch.autograd.Function):
    """Row-wise ``KL(softmax(th W^T) || softmax(h W^T))`` and the draft's argmax for one chunk of rows; the gradient
    factor ``q - p`` is formed in the forward pass, so backward is one matmul and no logits are recomputed."""

    @staticmethod
    def forward(ctx, h, th, w):
        logq = torch.log_softmax(h.float() @ w.T, dim=-1)
        logp = torch.log_softmax(th.float() @ w.T, dim=-1)
        p = logp.exp()
        kl = (p * (logp - logq)).sum(-1)
        argmax = logq.argmax(-1)
        ctx.mark_non_differentiable(argmax)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logq.exp_().sub_(p), w)
            ctx.in_dtype = h.dtype
        return kl, argmax

    @staticmethod
    def backward(ctx, grad_kl, grad_argmax):
        diff, w = ctx.saved_tensors
        return ((diff * grad_kl[:, None]) @ w).to(ctx.in_dtype), None, None


def kl_loss(hidden: torch.Tensor, target_hidden: torch.Tensor, lm_head_weight: torch.Tensor,
            loss_mask: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean ``KL(p_target || q_draft)`` over positions that predict an assistant token.

    Position ``s`` predicts ``x_{s+1}``; it counts when ``loss_mask[s + 1] == 1``. Both distributions use the
    target's output layer (frozen), over the full vocabulary, ``chunk`` positions at a time; the gradient w.r.t.
    ``hidden`` is ``(q - p) W`` (formed in the forward pass: [valid positions, V] float32 kept for backward).

    Args:
        hidden: [B, n, H] the draft's final-normed states; target_hidden: [B, n, H] the target's.
        lm_head_weight: [V, H]; loss_mask: [B, n] 0/1.

    Returns:
        ``(loss scalar, argmax int64 [B, n] of the draft (-1 where not computed), valid bool [B, n])``.
    """
    b, n, h = hidden.shape
    valid = torch.zeros(b, n, dtype=torch.bool, device=hidden.device)
    valid[:, :-1] = loss_mask[:, 1:].bool()
    rows = valid.flatten().nonzero().flatten()
    flat_h = hidden.reshape(-1, h)
    flat_t = target_hidden.reshape(-1, h)
    w = lm_head_weight.detach().float()
    total = hidden.new_zeros((), dtype=torch.float32)
    argmax = torch.full((b * n,), -1, dtype=torch.long, device=hidden.device)
    for i in range(0, rows.numel(), chunk):
        idx = rows[i:i + chunk]
        kl, am = _FusedKL.apply(flat_h[idx], flat_t[idx], w)
        total = total + kl.sum()
        argmax[idx] = am
    return total / max(rows.numel(), 1), argmax.view(b, n), valid


# ----------------------------------------------------------------------------------------------------------------
# export / import

def save_draft_lm(config: LlamaConfig, trained: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                  target=None, target_name: str | None = None, compact: bool = False,
                  dtype: torch.dtype = torch.bfloat16, tokenizer=None, extra_files: dict[str, str] | None = None
                  ) -> Path:
    """Write the draft LM (plain or compact layout, module docstring) atomically; an existing folder is replaced.

    Args:
        config: the draft's ``LlamaConfig`` (its ``ssd_eagle.draft_vocab``, when set, is written in both layouts);
            trained: its trained tensors (:meth:`DraftLMBody.trained_state_dict`).
        target: the target model (its embedding completes a plain folder; its hash is recorded in a compact one).
        target_name: recorded in a compact folder's config.
        dtype: storage dtype.
        tokenizer: saved into the folder when given.
        extra_files: name -> text (e.g. the model card ``README.md``).

    Raises:
        ValueError: see :func:`assemble_draft_lm`; a plain export without ``target``.
    """
    if target is None:
        raise ValueError("exporting a draft LM needs the target (its embedding table)")
    out = Path(out_dir)
    with atomic_write(out, folder=True) as tmp:
        if compact:
            cfg = copy.deepcopy(config)
            cfg.dtype = str(dtype).removeprefix("torch.")  # (transformers 5: `torch_dtype` is deprecated)
            doc = cfg.to_dict()
            doc["ssd_eagle"] = dict(doc.get("ssd_eagle") or {}, shared_from_target={  # keeps a draft_vocab
                "tensors": [EMBED_NAME] + ([] if config.tie_word_embeddings else [HEAD_NAME]),
                "target": target_name,
                DIGEST_KEY: embedding_digest(target.get_input_embeddings().weight)})
            (tmp / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
            tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in trained.items()}
            save_file(tensors, str(tmp / COMPACT_WEIGHTS), metadata={"format": "pt"})
            GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        else:
            model = assemble_draft_lm(config, trained, target, dtype)
            model.generation_config = GenerationConfig.from_model_config(model.config)
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out


