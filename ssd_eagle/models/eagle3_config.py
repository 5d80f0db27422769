"""Configuration of the EAGLE-3 head (:class:`Eagle3Config`) and the helpers that read transformers configs.

The head's geometry is copied from the target (:meth:`Eagle3Config.from_target`) and checked against it
(:meth:`Eagle3Config.validate_against_target`); rope settings are normalised to transformers v5
``rope_parameters`` (``rope_type`` + ``rope_theta``) whichever keys a config uses. The aux layer ids follow the
input-of-layer convention of ``docs/design.md`` section 2.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch
from transformers import LlamaConfig

from ssd_eagle.model_runner import default_aux_layer_ids


# the head's fields that are a one-layer Llama's, under the same names in ``LlamaConfig`` and in ``config.json``
LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias")


# ----------------------------------------------------------------------------------------------------------------
# helpers on transformers configs

def text_config(config):
    """The text part of a (possibly multimodal) transformers config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def normalize_rope_parameters(rope: dict | None, rope_theta: float | None = None) -> dict:
    """A comparable copy of a rope dict in transformers v5 form (``rope_type`` and ``rope_theta`` keys).

    Accepts v5 ``rope_parameters`` or a legacy ``rope_scaling`` (whose ``type`` key becomes ``rope_type``) plus a
    separate ``rope_theta``.
    """
    out = dict(rope or {})
    if "type" in out:
        out.setdefault("rope_type", out["type"])
        del out["type"]
    out.setdefault("rope_type", "default")
    if "rope_theta" not in out:
        out["rope_theta"] = float(rope_theta if rope_theta is not None else 10000.0)
    return out


def rope_parameters_of(config) -> dict:
    """The rope settings of a transformers config, normalized (v5 ``rope_parameters`` or legacy fields).

    Models with per-layer-type rope (v5 Gemma3: ``{"full_attention": {...}, "sliding_attention": {...}}``) give
    the ``full_attention`` entry, the rope of their global-attention layers.
    """
    config = text_config(config)
    rope = getattr(config, "rope_parameters", None)
    if rope is None:
        rope = getattr(config, "rope_scaling", None)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    return normalize_rope_parameters(rope, getattr(config, "rope_theta", None))


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "float32"
    return str(dtype).removeprefix("torch.")


def scaled_geometry(target: dict, hidden_size: int) -> dict:
    """The midlayer geometry of a head ``hidden_size`` wide, scaled from the target's (``target``: the values
    :meth:`Eagle3Config.from_target` copied): ``head_dim`` kept, ``num_attention_heads = hidden_size / head_dim``,
    ``num_key_value_heads`` in the target's query/kv ratio, ``intermediate_size`` in the target's
    intermediate/hidden ratio (rounded to a multiple of 64). For SmolLM2-135M (576 wide, 9/3 heads of 64, MLP 1536)
    at 384: 6/2 heads of 64, MLP 1024.

    Raises:
        ValueError: ``hidden_size`` not a positive multiple of ``head_dim``, or a head count the kv ratio does
            not divide.
    """
    head_dim, heads, kv = target["head_dim"], target["num_attention_heads"], target["num_key_value_heads"]
    if hidden_size <= 0 or hidden_size % head_dim:
        raise ValueError(f"hidden_size {hidden_size} must be a positive multiple of the target's head_dim "
                         f"{head_dim} (or give num_attention_heads and head_dim explicitly)")
    new_heads = hidden_size // head_dim
    if (new_heads * kv) % heads:
        raise ValueError(f"hidden_size {hidden_size}: {new_heads} query heads cannot keep the target's "
                         f"{heads}/{kv} query/kv head ratio (give num_key_value_heads explicitly)")
    ratio = target["intermediate_size"] / target["hidden_size"]
    return {"hidden_size": hidden_size, "num_attention_heads": new_heads,
            "num_key_value_heads": new_heads * kv // heads, "head_dim": head_dim,
            "intermediate_size": max(64, round(hidden_size * ratio / 64) * 64)}


# ----------------------------------------------------------------------------------------------------------------
# config

