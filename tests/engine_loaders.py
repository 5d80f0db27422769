"""What vLLM's and SGLang's EAGLE-3 loaders make of a checkpoint, for the export tests (neither engine is installed
here): a transcription of their ``load_weights``, so a test can show that every exported tensor lands on a
parameter of the engine's model with the right shape.

vLLM: transcribed from vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at commit
  00bd1493b3e82d6c13c68ee8a0e1c5a96707e190 (Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights):
  "t2d" skipped; "d2t" -> "draft_id_to_target_id"; every other name without "lm_head" gets "model.";
  "midlayer." -> "layers.0."; q/k/v_proj stacked into qkv_proj (shards "q","k","v"), gate/up_proj into
  gate_up_proj (shards 0, 1). embed_tokens is loaded only when present (else shared from the target).
SGLang: transcribed from sgl-project/sglang python/sglang/srt/models/llama_eagle3.py at commit
  03d5a7771f6082e7737a5f19cae7d1e863087013 (LlamaForCausalLMEagle3.load_weights): "d2t" becomes the attribute
  hot_token_id = d2t + arange(draft_vocab) (not a parameter); "t2d" skipped; the same q/k/v and gate/up stacking;
  a name is used as is when it is a parameter, else with "model." prepended, and names matching no parameter are
  skipped silently. Parameters keep the name "midlayer" (model.midlayer.*).
Both loaders drop unknown names without error (SGLang by design; vLLM through its skip lists), so the functions
below raise on any tensor that would not land on a parameter.

Token embeddings after loading (:func:`engine_embeddings`), for a head whose ``hidden_size`` H differs from
``target_hidden_size``: both engines build ``model.embed_tokens`` as [vocab, hidden_size] of the draft config, and
``fc`` as [H, 3 * target_hidden_size]. vLLM: ``process_eagle_weight`` marks ``has_own_embed_tokens`` when a name
containing "embed_tokens" is loaded, and ``SpecDecodeBaseProposer._maybe_share_embeddings`` puts the target's table
in only when the draft has none (or an identical one; a table of another width is kept). SGLang: the EAGLE worker
calls ``set_embed(target_embed)``, which returns without sharing when ``target_hidden_size != hidden_size``
(sgl-project/sglang python/sglang/srt/models/llama.py, ``LlamaForCausalLM.set_embed``).
"""

from __future__ import annotations

import torch

from ssd_eagle.models.eagle3 import Eagle3Config

_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
_SHARD_ORDER = {".qkv_proj": ("q", "k", "v"), ".gate_up_proj": (0, 1)}

VLLM_EMBED = "model.embed_tokens.weight"
SGLANG_EMBED = "model.embed_tokens.weight"
SGLANG_HOT_TOKEN_ID = "hot_token_id"


