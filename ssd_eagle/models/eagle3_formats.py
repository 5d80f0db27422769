"""Checkpoint formats of the EAGLE-3 head: our export (``docs/design.md`` section 5, the layout vLLM and SGLang load),
vLLM's speculators format, and import of the public layouts. (What vLLM's and SGLang's loaders make of our export
is simulated for the tests in ``tests/engine_loaders.py``.)

Layouts read by :func:`load_eagle3` (public code checked, see each function):

* **EAGLE reference** (SafeAILab/EAGLE ``eagle/model/cnets.py``) and **SpecForge**
  (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``): ``config.json`` with
  ``architectures: ["LlamaForCausalLMEagle3"]``, Llama keys (``rope_theta``/``rope_scaling``), ``draft_vocab_size``;
  weights ``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and sometimes
  ``embed_tokens.weight``, in ``model.safetensors`` or ``pytorch_model.bin``; some exports prefix names with
  ``model.``. These configs usually record no aux layer ids (the reference uses ``(2, L//2, L-3)``), so a
  ``target_config`` is needed to fill them in.
* **vLLM speculators** (vllm-project/speculators ``src/speculators/models/eagle3/{config,core}.py``):
  ``speculators_model_type: "eagle3"``, the Llama keys under ``transformer_layer_config``, ``draft_vocab_size``,
  ``norm_before_residual``, ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` at top level, the
  proposal settings under ``speculators_config``; weights ``layers.0.*`` instead of ``midlayer.*``.

Aux layer ids without a declared convention are read as input-of-layer ids, the way vLLM reads
``eagle_aux_hidden_state_layer_ids`` (its target models append ``hidden_states + residual`` *before* running layer
``idx``). Our exports declare ``"eagle_aux_hidden_state_layer_ids_convention": "input_of_layer"``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from ssd_eagle.io import atomic_write
from ssd_eagle.model_runner import default_aux_layer_ids
from ssd_eagle.models.draft_lm import TEMPERATURE_SCALE_KEY
from ssd_eagle.models.eagle3 import Eagle3DraftModel, check_vocab_mapping
from ssd_eagle.models.eagle3_config import LLAMA_FIELDS, Eagle3Config, normalize_rope_parameters, text_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
AUX_IDS_CONVENTION = "input_of_layer"
CONVENTION_KEY = "eagle_aux_hidden_state_layer_ids_convention"
FORMAT_VERSION = 1

# architectures of one-layer EAGLE-3 heads in the HF-style layout (EAGLE reference / SpecForge / SGLang name, vLLM's
# internal name, and plain Llama as some public heads declare it)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")

# checkpoint tensor names of the head (besides the optional "embed_tokens.weight")
HEAD_TENSOR_NAMES = (
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
)
EMBED_NAME = "embed_tokens.weight"

_LLAMA_KEYS = LLAMA_FIELDS + ("rope_parameters", "rope_theta", "rope_scaling")  # what a config.json may give
_REQUIRED_LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")


# ----------------------------------------------------------------------------------------------------------------
# writing

def head_state_dict(model: Eagle3DraftModel, dtype: torch.dtype | None = None,
                    include_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """The head's tensors under checkpoint names (``docs/design.md`` section 5), on CPU, contiguous and unshared.

    Floating tensors are cast to ``dtype`` when given; ``d2t`` stays int64 and ``t2d`` bool. The owned
    ``embed_tokens.weight`` is included with ``include_embeddings`` (engines share the target's), and always for a
    head of another width than its target (``config.owns_embeddings``: vLLM and SGLang then use the checkpoint's
    [vocab, H] table, since the target's cannot feed the head).

    Raises:
        ValueError: inconsistent ``d2t``/``t2d`` (never written).
    """
    check_vocab_mapping(model.d2t, model.t2d, model.config.vocab_size)
    include_embeddings = include_embeddings or model.config.owns_embeddings
    out = {}
    for name, tensor in model.state_dict().items():
        if name == EMBED_NAME and not include_embeddings:
            continue
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous().clone()
    return out


def _legacy_rope(rope: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) for engines that still read the pre-v5 keys."""
    rope = normalize_rope_parameters(rope)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return rope["rope_theta"], (None if rope["rope_type"] == "default" else scaling)


def _llama_fields(config: Eagle3Config, dtype_name: str) -> dict:
    theta, scaling = _legacy_rope(config.rope_parameters)
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{name: getattr(config, name) for name in LLAMA_FIELDS},
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def _ssd_block(config: Eagle3Config) -> dict:
    block = {"format_version": FORMAT_VERSION, "saguaro_c": config.saguaro_c,
             "saguaro_fanout": config.saguaro_fanout, "extra": config.extra}
    if config.draft_temperature_scale is not None:
        block[TEMPERATURE_SCALE_KEY] = config.draft_temperature_scale
    return block


def eagle3_config_dict(config: Eagle3Config, dtype_name: str | None = None) -> dict:
    """The ``config.json`` of our export (``docs/design.md`` section 5): what vLLM's ``Eagle3LlamaForCausalLM`` and
    SGLang's ``LlamaForCausalLMEagle3`` read, plus the rope settings in both v5 and legacy keys, the declared aux-id
    convention and an ``ssd_eagle`` block (Saguaro settings, free metadata) that engines ignore."""
    out = {"architectures": ["LlamaForCausalLMEagle3"]}
    out.update(_llama_fields(config, dtype_name or config.torch_dtype))
    out.update({
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
                         "use_aux_hidden_state": True},
        CONVENTION_KEY: AUX_IDS_CONVENTION,
        "ssd_eagle": _ssd_block(config),
    })
    return out


def _write_folder(out_dir: str | os.PathLike, files: dict[str, object]) -> Path:
    """Write ``files`` (name -> JSON dict or tensor dict) as the folder ``out_dir``, atomically (replaced)."""
    with atomic_write(out_dir, folder=True) as tmp:
        for name, payload in files.items():
            if name.endswith(".json"):
                (tmp / name).write_text(json.dumps(payload, indent=2) + "\n")
            else:
                save_file(payload, str(tmp / name), metadata={"format": "pt"})
    return Path(out_dir)


def _dtype_of(tensors: dict[str, torch.Tensor], fallback: str) -> str:
    t = tensors.get("lm_head.weight")
    return str(t.dtype).removeprefix("torch.") if t is not None else fallback


def save_eagle3(model: Eagle3DraftModel, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                include_embeddings: bool = False) -> Path:
    """Export the head in the layout vLLM and SGLang load (``docs/design.md`` section 5), atomically
    (:func:`ssd_eagle.io.atomic_write`).

    Writes ``config.json`` (:func:`eagle3_config_dict`, ``tie_word_embeddings`` always false, ``torch_dtype`` =
    the written dtype) and ``model.safetensors`` (:func:`head_state_dict`: ``midlayer.*``, ``fc.weight``
    [H, 3*H_target], ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` int64, ``t2d`` bool, and
    ``embed_tokens.weight`` [vocab, H] for a head of another width than its target).
    An existing ``out_dir`` is replaced.

    Args:
        dtype: cast floating weights (e.g. torch.bfloat16); None keeps the model's.
        include_embeddings: also write an owned ``embed_tokens.weight``.

    Returns:
        the output directory.
    """
    tensors = head_state_dict(model, dtype, include_embeddings)
    config = eagle3_config_dict(model.config, _dtype_of(tensors, model.config.torch_dtype))
    return _write_folder(out_dir, {CONFIG_NAME: config, WEIGHTS_NAME: tensors})


def speculators_config_dict(config: Eagle3Config, dtype_name: str | None = None,
                            verifier_name_or_path: str | None = None,
                            verifier_architectures: list[str] | None = None, speculative_tokens: int = 7) -> dict:
    """``config.json`` of vLLM's speculators format (``Eagle3SpeculatorConfig``, read by vLLM's
    ``SpeculatorsConfig``/``update_eagle3``).

    ``norm_before_residual`` is written explicitly as false: vLLM defaults it to *true* when absent, which is a
    different architecture from this head.
    """
    dtype_name = dtype_name or config.torch_dtype
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_fields(config, dtype_name),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        CONVENTION_KEY: AUX_IDS_CONVENTION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures or [])},
        },
        "torch_dtype": dtype_name,
        "ssd_eagle": _ssd_block(config),
    }


