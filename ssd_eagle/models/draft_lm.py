"""Loading the draft LMs ssd-eagle exports (``train/draft_lm.py`` trains and saves them): a plain transformers folder,
or a **compact** export that stores only the trained tensors (``draft_lm.safetensors``) and takes its token embedding
and output layer from the target, checked by a SHA-256 of the target's embedding table.

Either layout may carry a **draft vocabulary** in ``config.json`` (``ssd_eagle.draft_vocab``: ascending target ids,
the training data's most frequent assistant tokens): the engines then score only those rows of the output layer,
as an EAGLE-3 head drafts over its reduced vocabulary (:func:`draft_vocab_ids`). Transformers, vLLM and SGLang
ignore the record and use the whole layer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

COMPACT_WEIGHTS = "draft_lm.safetensors"
EMBED_NAME = "model.embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


DIGEST_KEY = "embed_sha256_bf16"  # the identity a compact export records (``ssd_eagle.shared_from_target``)
LEGACY_DIGEST_KEY = "embed_sha256"  # older exports: SHA-256 of the float32 bytes (only a float32/float64 target)
DRAFT_VOCAB_KEY = "draft_vocab"  # ``ssd_eagle.draft_vocab`` in config.json: the output rows the engines draft over
# ``ssd_eagle.draft_temperature_scale`` in config.json (draft LMs and EAGLE-3 heads): the s of a sampled row's
# q = softmax(z / (T s)) (:mod:`ssd_eagle.drafters.chain`), written by ``python -m train.calibrate``
TEMPERATURE_SCALE_KEY = "draft_temperature_scale"
MIN_TEMPERATURE_SCALE = 0.01  # below it softmax(z / (T s)) is a point mass, or overflows float32 logits


def embedding_digest(weight: torch.Tensor) -> str:
    """SHA-256 of the table rounded to bfloat16 (identifies the target embedding a compact draft LM needs).

    The same checkpoint loaded in float32, float64 or bfloat16 gives the same digest: rounding to bfloat16 is
    exact on a float32 -> float64 widening and idempotent on a table already rounded to bfloat16. (A float16 load
    rounds first to float16, which can move a value to the other side of a bfloat16 rounding boundary.)

    Args:
        weight: float [vocab, hidden], any float dtype, any device.
    """
    bits = weight.detach().to("cpu").to(torch.bfloat16).contiguous().view(torch.int16)
    return hashlib.sha256(bits.numpy().tobytes()).hexdigest()


def _legacy_digest(weight: torch.Tensor) -> str:
    return hashlib.sha256(weight.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


def draft_vocab_ids(config) -> torch.Tensor | None:
    """The draft vocabulary a draft LM's config records (``config.ssd_eagle["draft_vocab"]``), or None (the whole
    output layer).

    Returns:
        int64 [D], ascending target ids (D < V).

    Raises:
        ValueError: ids not strictly ascending or outside ``[0, vocab_size)``.
    """
    record = getattr(config, "ssd_eagle", None) or {}
    ids = record.get(DRAFT_VOCAB_KEY)
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.ndim != 1 or ids.numel() == 0 or (ids[1:] <= ids[:-1]).any() or ids[0] < 0 \
            or ids[-1] >= config.vocab_size:
        raise ValueError(f"ssd_eagle.{DRAFT_VOCAB_KEY} must be ascending target ids in [0, {config.vocab_size})")
    return ids


def check_temperature_scale(value, where: str = "") -> float:
    """``value`` as a draft temperature scale s: a finite number >= :data:`MIN_TEMPERATURE_SCALE`.

    Raises:
        ValueError: anything else (the message names ``ssd_eagle.draft_temperature_scale`` and ``where``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not MIN_TEMPERATURE_SCALE <= value < float("inf"):
        raise ValueError(f"{where + ': ' if where else ''}ssd_eagle.{TEMPERATURE_SCALE_KEY} must be a number >= "
                         f"{MIN_TEMPERATURE_SCALE}, got {value!r}")
    return float(value)


def draft_temperature_scale(record: dict | None, where: str = "") -> float:
    """The draft's temperature scale s recorded in a ``config.json``'s ``ssd_eagle`` block (1.0 when absent or
    null).

    Raises:
        ValueError: a recorded s that :func:`check_temperature_scale` refuses.
    """
    value = (record or {}).get(TEMPERATURE_SCALE_KEY)
    return 1.0 if value is None else check_temperature_scale(value, where)


def check_target_embeddings(path: Path, shared: dict, target) -> None:
    """Check that ``target`` supplies the embedding table the compact draft at ``path`` was trained with.

    Raises:
        ValueError: the digests differ, or only a legacy float32 digest is recorded and the target's weights are
            neither float32 nor float64 (that digest cannot be recomputed from a rounded table).
    """
    weight = target.get_input_embeddings().weight
    if shared.get(DIGEST_KEY) is not None:
        expected, found = shared[DIGEST_KEY], embedding_digest(weight)
    elif shared.get(LEGACY_DIGEST_KEY) is not None:
        if weight.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{path} records only a float32 digest of its target's embeddings ({LEGACY_DIGEST_KEY}), "
                             f"which a {weight.dtype} target cannot reproduce: load the target in float32, or add "
                             f"{DIGEST_KEY} (ssd_eagle.models.draft_lm.embedding_digest) to its config.json")
        expected, found = shared[LEGACY_DIGEST_KEY], _legacy_digest(weight)
    else:
        return
    if expected != found:
        raise ValueError(f"{path} was trained with another target's embeddings (sha256 {expected} != {found})")