def vllm_param_layout(config: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Parameters of vLLM's ``Eagle3LlamaForCausalLM`` for this head (bias-free, one layer, aux hidden states on,
    no parallel drafting): name -> (shape, dtype; None = the model's floating dtype). ``model.embed_tokens.weight``
    is included; it is optional in a checkpoint."""
    h, ht, i, hd = config.hidden_size, config.target_hidden_size, config.intermediate_size, config.head_dim
    nh, nkv, dv = config.num_attention_heads, config.num_key_value_heads, config.draft_vocab_size
    p = "model.layers.0."
    return {
        VLLM_EMBED: ((config.vocab_size, h), None),
        p + "self_attn.qkv_proj.weight": (((nh + 2 * nkv) * hd, 2 * h), None),
        p + "self_attn.o_proj.weight": ((h, nh * hd), None),
        p + "mlp.gate_up_proj.weight": ((2 * i, h), None),
        p + "mlp.down_proj.weight": ((h, i), None),
        p + "input_layernorm.weight": ((h,), None),
        p + "hidden_norm.weight": ((h,), None),
        p + "post_attention_layernorm.weight": ((h,), None),
        "model.fc.weight": ((h, 3 * ht), None),
        "model.norm.weight": ((h,), None),
        "lm_head.weight": ((dv, h), None),
        "draft_id_to_target_id": ((dv,), torch.long),
    }


def sglang_param_layout(config: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Parameters of SGLang's ``LlamaForCausalLMEagle3`` for this head, plus its ``hot_token_id`` attribute
    (int64 [draft_vocab]): name -> (shape, dtype; None = floating). ``model.embed_tokens.weight`` is optional."""
    layout = {k.replace("model.layers.0.", "model.midlayer."): v for k, v in vllm_param_layout(config).items()
              if k != "draft_id_to_target_id"}
    layout[SGLANG_HOT_TOKEN_ID] = ((config.draft_vocab_size,), torch.long)
    return layout


_VLLM_PARAMS = frozenset(vllm_param_layout(Eagle3Config(
    hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
    hidden_act="silu", max_position_embeddings=8, rope_parameters={}, vocab_size=8, draft_vocab_size=8,
    target_hidden_size=8, aux_layer_ids=(0, 1, 2))))
_SGLANG_PARAMS = frozenset(k.replace("model.layers.0.", "model.midlayer.") for k in _VLLM_PARAMS
                           if k != "draft_id_to_target_id")


def vllm_route(name: str) -> tuple[str, str | int | None] | None:
    """Where vLLM's EAGLE-3 loader puts checkpoint tensor ``name``: (parameter, shard id or None), or None when
    it skips it (``t2d``). Accepts our names and speculators' ``layers.0.*`` names."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    if "midlayer." in name:
        name = name.replace("midlayer.", "layers.0.")
    for param_name, shard_name, shard_id in _STACKED:
        if shard_name in name:
            return name.replace(shard_name, param_name), shard_id
    return name, None


def sglang_route(name: str) -> tuple[str, str | int | None] | None:
    """Where SGLang's EAGLE-3 loader puts checkpoint tensor ``name``: (parameter, shard id or None),
    (``"hot_token_id"``, None) for ``d2t``, or None when it skips it (``t2d``, and silently any name that matches
    no parameter)."""
    if "d2t" in name:
        return SGLANG_HOT_TOKEN_ID, None
    if "t2d" in name:
        return None
    shard_id = None
    for param_name, shard_name, sid in _STACKED:
        if shard_name in name:
            name, shard_id = name.replace(shard_name, param_name), sid
            break
    param = name if name in _SGLANG_PARAMS else f"model.{name}"
    return (param, shard_id) if param in _SGLANG_PARAMS else None


def _apply_routes(state_dict: dict[str, torch.Tensor], route, params: frozenset, engine: str,
                  transform=None) -> dict[str, torch.Tensor]:
    dropped, shards, out = [], {}, {}
    for name, tensor in state_dict.items():
        target = route(name)
        if target is None:
            if "t2d" not in name:
                dropped.append(name)
            continue
        param, shard_id = target
        if param not in params:
            dropped.append(name)
            continue
        if shard_id is None:
            if param in out:
                raise ValueError(f"{engine}: two tensors land on {param}")
            out[param] = transform(param, tensor) if transform else tensor
        else:
            shards.setdefault(param, {})
            if shard_id in shards[param]:
                raise ValueError(f"{engine}: shard {shard_id!r} of {param} given twice")
            shards[param][shard_id] = tensor
    if dropped:
        raise ValueError(f"{engine} would silently drop {sorted(dropped)}")
    for param, parts in shards.items():
        order = next(o for suffix, o in _SHARD_ORDER.items() if suffix in param)
        if set(parts) != set(order):
            raise ValueError(f"{engine}: {param} needs shards {list(order)}, got {sorted(map(str, parts))}")
        out[param] = torch.cat([parts[s] for s in order], dim=0)
    return out


def to_vllm_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's ``Eagle3LlamaForCausalLM`` holds after loading ``state_dict`` (checkpoint names, ours or
    speculators'): parameter name -> tensor, q/k/v concatenated into ``qkv_proj``, gate/up into ``gate_up_proj``,
    ``d2t`` as ``draft_id_to_target_id``; ``t2d`` is dropped (vLLM ignores it).

    Raises:
        ValueError: a tensor would land on no parameter (vLLM's silent skip), or stacked shards are incomplete.
    """
    return _apply_routes(state_dict, vllm_route, _VLLM_PARAMS, "vLLM")


def to_sglang_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What SGLang's ``LlamaForCausalLMEagle3`` holds after loading ``state_dict``: parameter name -> tensor
    (stacked like vLLM, names ``model.midlayer.*``) plus ``"hot_token_id"`` = ``d2t + arange`` (int64); ``t2d`` is
    dropped.

    Raises:
        ValueError: a tensor would land on no parameter (SGLang skips it silently), or shards are incomplete.
    """
    def hot(param, tensor):
        if param != SGLANG_HOT_TOKEN_ID:
            return tensor
        return tensor + torch.arange(tensor.shape[0], dtype=tensor.dtype)
    return _apply_routes(state_dict, sglang_route, _SGLANG_PARAMS | {SGLANG_HOT_TOKEN_ID}, "SGLang", hot)


def _split_engine_state(engine: dict[str, torch.Tensor], config: Eagle3Config, layer_prefix: str,
                        d2t: torch.Tensor) -> dict[str, torch.Tensor]:
    nh, nkv, hd, i = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                      config.intermediate_size)
    out = {}
    for name, tensor in engine.items():
        if not name.startswith(("model.", "lm_head")):
            continue
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = torch.split(tensor, [nh * hd, nkv * hd, nkv * hd], dim=0)
            for proj, part in (("q", q), ("k", k), ("v", v)):
                out[f"midlayer.self_attn.{proj}_proj.weight"] = part.clone()
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = torch.split(tensor, [i, i], dim=0)
            out["midlayer.mlp.gate_proj.weight"], out["midlayer.mlp.up_proj.weight"] = gate.clone(), up.clone()
        else:
            key = name[len("model."):] if name.startswith("model.") else name
            out[key.replace(layer_prefix, "midlayer.")] = tensor
    out["d2t"] = d2t.to(torch.long)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t] = True
    out["t2d"] = t2d
    return out


def from_vllm_names(engine: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_vllm_names`: back to our checkpoint names (``t2d`` rebuilt from ``d2t``)."""
    return _split_engine_state(engine, config, "layers.0.", engine["draft_id_to_target_id"])


def from_sglang_names(engine: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_sglang_names`: back to our checkpoint names (``d2t = hot_token_id - arange``,
    ``t2d`` rebuilt)."""
    hot = engine[SGLANG_HOT_TOKEN_ID]
    return _split_engine_state(engine, config, "midlayer.", hot - torch.arange(hot.shape[0], dtype=hot.dtype))


def engine_embeddings(config: Eagle3Config, engine_state: dict[str, torch.Tensor], engine: str) -> str:
    """Which token embeddings ``engine`` ("vLLM" or "SGLang") runs the loaded head on (module docstring):
    ``"checkpoint"`` (the head's own ``model.embed_tokens.weight``) or ``"target"`` (the target's, shared).

    Raises:
        ValueError: a head of another width than its target without its own table (vLLM would share a
            [vocab, target_hidden_size] table into a [vocab, hidden_size] model; SGLang would keep the draft's table
            uninitialised), or an own table of the wrong shape.
    """
    own = engine_state.get(VLLM_EMBED if engine == "vLLM" else SGLANG_EMBED)
    narrow = config.hidden_size != config.target_hidden_size
    if own is not None and tuple(own.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{engine}: embed_tokens is {tuple(own.shape)}, the model builds "
                         f"{(config.vocab_size, config.hidden_size)}")
    if narrow and own is None:
        raise ValueError(f"{engine}: a head {config.hidden_size} wide on a {config.target_hidden_size}-wide target "
                         "needs its own embed_tokens.weight in the checkpoint")
    if engine == "SGLang":
        return "checkpoint" if narrow else "target"  # set_embed shares the target's unless the widths differ
    return "checkpoint" if own is not None else "target"
