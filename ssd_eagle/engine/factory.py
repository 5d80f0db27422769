"""Building an engine: one factory, whatever the placement of its parts.

:func:`build` loads the target (unless given), builds the drafter the :class:`~ssd_eagle.config.EngineConfig`
names and returns an :class:`~ssd_eagle.engine.llm_engine.LLMEngine`. A *placement* says only where the parts run:

- :class:`InProcess`: target, drafter and (``speculator: local``) the SSD speculator in this process;
- :class:`SpeculatorProcess`: the same, with the SSD speculator in a process of its own (``speculator: process``);
- :class:`~ssd_eagle.parallel.engine.DriverSession`: rank 0 of a tensor-parallel launch, its target sharded over
  the ranks and the speculator one more rank (:mod:`ssd_eagle.parallel`).

A placement has four methods: ``load_target(config) -> (model, tokenizer)``, ``draft(spec, target)`` (the draft
module loaded here, or None where the speculator loads its own), ``speculator(config, settings, target, draft)``
(the SSD speculator handle) and ``attach(engine)`` (last touches to the built engine); and one flag, ``captures``:
whether the engine may capture the target's forward (CUDA graphs, ``torch.compile``).

Each start-up stage (target load, draft load, speculator start, engine set-up, the planner's cost measurement) is
logged at INFO with its duration, as vLLM logs its start-up (``event: startup_stage``, ``stage``, ``seconds``).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch
from torch import nn

from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import DraftKV, bytes_per_position


log = logging.getLogger(__name__)


@contextmanager
def startup_stage(stage: str, **fields):
    """Log ``stage`` (what ran, with ``fields``) and its wall time in seconds once the block ends."""
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    log.info(f"{stage}: {seconds:.2f} s", extra={"fields": {"event": "startup_stage", "stage": stage,
                                                           "seconds": round(seconds, 3), **fields}})


def load_draft(spec, target=None, *, target_config=None, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None,
               embeddings: nn.Module | torch.Tensor | None = None) -> nn.Module:
    """The draft module a :class:`~ssd_eagle.config.SpeculativeConfig` names, for every drafter and speculator.

    Next to ``target`` (a loaded model: its config, dtype, device and input embeddings are used), or on a rank
    without it from ``target_config``, ``dtype``, ``device`` and the target's input ``embeddings`` (a module or
    the ``[vocab, hidden]`` table). ``draft_model``: a causal LM sharing the target's vocabulary (a compact export,
    :mod:`ssd_eagle.models.draft_lm`, needs ``target`` for its embedding and output layer); ``eagle3``: a head
    validated against the target and sharing its embeddings (frozen); a head trained for other Saguaro values
    logs a warning (:func:`~ssd_eagle.drafters.warn_saguaro_mismatch`).

    Raises:
        ValueError: a method without a draft module (``ngram``), a vocabulary other than the target's, a compact
            draft LM without ``target``, or a head that does not fit the target.
        FileNotFoundError: nothing at ``spec.model``.
    """
    from ssd_eagle.models.draft_lm import is_compact_draft_lm, load_draft_model

    if target is not None:
        param = next(target.parameters())
        target_config, dtype, device = target.config, param.dtype, param.device
        embeddings = target.get_input_embeddings()
    if spec.method == "draft_model":
        if target is not None:
            return follow_weights(load_draft_model(spec.model, target), target)
        if is_compact_draft_lm(spec.model):
            raise ValueError(f"{spec.model} is a compact draft LM: it needs the whole target (embedding and output "
                             f"layer); export a plain folder for a speculator rank")
        from ssd_eagle.assets import load_model

        model, _ = load_model(spec.model, dtype=dtype, device=device)
        vocab, expected = model.get_output_embeddings().weight.shape[0], target_config.get_text_config().vocab_size
        if vocab != expected:
            raise ValueError(f"draft model vocabulary ({vocab}) must equal the target's ({expected})")
        return model
    if spec.method == "eagle3":
        from ssd_eagle.drafters import warn_saguaro_mismatch
        from ssd_eagle.models.eagle3_formats import load_eagle3

        head = load_eagle3(spec.model, target_config=target_config, dtype=dtype, device=device)
        if isinstance(embeddings, torch.Tensor):
            embeddings = nn.Embedding.from_pretrained(embeddings, freeze=True)
        head.set_embeddings(embeddings)
        warn_saguaro_mismatch(head, spec)
        return follow_weights(head, target)
    raise ValueError(f"speculative method {spec.method!r} has no draft module (draft_model or eagle3 have one)")


def follow_weights(draft: nn.Module, target: nn.Module | None) -> nn.Module:
    """``draft`` with its linear weights rounded to float16 values where ``target``'s are (``--dtype float16`` on a
    CPU, :func:`~ssd_eagle.assets.load_model`), so that drafting runs FBGEMM's fp16 kernels too
    (:mod:`ssd_eagle.packed_linear`); otherwise unchanged. A draft's precision does not touch losslessness."""
    from ssd_eagle.packed_linear import has_fp16_weights, round_linears_to_fp16

    if target is not None and has_fp16_weights(target):
        round_linears_to_fp16(draft)
    return draft


