"""Speculative speculative decoding (SSD) and its optimised algorithm Saguaro (Kumar, Dao, May 2026).

- :mod:`~ssd_eagle.ssd.fanout`: geometric fan-out, the power-law fitter and the expected-value theory.
- :mod:`~ssd_eagle.ssd.speculator`: the speculation cache, outcome prediction, branch drafting, backups.
- the drafts a speculator runs are the SD drafters' own (:mod:`ssd_eagle.drafters.backends`).
- :mod:`~ssd_eagle.ssd.protocol`, :mod:`~ssd_eagle.ssd.transport`: the verifier <-> speculator messages and link.
- :mod:`~ssd_eagle.ssd.worker`: the speculator's own process.
- :mod:`~ssd_eagle.ssd.client`: the verifier's side, a drafter with fallback to ordinary decoding.

The engine factory (:mod:`ssd_eagle.engine.factory`) builds the verifier's SSD drafter for every placement.
"""

from __future__ import annotations

import torch


def speculator_settings(config, target_config, dtype: torch.dtype, max_model_len: int):
    """The :class:`~ssd_eagle.ssd.worker.SpeculatorSettings` of an SSD :class:`~ssd_eagle.config.EngineConfig`
    (CPU cores and the link's backend are the placement's to fill in)."""
    from ssd_eagle.ssd.worker import SpeculatorSettings

    spec = config.speculative_config
    return SpeculatorSettings(
        kind=spec.method, num_speculative_tokens=spec.num_speculative_tokens, fanout=spec.resolved_fanout(),
        fanout_miss=spec.resolved_fanout_miss(), backup=spec.backup, fast_backup_batch=spec.fast_backup_batch,
        saguaro_c=spec.saguaro_c, prompt_lookup=(spec.prompt_lookup_min, spec.prompt_lookup_max),
        num_slots=config.max_num_seqs, max_len=max_model_len + spec.kv_slack("speculator"),
        device=config.draft_device, threads=config.draft_threads, float_dtype=dtype,
        vocab_size=target_config.get_text_config().vocab_size, tree_budget=spec.tree_budget,
        tree_depth=spec.tree_depth, tree_topk=spec.tree_topk, fanout_power=spec.fanout_power,
        cuda_graphs=not config.eager, temperature_scale=spec.draft_temperature_scale)
