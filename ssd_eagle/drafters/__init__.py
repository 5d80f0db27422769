"""Drafters: n-gram prompt lookup, a draft causal LM, and the EAGLE-3 head (see :mod:`ssd_eagle.drafters.base`)."""

from __future__ import annotations

import logging

from ssd_eagle.drafters.base import Drafter, Proposal, SaguaroSampling
from ssd_eagle.drafters.draft_model import DraftModelDrafter
from ssd_eagle.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "Proposal", "SaguaroSampling", "NgramDrafter", "DraftModelDrafter", "build_drafter",
           "warn_saguaro_mismatch"]

logger = logging.getLogger(__name__)


def warn_saguaro_mismatch(head, spec) -> str | None:
    """Log a warning when an EAGLE-3 head trained for Saguaro (C, F) is served with other values (issue 7).

    Compared: C, and the F_k of the drafted positions k < K (after a hit and after a miss); F_K (the all-accepted
    outcome) scales nothing. The temperature is per request and is not checked. Returns the warning (None when the
    head is plain or the values match)."""
    fanouts = spec.resolved_fanout()[:-1] + (spec.resolved_fanout_miss() or [])[:-1]
    message = head.config.saguaro_mismatch(spec.saguaro_c, fanouts)
    if message:
        logger.warning(message)
    return message


def build_drafter(spec, target_model, num_slots: int, max_len: int, draft=None) -> Drafter:
    """Build the drafter a :class:`~ssd_eagle.config.SpeculativeConfig` describes, next to ``target_model``.

    The draft runs in the target's dtype and on its device (SSD puts it elsewhere; see :mod:`ssd_eagle.ssd`).

    Args:
        draft: the draft module (default: :func:`ssd_eagle.engine.factory.load_draft` loads ``spec.model``).

    Raises:
        ValueError: the draft does not fit the target (vocabulary, sizes, layer ids, rope, max positions).
        FileNotFoundError: the draft model cannot be found.
    """
    saguaro = SaguaroSampling(spec.saguaro_c, tuple(spec.resolved_fanout())) if spec.saguaro_c < 1.0 else None
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method not in ("draft_model", "eagle3"):
        raise ValueError(f"unknown speculative method {spec.method!r}")
    if draft is None:
        from ssd_eagle.engine.factory import load_draft

        draft = load_draft(spec, target_model)
    if spec.method == "draft_model":
        drafter = DraftModelDrafter(draft, target_model.config.get_text_config().vocab_size, num_slots, max_len,
                                    saguaro, spec.tree_settings())
    else:
        from ssd_eagle.drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter(draft, num_slots, max_len, saguaro, spec.tree_settings())
    if spec.draft_temperature_scale is not None:
        drafter.backend.temperature_scale = spec.draft_temperature_scale
    return drafter