def eagle3_aux_layer_ids(path: str, target_config) -> tuple[int, ...]:
    """The aux layer ids an EAGLE-3 checkpoint declares (read from its config; no weights are loaded)."""
    import json
    from pathlib import Path

    from ssd_eagle.models.eagle3_formats import CONFIG_NAME, eagle3_config_from_dict

    cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
    return tuple(eagle3_config_from_dict(cfg, target_config).aux_layer_ids)


class InProcess:
    """Every part in this process; an SSD speculator runs in line (no overlap: for tests and debugging)."""

    captures = True

    def load_target(self, config):
        from ssd_eagle.assets import load_model

        return load_model(config.model, dtype=config.torch_dtype, device=config.device)

    def draft(self, spec, target) -> nn.Module:
        return load_draft(spec, target)

    def speculator(self, config, settings, target, draft):
        from ssd_eagle.ssd.client import LocalSpeculator

        return LocalSpeculator(settings, draft)

    def attach(self, engine: LLMEngine) -> LLMEngine:
        return engine


class SpeculatorProcess(InProcess):
    """The SSD speculator in a process of its own on ``config.draft_device``, drafting while the target verifies.
    With both on CPU and ``pin_cpus``, the verifier and the speculator get disjoint halves of the cores."""

    def speculator(self, config, settings, target, draft):
        from ssd_eagle.ssd.client import RemoteSpeculator

        verifier_cpus = None
        if config.pin_cpus and config.device == "cpu" and config.draft_device == "cpu":
            cores = sorted(os.sched_getaffinity(0))
            if len(cores) >= 2:
                half = len(cores) // 2
                verifier_cpus, settings.cpus = cores[:half], cores[half:]
                # as many threads as cores: OpenMP threads spinning for a busy core cost milliseconds per op
                torch.set_num_threads(min(torch.get_num_threads(), len(verifier_cpus)))
            else:
                log.warning(f"SSD on CPU with only core(s) {cores} allowed: the verifier and the speculator share "
                            "one core, so the speculator cannot draft while the target verifies (expect SD's "
                            "speed or less; give the process two cores)")
        if config.draft_device.startswith("cuda") and config.device.startswith("cuda") and \
                cuda_index(config.draft_device) != cuda_index(config.device):
            settings.dist_backend = "nccl"
        spec = config.speculative_config
        return RemoteSpeculator(settings, draft, timeout=spec.speculator_timeout, cpus=verifier_cpus,
                                verifier_device=config.device, heartbeat_timeout=spec.speculator_heartbeat_timeout)