@dataclass
class Eagle3Config:
    """Geometry and metadata of an EAGLE-3 head.

    Attributes:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
        hidden_act: the midlayer's Llama geometry (copied from the target by :meth:`from_target`). ``hidden_size``
            H may be narrower or wider than the target's: such a head owns its token embeddings [vocab, H]
            (:attr:`owns_embeddings`), as vLLM and SGLang load it.
        max_position_embeddings, rope_parameters: must equal the target's (transformers v5 ``rope_parameters``
            dict, with ``rope_type`` and ``rope_theta``).
        vocab_size: the target vocabulary (length of ``t2d``, of the shared embeddings).
        draft_vocab_size: rows of ``lm_head`` (length of ``d2t``).
        target_hidden_size: H_target; ``fc`` maps ``3 * target_hidden_size -> hidden_size``.
        aux_layer_ids: (low, mid, high) target layers whose *input* residual stream is captured
            (``docs/design.md`` section 2).
        attention_bias, mlp_bias: Llama options (False for every public EAGLE-3 head).
        torch_dtype: dtype name of the weights ("float32", "bfloat16", ...).
        saguaro_c, saguaro_fanout: the Saguaro (C, F) the head was trained for, when it was (issue 7).
        draft_temperature_scale: s > 0, sampled rows draw from ``softmax(z / (T s))`` (calibrated by ``python -m
            train.calibrate``; :mod:`ssd_eagle.drafters.chain`); None: 1.
        extra: free-form metadata saved with the checkpoint.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope_parameters: dict
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    saguaro_c: float | None = None
    saguaro_fanout: int | None = None
    draft_temperature_scale: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must hold 3 ids (low, mid, high), got {list(self.aux_layer_ids)}")
        self.rope_parameters = normalize_rope_parameters(self.rope_parameters)
        self.torch_dtype = _dtype_name(self.torch_dtype)
        if not isinstance(getattr(torch, self.torch_dtype, None), torch.dtype):
            raise ValueError(f"torch_dtype {self.torch_dtype!r} is not a torch dtype")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size}")
        if self.draft_temperature_scale is not None:
            from ssd_eagle.models.draft_lm import check_temperature_scale

            self.draft_temperature_scale = check_temperature_scale(self.draft_temperature_scale)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype)

    @property
    def owns_embeddings(self) -> bool:
        """True when H != H_target: the target's embeddings [vocab, H_target] cannot feed the head, which carries
        its own ``embed_tokens`` [vocab, H] (SGLang's ``set_embed`` keeps a draft's own table then; vLLM keeps an
        ``embed_tokens`` loaded from the checkpoint whose width differs from the target's)."""
        return self.hidden_size != self.target_hidden_size

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layer_ids: Iterable[int] | None = None,
                    **overrides) -> Eagle3Config:
        """Copy the midlayer geometry, rope settings and max positions from the target's transformers config.

        Args:
            target_config: the target's ``PretrainedConfig`` (a multimodal one is reduced to its text config).
            draft_vocab_size: rows of ``lm_head`` (<= the target vocabulary).
            aux_layer_ids: input-of-layer ids; default :func:`ssd_eagle.model_runner.default_aux_layer_ids`.
            overrides: any other field (e.g. ``intermediate_size``, ``torch_dtype``, ``saguaro_c``). A
                ``hidden_size`` other than the target's scales the geometry not overridden with it: the same
                ``head_dim``, ``num_attention_heads = H / head_dim``, the target's query/kv head ratio and its
                intermediate/hidden ratio (:func:`scaled_geometry`).

        Raises:
            ValueError: an unknown field; a width the target's geometry cannot be scaled to.
        """
        t = text_config(target_config)
        ids = tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(t.num_hidden_layers)
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        values = dict(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=t.rms_norm_eps,
            hidden_act=getattr(t, "hidden_act", None) or getattr(t, "hidden_activation", None) or "silu",
            max_position_embeddings=t.max_position_embeddings,
            rope_parameters=rope_parameters_of(t),
            vocab_size=t.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=t.hidden_size,
            aux_layer_ids=ids,
            torch_dtype=_dtype_name(getattr(t, "dtype", None)),
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown Eagle3Config fields: {sorted(unknown)}")
        width = overrides.get("hidden_size", t.hidden_size)
        if width != t.hidden_size:
            values.update(scaled_geometry(values, int(width)))
        values.update(overrides)
        return cls(**values)

    def saguaro_mismatch(self, c: float, fanouts: Iterable[int]) -> str | None:
        """Why serving with Saguaro ``c`` and the fan-outs ``fanouts`` of the drafted positions differs from the
        (C, F) this head was trained for (issue 7), or None when it matches or the head is a plain one. ``c = 1`` is
        "no Saguaro"."""
        if self.saguaro_c is None:
            return None
        served = sorted(set(int(f) for f in fanouts))
        if abs(float(c) - self.saguaro_c) < 1e-9 and served == [self.saguaro_fanout]:
            return None
        return (f"this EAGLE-3 head was trained for Saguaro sampling with C={self.saguaro_c}, F={self.saguaro_fanout} "
                f"but is served with C={c}, F={served}: its acceptance and cache hits will differ from training")

    def to_llama_config(self) -> LlamaConfig:
        """A one-layer transformers ``LlamaConfig`` with this geometry (used to build the reused modules)."""
        return LlamaConfig(num_hidden_layers=1, rope_parameters=copy.deepcopy(self.rope_parameters),
                           tie_word_embeddings=False, **{name: getattr(self, name) for name in LLAMA_FIELDS})

    def validate_against_target(self, target_config) -> None:
        """Check that this head fits the target.

        The head's own ``hidden_size`` may differ from the target's (:attr:`owns_embeddings`); ``fc``'s input
        width ``target_hidden_size`` may not.

        Raises:
            ValueError: naming every mismatched field: ``vocab_size``, ``target_hidden_size``, ``rope_parameters``,
                ``max_position_embeddings``, ``aux_layer_ids`` (out of ``[0, L]`` or not distinct).
        """
        t = text_config(target_config)
        problems = []
        if self.vocab_size != t.vocab_size:
            problems.append(f"vocab_size: draft {self.vocab_size} != target {t.vocab_size}")
        if self.target_hidden_size != t.hidden_size:
            problems.append(f"target_hidden_size: draft {self.target_hidden_size} != target {t.hidden_size} "
                            f"(fc reads 3 * target_hidden_size = {3 * self.target_hidden_size} features)")
        target_rope = rope_parameters_of(t)
        if normalize_rope_parameters(self.rope_parameters) != target_rope:
            problems.append(f"rope_parameters: draft {self.rope_parameters} != target {target_rope}")
        if self.max_position_embeddings != t.max_position_embeddings:
            problems.append(f"max_position_embeddings: draft {self.max_position_embeddings} "
                            f"!= target {t.max_position_embeddings}")
        num_layers = t.num_hidden_layers
        ids = list(self.aux_layer_ids)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
            problems.append(f"aux_layer_ids: {ids} must be distinct and in [0, {num_layers}] "
                            f"(input-of-layer convention, {num_layers}-layer target)")
        if problems:
            raise ValueError("EAGLE-3 head does not match the target: " + "; ".join(problems))