def save_speculators(model: Eagle3DraftModel, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                     verifier_name_or_path: str | None = None, verifier_architectures: list[str] | None = None,
                     speculative_tokens: int = 7, include_embeddings: bool = False) -> Path:
    """Export in vLLM's speculators format (second export target, ``docs/design.md`` section 5), atomically.

    Weights as :func:`save_eagle3` but with ``layers.0.*`` instead of ``midlayer.*`` (``Eagle3Speculator``
    naming); config from :func:`speculators_config_dict`.
    """
    tensors = {_to_speculators_name(k): v for k, v in head_state_dict(model, dtype, include_embeddings).items()}
    config = speculators_config_dict(model.config, _dtype_of(tensors, model.config.torch_dtype),
                                     verifier_name_or_path, verifier_architectures, speculative_tokens)
    return _write_folder(out_dir, {CONFIG_NAME: config, WEIGHTS_NAME: tensors})


def _to_speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


# ----------------------------------------------------------------------------------------------------------------
# reading

def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds weights :func:`read_checkpoint_tensors` reads (a model card and config
    alone, as in a draft folder whose weights are not tracked, do not count)."""
    path = Path(path)
    return path.is_dir() and ((path / WEIGHTS_NAME).exists() or any(path.glob("*.safetensors"))
                              or (path / "pytorch_model.bin").exists())


def read_checkpoint_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: ``model.safetensors``, sharded ``*.safetensors`` with an index,
    any single ``*.safetensors``, or ``pytorch_model.bin`` (loaded with ``weights_only=True``).

    Raises:
        FileNotFoundError: no weight file.
        ValueError: a tensor name repeated across shards.
    """
    path = Path(path)
    if (path / WEIGHTS_NAME).exists():
        return load_file(str(path / WEIGHTS_NAME))
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if shards:
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            part = load_file(str(path / shard))
            dup = set(part) & set(out)
            if dup:
                raise ValueError(f"tensors {sorted(dup)} appear in more than one shard of {path}")
            out.update(part)
        return out
    if (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v for k, v in state.items()}
    raise FileNotFoundError(f"no model.safetensors, *.safetensors or pytorch_model.bin in {path}")