def cuda_index(device: str) -> int:
    """The CUDA ordinal a device string names: ``"cuda"`` is the current device (``"cuda"`` and ``"cuda:0"`` are
    one GPU, which NCCL cannot pair with itself)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None and torch.cuda.is_available() else (index or 0)


def default_placement(config) -> InProcess:
    """:class:`SpeculatorProcess` for SSD with ``speculator: process``, else :class:`InProcess`."""
    if config.mode == "ssd" and config.speculative_config.speculator == "process":
        return SpeculatorProcess()
    return InProcess()


def make_drafter(config, target, max_model_len: int, placement=None, draft: nn.Module | None = None):
    """The drafter of ``config`` next to ``target`` (None for ``ar``).

    Args:
        draft: an already built draft module (default: the placement loads ``speculative_config.model``).
    """
    from ssd_eagle.drafters import build_drafter

    spec = config.speculative_config
    placement = placement or default_placement(config)
    if config.mode == "ar":
        return None
    if config.mode == "sd":
        if draft is None and spec.method != "ngram":
            with startup_stage("load draft", method=spec.method, draft=spec.model):
                draft = load_draft(spec, target)
        return build_drafter(spec, target, config.max_num_seqs, max_model_len + spec.kv_slack("draft"), draft)
    from ssd_eagle.ssd import speculator_settings
    from ssd_eagle.ssd.client import SSDDrafter

    if spec.method not in ("draft_model", "eagle3"):
        raise ValueError(f"SSD needs a neural draft (method 'draft_model' or 'eagle3'), got {spec.method!r}")
    if draft is None:
        with startup_stage("load draft", method=spec.method, draft=spec.model):
            draft = placement.draft(spec, target)
    aux_ids = None
    if spec.method == "eagle3":
        aux_ids = tuple(draft.config.aux_layer_ids) if draft is not None else \
            eagle3_aux_layer_ids(spec.model, target.config)
    settings = speculator_settings(config, target.config, next(target.parameters()).dtype, max_model_len)
    with startup_stage("start speculator", speculator=spec.speculator, device=config.draft_device):
        speculator = placement.speculator(config, settings, target, draft)
    respawn = None  # a crashed speculator process can be replaced (inference/supervisor.py)
    if isinstance(placement, SpeculatorProcess):
        from ssd_eagle.ssd.client import RemoteSpeculator

        def respawn():  # the settings the first one left: its cores and backend; this process stays pinned
            return RemoteSpeculator(settings, draft, timeout=spec.speculator_timeout, verifier_device=config.device,
                                    heartbeat_timeout=spec.speculator_heartbeat_timeout)
    drafter = SSDDrafter(speculator, needs_aux=aux_ids is not None, aux_layer_ids=aux_ids, draft_name=spec.method,
                         respawn=respawn)
    drafter.kv_geometry = speculator_kv(spec, draft)
    return drafter


def speculator_kv(spec, draft: nn.Module | None) -> DraftKV | None:
    """The SSD speculator's KV store as the engine's KV budget counts it, from the draft's geometry (the store
    lives in the speculator's process): an EAGLE-3 head's one layer or a draft LM's layers, in the draft's dtype,
    with a round's branches past the text (``spec.kv_slack("speculator")``). None where the draft is loaded
    elsewhere (a tensor-parallel speculator rank)."""
    if draft is None:
        return None
    lm = spec.method == "draft_model"
    cfg = draft.config.get_text_config() if lm else draft.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_position = bytes_per_position(cfg.num_hidden_layers if lm else 1, cfg.num_key_value_heads, head_dim,
                                      next(draft.parameters()).dtype)
    return DraftKV(per_position, spec.kv_slack("speculator"))


def build(config, target=None, placement=None, *, tokenizer=None, draft: nn.Module | None = None) -> LLMEngine:
    """The engine an :class:`~ssd_eagle.config.EngineConfig` describes.

    Args:
        config: the engine configuration.
        target: an already loaded target (default: the placement loads ``config.model``).
        placement: where the parts run (default: :func:`default_placement`).
        tokenizer: the target's tokenizer (default: loaded with the target, or from ``config.model``).
        draft: an already built draft module (default: loaded from ``speculative_config.model``).

    Raises:
        ValueError: a draft that does not fit the target, or anything the placement rejects.
        FileNotFoundError: the target or the draft cannot be found.
    """
    placement = placement or default_placement(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if target is None:
        with startup_stage("load target", model=config.model, dtype=str(config.torch_dtype).removeprefix("torch."),
                           device=config.device):
            target, loaded_tokenizer = placement.load_target(config)
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        from transformers import AutoTokenizer

        from ssd_eagle.assets import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    max_model_len = config.max_model_len or target.config.get_text_config().max_position_embeddings
    drafter = make_drafter(config, target, max_model_len, placement, draft)
    spec = config.speculative_config if drafter is not None else None
    try:
        with startup_stage("engine set-up", max_num_seqs=config.max_num_seqs, max_model_len=max_model_len):
            engine = LLMEngine(target, tokenizer, drafter,
                               num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                               max_num_seqs=config.max_num_seqs, max_model_len=max_model_len, seed=config.seed,
                               max_draft_tokens=spec.max_draft_tokens if spec else 0,
                               cuda_graphs=placement.captures and not config.eager,
                               compile=placement.captures and config.compile,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               enable_prefix_caching=config.enable_prefix_caching,
                               prefix_cache_memory=config.prefix_cache_memory,
                               kv_cache_memory=config.kv_cache_memory)
            engine = placement.attach(engine)
        if spec is not None:  # after attach: a tensor-parallel target is its driver by then (not planned: its probe
            from ssd_eagle.planner import planner_for  # forwards must reach every rank)

            with startup_stage("planner cost model"):
                engine.planner = planner_for(engine, spec)
    except BaseException:  # (a failed set-up, or a signal during it): an SSD speculator process is stopped with it
        if drafter is not None:
            drafter.close()
        raise
    return engine