def assemble_draft_lm(config: LlamaConfig, trained: dict[str, torch.Tensor], target,
                      dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A complete ``LlamaForCausalLM``: the trained tensors plus the target's embedding (and untied output layer).

    Raises:
        ValueError: missing or unexpected trained tensors (listed), or an embedding whose shape does not fit.
    """
    model = LlamaForCausalLM(copy.deepcopy(config)).to(dtype)
    expected = set(model.state_dict()) - {EMBED_NAME, HEAD_NAME}
    missing, unexpected = sorted(expected - set(trained)), sorted(set(trained) - expected)
    if missing or unexpected:
        raise ValueError(f"draft LM weights do not fit the config: missing {missing}, unexpected {unexpected}")
    state = {k: v.to(dtype) for k, v in trained.items()}
    emb = target.get_input_embeddings().weight
    if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"target embeddings {tuple(emb.shape)} do not fit the draft config")
    state[EMBED_NAME] = emb.detach().to("cpu", dtype)
    if not config.tie_word_embeddings:
        state[HEAD_NAME] = target.get_output_embeddings().weight.detach().to("cpu", dtype)
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise ValueError("the draft LM's output layer is not tied to its embeddings")
    return model.eval()


def is_compact_draft_lm(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a compact draft LM export."""
    return (Path(path) / COMPACT_WEIGHTS).exists()


def load_draft_lm(path: str | os.PathLike, target=None, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a draft LM exported in either layout.

    Args:
        path: a plain transformers folder or a compact export.
        target: needed for a compact export (its embedding completes the model).

    Raises:
        ValueError: a compact export without ``target``, or a target whose embedding table differs from the one the
            draft was trained with (SHA-256 mismatch).
    """
    path = Path(path)
    if not is_compact_draft_lm(path):
        return LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if target is None:
        raise ValueError(f"{path} is a compact draft LM: pass the target model that supplies its embeddings")
    doc = json.loads((path / "config.json").read_text())
    record = doc.pop("ssd_eagle", {})
    check_target_embeddings(path, record.get("shared_from_target", {}), target)
    for key in ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype"):
        doc.pop(key, None)
    config = LlamaConfig(**doc)
    draft_temperature_scale(record, str(path / "config.json"))  # (refused here, not where a backend is built)
    kept = {key: record[key] for key in (DRAFT_VOCAB_KEY, TEMPERATURE_SCALE_KEY) if key in record}
    if kept:
        config.ssd_eagle = kept
    return assemble_draft_lm(config, load_file(str(path / COMPACT_WEIGHTS)), target, dtype)


def load_draft_model(path: str | os.PathLike, target_model) -> LlamaForCausalLM:
    """The draft causal LM at ``path`` (a compact export, a plain folder, or a hub id) in the target's dtype and on
    its device, checked to share the target's vocabulary.

    Raises:
        ValueError: a vocabulary other than the target's, or a compact export trained with another target.
        FileNotFoundError: nothing at ``path``.
    """
    param = next(target_model.parameters())
    if is_compact_draft_lm(path):
        model = load_draft_lm(path, target=target_model, dtype=param.dtype).to(param.device)
    else:
        from ssd_eagle.assets import load_model

        model, _ = load_model(str(path), dtype=param.dtype, device=param.device)
    vocab = model.get_output_embeddings().weight.shape[0]
    expected = target_model.config.get_text_config().vocab_size
    if vocab != expected:
        raise ValueError(f"draft model vocabulary ({vocab}) must equal the target's ({expected})")
    return model
