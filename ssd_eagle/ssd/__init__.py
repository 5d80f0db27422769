"""Speculative speculative decoding (SSD) and its optimised algorithm Saguaro (Kumar, Dao, May 2026).

- :mod:`~ssd_eagle.ssd.fanout`: geometric fan-out, the power-law fitter and the expected-value theory.
- :mod:`~ssd_eagle.ssd.speculator`: the speculation cache, outcome prediction, branch drafting, backups.
- the drafts a speculator runs are the SD drafters' own (:mod:`ssd_eagle.drafters.backends`).
- :mod:`~ssd_eagle.ssd.transport`, :mod:`~ssd_eagle.ssd.worker`: the speculator's own process and its messages.
- :mod:`~ssd_eagle.ssd.client`: the verifier's side, a drafter with fallback to ordinary decoding.
"""

from __future__ import annotations

import os

import torch


def load_draft_module(spec, target_model):
    """The draft as a module: a causal LM (``draft_model``) or an EAGLE-3 head with the target's embeddings.

    Raises:
        ValueError: the method has no neural draft (n-gram), or the draft does not fit the target.
    """
    param = next(target_model.parameters())
    if spec.method == "draft_model":
        from ssd_eagle.models.draft_lm import load_draft_model

        return load_draft_model(spec.model, target_model)
    if spec.method == "eagle3":
        from ssd_eagle.models.eagle3_formats import load_eagle3

        head = load_eagle3(spec.model, target_config=target_model.config, dtype=param.dtype)
        head.set_embeddings(target_model.get_input_embeddings())
        from ssd_eagle.drafters import warn_saguaro_mismatch

        warn_saguaro_mismatch(head, spec)
        return head
    raise ValueError(f"SSD needs a neural draft (method 'draft_model' or 'eagle3'), got {spec.method!r}")


def ssd_draft_positions(spec) -> int:
    """Cache positions a speculator needs past the text: the proposal, then every branch's draft (K tokens of a
    chain, or the root plus (depth - 1) * topk fed nodes of a tree)."""
    branches = max(sum(spec.resolved_fanout()), sum(spec.resolved_fanout_miss() or [0]))
    per_branch = spec.num_speculative_tokens if not spec.tree_budget else 1 + spec.tree_depth * spec.tree_topk
    return 2 * (spec.max_draft_tokens + 1) + branches * per_branch + spec.tree_depth * spec.tree_topk


def speculator_settings(config, target_config, dtype: torch.dtype, max_model_len: int):
    """The :class:`~ssd_eagle.ssd.worker.SpeculatorSettings` of an SSD :class:`~ssd_eagle.config.EngineConfig`
    (device, CPU cores and transport are the caller's to fill in)."""
    from ssd_eagle.ssd.worker import SpeculatorSettings

    spec = config.speculative_config
    return SpeculatorSettings(
        kind=spec.method, num_speculative_tokens=spec.num_speculative_tokens, fanout=spec.resolved_fanout(),
        fanout_miss=spec.resolved_fanout_miss(), backup=spec.backup, fast_backup_batch=spec.fast_backup_batch,
        saguaro_c=spec.saguaro_c, prompt_lookup=(spec.prompt_lookup_min, spec.prompt_lookup_max),
        num_slots=config.max_num_seqs, max_len=max_model_len + ssd_draft_positions(spec),
        device=config.draft_device, threads=config.draft_threads, float_dtype=dtype,
        vocab_size=target_config.get_text_config().vocab_size, tree_budget=spec.tree_budget,
        tree_depth=spec.tree_depth, tree_topk=spec.tree_topk, fanout_power=spec.fanout_power,
        cuda_graphs=not config.eager)


def build_ssd_drafter(config, target_model, draft=None, max_model_len: int | None = None):
    """The verifier-side SSD drafter for an :class:`~ssd_eagle.config.EngineConfig` (mode ``ssd``).

    Args:
        config: engine configuration (its ``speculative_config`` describes draft, fan-out, backup, Saguaro).
        target_model: the target (for its embeddings, vocabulary and dtype).
        draft: an already built draft module (default: loaded from ``speculative_config.model``).
        max_model_len: longest sequence (default: the target's max positions).
    """
    from ssd_eagle.ssd.client import LocalSpeculator, RemoteSpeculator, SSDDrafter

    spec = config.speculative_config
    draft = draft if draft is not None else load_draft_module(spec, target_model)
    cfg = target_model.config.get_text_config()
    max_len = max_model_len or config.max_model_len or cfg.max_position_embeddings
    settings = speculator_settings(config, target_model.config, next(target_model.parameters()).dtype, max_len)
    aux_ids = tuple(draft.config.aux_layer_ids) if spec.method == "eagle3" else None
    if spec.speculator == "local":
        speculator = LocalSpeculator(settings, draft)
    else:
        verifier_cpus = None
        if config.pin_cpus and config.device == "cpu" and config.draft_device == "cpu":
            cores = sorted(os.sched_getaffinity(0))
            if len(cores) >= 2:
                half = len(cores) // 2
                verifier_cpus, settings.cpus = cores[:half], cores[half:]
                # as many threads as cores: OpenMP threads spinning for a busy core cost milliseconds per op
                torch.set_num_threads(min(torch.get_num_threads(), len(verifier_cpus)))
        if config.draft_device.startswith("cuda") and config.device.startswith("cuda") and \
                torch.device(config.draft_device) != torch.device(config.device):
            settings.dist_backend = "nccl"
        speculator = RemoteSpeculator(settings, draft, timeout=spec.speculator_timeout, cpus=verifier_cpus,
                                      verifier_device=config.device)
    return SSDDrafter(speculator, needs_aux=spec.method == "eagle3", aux_layer_ids=aux_ids,
                      draft_name=spec.method)
