"""Shard a transformers causal LM across the target's ranks with transformers' own tensor-parallel plans.

Which tensor parallelism, and why (checked on this project's stack: torch 2.13, transformers 5.24, deepspeed
0.19.8, CPU + gloo, a tiny Llama in a 3-process world whose ranks 0-1 form the target's group):

- **transformers** (``base_model_tp_plan`` of the model's config + the model's ``_tp_plan``, applied as DTensors on
  a ``DeviceMesh``): works on CPU + gloo and on a sub-group of the world; float32 and float64; logits equal to the
  unsharded model's (max |diff| 0.0 in float64 on the test model); plans ship with the model families we serve
  (Llama, Qwen2/3, Mistral, Gemma); loading reads only each rank's slice of every weight. Its only catch is that
  ``from_pretrained(distributed_config=...)`` builds its mesh over the whole world (``init_device_mesh`` refuses
  a world larger than the mesh), and our world has the speculator as an extra rank: :func:`load_sharded_model`
  hands transformers a mesh over the target's group instead (a load-time subclass overriding
  ``prepare_distribute_model``), then restores the model's class.
- **DeepSpeed AutoTP** (``deepspeed.init_inference(model, tensor_parallel={"tp_size": 2, "tp_group": g})``):
  refuses float64 on the CPU accelerator ("Data type torch.float64 is not supported by cpu accelerator"); in
  float32 it split ``lm_head`` as ``[V, 64]`` on rank 0 and ``[V, 0]`` on rank 1 and the forward died with SIGSEGV,
  in a 3-process world with a sub-group and in a plain 2-process world alike. It also loads the full model in
  every process before sharding (70B in bf16 is 140 GB per rank).

Departure from the stock plan: the input embedding stays whole on every rank (and the output layer too when it is
tied to it). The EAGLE-3 head and the speculator need the target's embedding table as a plain tensor, and a
vocabulary-sharded embedding is a collective that only the target's ranks may call in lockstep; the price is
``vocab * hidden`` parameters per rank (1.05 G for Llama-3 70B: 2.1 GB in bf16; see ``configs/``).

Attention heads are split contiguously, so rank r holds query heads ``r*Q/N ..`` and kv heads ``r*KV/N ..``; the
KV cache of each rank therefore holds ``num_key_value_heads / N`` heads (:func:`local_kv_heads`).
"""

from __future__ import annotations

import torch
from torch import nn

from ssd_eagle.parallel.topology import Topology


def check_shardable(config, tp_size: int) -> None:
    """Refuse a model whose attention heads do not split evenly over ``tp_size`` ranks.

    Raises:
        ValueError: ``num_attention_heads`` or ``num_key_value_heads`` not divisible by ``tp_size``.
    """
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(f"--tp {tp_size} must divide the attention heads ({heads}) and the kv heads ({kv_heads})")


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


def whole_module_names(model: nn.Module) -> set[str]:
    """Modules kept whole on every rank: the input embedding, and the output layer when tied to it."""
    names = {_module_name(model, model.get_input_embeddings())}
    out = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) or (
            out is not None and out.weight is model.get_input_embeddings().weight):
        names.add(_module_name(model, out))
    return {n for n in names if n}


def restrict_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """An expanded tensor-parallel plan (one entry per module/parameter) without the modules of
    :func:`whole_module_names` and their parameters."""
    whole = whole_module_names(model)
    return {name: style for name, style in plan.items()
            if name not in whole and name.rpartition(".")[0] not in whole}


def _tp_config(tp_size: int):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=tp_size, tp_plan="auto")


def tp_mesh(topo: Topology, device: torch.device):
    """A one-dimensional ``DeviceMesh`` named ``tp`` over the target's process group."""
    from torch.distributed.device_mesh import DeviceMesh

    if topo.tp_group is None:
        raise ValueError(f"rank {topo.rank} is not one of the target's ranks")
    return DeviceMesh.from_group(topo.tp_group, device.type, mesh_dim_names=("tp",))


class _OneMesh:
    """What ``from_pretrained`` asks of its mesh manager, answered with the target's mesh for every dimension
    (pipeline, data and expert parallelism are all size 1 here)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def get_mesh(self, dims):
        return self.mesh


def _loader_class(base: type, mesh, device: torch.device) -> type:
    """``base`` with transformers' mesh set-up replaced by ``mesh`` and the plan restricted (load time only)."""
    def prepare_distribute_model(cls, distributed_config, device_map=None):
        return distributed_config, device, _OneMesh(mesh)

    def _resolve_parallel_plans(self, distributed_config):
        tp_plan, ep_plan, fsdp_plan = base._resolve_parallel_plans(self, distributed_config)
        return restrict_plan(self, tp_plan), ep_plan, fsdp_plan

    return type(base.__name__, (base,), {"prepare_distribute_model": classmethod(prepare_distribute_model),
                                         "_resolve_parallel_plans": _resolve_parallel_plans})


def load_sharded_model(name: str, topo: Topology, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load this rank's shard of a causal LM (every target rank must call it together).

    Args:
        name: local folder, packaged alias or hub id (:func:`ssd_eagle.assets.resolve_model_path`).
        topo: the launch; ``topo.tp_size == 1`` loads the whole model.
        dtype, device: of the weights on this rank.

    Returns:
        the model in eval mode; sharded weights are DTensors (``.to_local()`` is this rank's slice), the
        embedding (and a tied output layer) plain tensors.

    Raises:
        ValueError: heads not divisible by ``tp_size``; a model type without a causal-LM class.
        FileNotFoundError: the model cannot be found.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    from ssd_eagle.assets import load_model, resolve_model_path

    if topo.tp_size == 1:
        return load_model(name, dtype=dtype, device=device)[0]
    path = resolve_model_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(f"could not load model config of {name!r}: {err}") from err
    check_shardable(config, topo.tp_size)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{name!r}: no causal-LM class for model type {config.model_type!r}")
    base = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    loader = _loader_class(base, tp_mesh(topo, device), device)
    model = loader.from_pretrained(path, dtype=dtype, distributed_config=_tp_config(topo.tp_size))
    model.__class__ = base
    return model.eval()


def shard_model(model: nn.Module, topo: Topology) -> nn.Module:
    """Shard a model already built whole on every target rank (identical weights everywhere, e.g. the same seed),
    in place. The model must already be on this rank's device.

    Raises:
        ValueError: heads not divisible by ``tp_size``.
    """
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    if topo.tp_size == 1:
        return model
    check_shardable(model.config, topo.tp_size)
    param = next(model.parameters())
    mesh = tp_mesh(topo, param.device)
    plan, _, _ = model._resolve_parallel_plans(_tp_config(topo.tp_size))
    apply_tensor_parallelism(model, mesh, restrict_plan(model, plan))
    model._tp_size, model._device_mesh = topo.tp_size, mesh
    return model


def local_kv_heads(model: nn.Module) -> int:
    """Key/value heads this rank's attention layers produce (what its KV cache must hold): the local rows of the
    first layer's ``k_proj`` divided by the head dimension.

    Raises:
        ValueError: the model has no ``layers[0].self_attn.k_proj`` (not a Llama-family layout).
    """
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        weight = model.get_decoder().layers[0].self_attn.k_proj.weight
    except AttributeError as err:
        raise ValueError(f"{type(model).__name__}: no layers[0].self_attn.k_proj to read the kv heads from") from err
    rows = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
    return rows // head_dim


def shard_shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{parameter name: (global shape, this rank's shape)}`` for every parameter (equal shapes = whole)."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = (tuple(p.shape), tuple(local.shape))
    return out
