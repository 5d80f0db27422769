"""The draft vocabulary of an EAGLE-3 head, chosen from loss-masked token frequencies (``docs/design.md`` section 3).

Only tokens at ``loss_mask == 1`` positions (the assistant tokens the draft learns to predict) are counted. The
``draft_vocab_size`` most frequent ids (ties: lower id first) become the draft vocabulary, sorted by id and padded
with the smallest unused ids when the data has fewer distinct tokens; the tensors themselves come from
:func:`ssd_eagle.models.eagle3.build_vocab_mapping` (``d2t`` int64 [D], ``d2t[i] = used[i] - i``; ``t2d`` bool [V]).

The counts are saved as JSON so the vocabulary can be rebuilt and audited; the mapping of a trained head lives in
its checkpoint and must never be regenerated for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ssd_eagle.io import atomic_write

COUNTS_FORMAT = "ssd_eagle.token_counts/v1"


def _iter_rows(samples) -> Iterable[tuple[Any, Any]]:
    if hasattr(samples, "iter") and hasattr(samples, "column_names"):  # datasets.Dataset: read in batches
        for batch in samples.select_columns(["input_ids", "loss_mask"]).iter(batch_size=256):
            yield from zip(batch["input_ids"], batch["loss_mask"])
    else:
        for row in samples:
            yield row["input_ids"], row["loss_mask"]


def count_token_frequencies(samples, vocab_size: int, *, progress: bool = True) -> torch.Tensor:
    """Count target token ids at loss-masked positions.

    Args:
        samples: a ``datasets.Dataset`` or an iterable of dicts with ``input_ids`` and ``loss_mask`` (equal-length
            sequences; e.g. :func:`train.data.build_dataset` output).
        vocab_size: target vocabulary size V.
        progress: show a tqdm bar.

    Returns:
        int64 tensor [V]: ``counts[v]`` = number of positions with ``input_ids == v`` and ``loss_mask == 1``.

    Raises:
        ValueError: mismatched ``input_ids``/``loss_mask`` lengths, or a masked id outside ``[0, V)``.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    total = len(samples) if hasattr(samples, "__len__") else None
    for i, (ids, mask) in enumerate(tqdm(_iter_rows(samples), total=total, desc="counting tokens",
                                         disable=not progress, leave=False)):
        ids_arr = np.asarray(ids, dtype=np.int64)
        mask_arr = np.asarray(mask).astype(bool)
        if ids_arr.shape != mask_arr.shape:
            raise ValueError(f"sample {i}: input_ids {ids_arr.shape} and loss_mask {mask_arr.shape} differ")
        masked = ids_arr[mask_arr]
        if masked.size and (masked.min() < 0 or masked.max() >= vocab_size):
            raise ValueError(f"sample {i}: token id outside [0, {vocab_size}) at a masked position")
        counts += np.bincount(masked, minlength=vocab_size)
    return torch.from_numpy(counts)


def most_frequent_ids(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The ids with a non-zero count, most frequent first (ties: lower id first), at most ``draft_vocab_size``.

    Returns:
        int64 tensor [<= draft_vocab_size], in priority order (not sorted by id).
    """
    counts = torch.as_tensor(counts, dtype=torch.long)
    order = torch.argsort(-counts, stable=True)
    nonzero = int((counts > 0).sum())
    return order[:min(nonzero, draft_vocab_size)]


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, keep: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from token counts: the ``draft_vocab_size`` most frequent ids, sorted by id, padded with the
    smallest unused ids when fewer distinct ids were counted. With ``keep`` (a trained head's vocabulary, widened by a
    warm start so that its output rows carry over) those ids come first, then the most frequent others.

    Args:
        counts: int64 [V], e.g. from :func:`count_token_frequencies` or :func:`load_token_counts`.
        draft_vocab_size: D <= V.
        keep: optional int64 [D_old] target ids that must stay in the vocabulary (``draft_target_ids``), D_old <= D.

    Returns:
        ``d2t`` int64 [D] (``d2t[i] = used[i] - i``) and ``t2d`` bool [V] (see
        :func:`ssd_eagle.models.eagle3.build_vocab_mapping`, which builds them).

    Raises:
        ValueError: D not in ``[1, V]``, or smaller than ``keep`` (a warm start widens a vocabulary, never narrows it).
    """
    from ssd_eagle.models.eagle3 import build_vocab_mapping, check_vocab_mapping

    counts = torch.as_tensor(counts, dtype=torch.long)
    vocab_size = counts.numel()
    kept = torch.zeros(0, dtype=torch.long) if keep is None else torch.as_tensor(keep, dtype=torch.long).flatten()
    if draft_vocab_size < kept.numel():
        raise ValueError(f"draft_vocab_size {draft_vocab_size} < the {kept.numel()} tokens of the trained head's "
                         "vocabulary: a warm start can widen a draft vocabulary, not narrow it")
    ids = torch.cat([kept, most_frequent_ids(counts, draft_vocab_size + kept.numel())])
    d2t, t2d = build_vocab_mapping(ids, vocab_size, draft_vocab_size)
    check_vocab_mapping(d2t, t2d, vocab_size)
    return d2t, t2d


def draft_vocab_from_dataset(samples, vocab_size: int, draft_vocab_size: int, *, progress: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Count (:func:`count_token_frequencies`) and choose (:func:`build_draft_vocab`) in one call.

    Returns:
        ``(d2t int64 [D], t2d bool [V], counts int64 [V])``.
    """
    counts = count_token_frequencies(samples, vocab_size, progress=progress)
    d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    return d2t, t2d, counts


def save_token_counts(path: str | os.PathLike, counts: torch.Tensor,
                      metadata: Mapping[str, Any] | None = None) -> None:
    """Write counts as JSON: ``{"format", "vocab_size", "total", "counts": [[id, count], ...] (non-zero, by id),
    "metadata"}``. ``metadata`` (e.g. tokenizer name, data source, max_length) must be JSON-serialisable."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    nz = torch.nonzero(counts).flatten()
    doc = {"format": COUNTS_FORMAT, "vocab_size": counts.numel(), "total": int(counts.sum()),
           "counts": [[int(i), int(counts[i])] for i in nz], "metadata": dict(metadata or {})}
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump(doc, f)


def load_token_counts(path: str | os.PathLike) -> tuple[torch.Tensor, dict]:
    """Read counts written by :func:`save_token_counts`.

    Returns:
        ``(counts int64 [V], metadata dict)``.

    Raises:
        ValueError: not a counts file of this format, an id out of range, or a negative count.
    """
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != COUNTS_FORMAT:
        raise ValueError(f"{path}: not a token counts file ({COUNTS_FORMAT})")
    vocab_size = int(doc["vocab_size"])
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for token_id, count in doc["counts"]:
        if not 0 <= token_id < vocab_size or count < 0:
            raise ValueError(f"{path}: bad entry [{token_id}, {count}] for vocab_size {vocab_size}")
        counts[token_id] = count
    return counts, doc.get("metadata", {})