def is_eagle3_head(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds an EAGLE-3 head in a layout :func:`load_eagle3` reads (ours, the reference
    ``LlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` ones, speculators): its weights include the fuse layer ``fc``
    that maps the target's aux states, which no causal LM has."""
    if not has_checkpoint(path):
        return False
    return "fc.weight" in {canonical_tensor_name(name) for name in read_checkpoint_tensors(path)}


def canonical_tensor_name(name: str) -> str:
    """Map a public layout's tensor name to ours: strip a ``model.`` prefix (some SpecForge exports),
    ``layers.0.`` -> ``midlayer.`` (speculators), ``draft_id_to_target_id`` -> ``d2t`` (vLLM's name)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    if name == "draft_id_to_target_id":
        name = "d2t"
    return name


def _llama_from_dict(d: dict, where: str) -> LlamaConfig:
    missing = [k for k in _REQUIRED_LLAMA_KEYS if d.get(k) is None]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (Llama-architecture heads only)")
    return LlamaConfig(**{k: d[k] for k in _LLAMA_KEYS if d.get(k) is not None})


def _aux_ids(ids, convention: str | None, target_config, where: str) -> tuple[int, int, int]:
    if ids is None:
        if target_config is None:
            raise ValueError(f"{where} records no aux layer ids: pass target_config to use the EAGLE-3 default "
                             "(2, L//2, L-3)")
        return default_aux_layer_ids(text_config(target_config).num_hidden_layers)
    ids = tuple(int(i) for i in ids)
    if convention in (None, "input_of_layer"):
        return ids
    if convention == "output_of_layer":
        return tuple(i + 1 for i in ids)
    raise ValueError(f"{where}: unknown aux layer id convention {convention!r}")


def eagle3_config_from_dict(cfg: dict, target_config=None, dtype_name: str | None = None) -> Eagle3Config:
    """Parse a head's ``config.json`` (our export, the EAGLE reference / SpecForge layout, or speculators).

    Raises:
        ValueError: not an EAGLE-3 head we can run (several layers, non-Llama layer, ``norm_before_residual`` or
            ``norm_before_fc`` speculators variants, no aux ids and no target, unknown aux-id convention).
    """
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {cfg['speculators_model_type']!r} is not eagle3")
        layer = cfg.get("transformer_layer_config") or {}
        where = "speculators config"
        for flag in ("norm_before_residual", "norm_before_fc"):
            if cfg.get(flag):
                raise ValueError(f"{where}: {flag}=true is a different architecture from this head")
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        num_layers = layer.get("num_hidden_layers", 1)
    else:
        layer, where = cfg, "config.json"
        arch = cfg.get("architectures") or []
        if arch and not set(arch) & set(EAGLE3_ARCHITECTURES):
            raise ValueError(f"{where}: architectures {arch} is not an EAGLE-3 head ({list(EAGLE3_ARCHITECTURES)})")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        num_layers = cfg.get("num_hidden_layers", 1)
    if num_layers != 1:
        raise ValueError(f"{where}: num_hidden_layers={num_layers}, only one-layer EAGLE-3 heads are supported")
    llama = _llama_from_dict(layer, where)
    ssd = cfg.get("ssd_eagle") or {}
    dtype_name = dtype_name or cfg.get("torch_dtype") or cfg.get("dtype") or layer.get("torch_dtype") or "float32"
    return Eagle3Config(
        **{name: getattr(llama, name) for name in LLAMA_FIELDS},
        rope_parameters=normalize_rope_parameters(llama.rope_parameters),
        draft_vocab_size=cfg.get("draft_vocab_size") or llama.vocab_size,
        target_hidden_size=cfg.get("target_hidden_size") or llama.hidden_size,
        aux_layer_ids=_aux_ids(ids, cfg.get(CONVENTION_KEY), target_config, where),
        torch_dtype=dtype_name,
        saguaro_c=ssd.get("saguaro_c"),
        saguaro_fanout=ssd.get("saguaro_fanout"),
        draft_temperature_scale=ssd.get(TEMPERATURE_SCALE_KEY),  # (checked by Eagle3Config; null: none)
        extra=dict(ssd.get("extra") or {}),
    )


def load_eagle3(path: str | os.PathLike, target_config=None, strict: bool = True, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu", attn_implementation: str = "sdpa") -> Eagle3DraftModel:
    """Load an EAGLE-3 head from our export or a public layout (see the module docstring).

    Args:
        path: checkpoint directory (``config.json`` + weights).
        target_config: the target's transformers config; when given the head is validated against it
            (:meth:`Eagle3Config.validate_against_target`) and it supplies default aux ids to configs that lack them.
        strict: unexpected tensors raise (True) or are skipped with a warning (False). Missing tensors always raise.
        dtype: floating dtype of the model; None = the checkpoint's (``lm_head.weight``'s).
        device: where the model goes.

    Returns:
        an :class:`Eagle3DraftModel` in eval mode; embeddings still to attach with ``set_embeddings`` unless the
        checkpoint carried ``embed_tokens.weight`` (always the case for a head of another width than its target,
        ``hidden_size != target_hidden_size``: it runs on that table, as in vLLM and SGLang).

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: missing tensors (listed) -- in particular no ``lm_head.weight`` (a head whose output layer would
            come from the target is refused), no ``embed_tokens.weight`` for a head of another width than its
            target, or no ``d2t``/``t2d`` while ``draft_vocab_size < vocab_size``;
            unexpected tensors under ``strict`` (listed); tensor shapes that do not fit the config (listed); an
            inconsistent ``d2t``/``t2d`` pair; a config mismatch with the target.
    """
    path = Path(path)
    config_path = path / CONFIG_NAME
    if not path.is_dir():
        raise FileNotFoundError(f"no EAGLE-3 head folder at {path} ({path.resolve()}; a relative path is taken "
                                "from the current directory)")
    if not config_path.exists():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}")
    raw = read_checkpoint_tensors(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        canonical = canonical_tensor_name(name)
        if canonical in tensors:
            raise ValueError(f"checkpoint holds {canonical!r} twice (as {name!r})")
        tensors[canonical] = tensor
    cfg = eagle3_config_from_dict(json.loads(config_path.read_text()), target_config,
                                  _dtype_of(tensors, "float32") if dtype is None else str(dtype).removeprefix("torch."))
    if target_config is not None:
        cfg.validate_against_target(target_config)

    if "lm_head.weight" not in tensors:
        raise ValueError(f"{path}: no lm_head.weight; heads that borrow the target's output layer are refused "
                         "(their logits would not be the trained draft's)")
    if "d2t" not in tensors or "t2d" not in tensors:
        if cfg.draft_vocab_size != cfg.vocab_size:
            absent = [k for k in ("d2t", "t2d") if k not in tensors]
            raise ValueError(f"{path}: missing {absent} while draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                             f"{cfg.vocab_size}; the mapping cannot be regenerated for a trained lm_head")
        if "d2t" in tensors or "t2d" in tensors:
            raise ValueError(f"{path}: only one of d2t/t2d is present")
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)

    if cfg.owns_embeddings and EMBED_NAME not in tensors:
        raise ValueError(f"{path}: no {EMBED_NAME} [{cfg.vocab_size}, {cfg.hidden_size}]; a head of width "
                         f"hidden_size={cfg.hidden_size} != target_hidden_size={cfg.target_hidden_size} cannot use "
                         "the target's embeddings and must carry its own")
    model = Eagle3DraftModel(cfg, attn_implementation=attn_implementation).to(cfg.dtype)
    embed = None if cfg.owns_embeddings else tensors.pop(EMBED_NAME, None)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    if unexpected:
        if strict:
            raise ValueError(f"{path}: unexpected tensors {unexpected}")
        warnings.warn(f"{path}: skipping unexpected tensors {unexpected}", stacklevel=2)
        for name in unexpected:
            del tensors[name]
    bad = [f"{k}: checkpoint {tuple(v.shape)} != expected {tuple(expected[k].shape)}"
           for k, v in tensors.items() if v.shape != expected[k].shape]
    if bad:
        raise ValueError(f"{path}: tensor shapes do not fit the config: " + "; ".join(bad))
    tensors["d2t"] = tensors["d2t"].to(torch.long)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    check_vocab_mapping(tensors["d2t"], tensors["t2d"], cfg.vocab_size)
    model.load_state_dict({k: (v.to(cfg.dtype) if v.is_floating_point() else v) for k, v in tensors.items()},
                          strict=True)
    if embed is not None:
        model.set_owned_embeddings(embed.to(cfg.dtype))
    return model.to(device).eval()
