"""Build what a training config needs before the first step, so the README's command runs on a fresh clone.

* **Offline features** (``mode: offline``): the conversations of ``data`` that ``features_dir`` lacks for this
  config's :func:`~train.precompute_features.feature_key` are computed with the logic of
  ``train/precompute_features.py`` (each rank its share, tqdm bar on rank 0). Shards are committed one at a time,
  so an interrupted build continues where it stopped; later runs reuse them, and a changed target, aux layer ids,
  storage dtype or ``max_length`` (another key) or a grown data file builds only what is new.
* **The held-out set** (``heldout_data``): when the file does not exist, rank 0 answers ``heldout_samples``
  MT-Bench first turns greedily with the target (:func:`train.heldout.generate_heldout`, spread over the eight
  categories) and records how next to it (``<file>.meta.json``); a file whose record names another target, count
  or length is rebuilt, a file without a record (made by hand) is used as it is.

Every rank calls both; they synchronise with barriers (the world must be initialised).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch import nn

from train.config import TrainConfig

MTBENCH_QUESTIONS = 80  # prompts of the held-out MT-Bench split (ten per category, ordered by category)


def ensure_features(cfg: TrainConfig, text_config, feature_target: Callable[[], nn.Module], tokenizer, rank: int,
                    world: int) -> dict | None:
    """Compute the offline features ``cfg`` lacks (module docstring); a no-op online or when nothing is missing.
    ``text_config``: the target's text config; ``feature_target()`` returns the target in ``cfg.target_dtype``,
    called only when features are missing (the trainer loads it on first use).

    Returns:
        this rank's ``{"index", "samples", "tokens", "seconds"}`` (see
        :func:`train.precompute_features.write_features`), or None when nothing was built.
    """
    if cfg.mode != "offline" or not cfg.data:
        return None
    from train.precompute_features import feature_key, missing_conversations, write_features

    key = feature_key(cfg, text_config)
    _, todo = missing_conversations(cfg, key)
    dist.barrier()  # every rank planned from the same directory state before anyone writes
    if not todo:
        return None
    result = write_features(cfg, todo, feature_target(), tokenizer, key, rank, world)
    dist.barrier()
    return result


def heldout_recipe(cfg: TrainConfig) -> dict:
    """How the held-out file of ``cfg`` is generated (what its ``.meta.json`` records)."""
    n = cfg.heldout_samples
    return {"target": cfg.target, "split": "mtbench", "every": max(1, MTBENCH_QUESTIONS // n), "limit": n,
            "max_tokens": cfg.heldout_max_tokens}


def ensure_heldout(cfg: TrainConfig, rank: int) -> Path | None:
    """Generate ``cfg.heldout_data`` when it is missing or was made by another recipe (module docstring).

    Returns:
        the path generated, or None when nothing was (disabled, or the file is current).
    """
    if not cfg.heldout_data or cfg.heldout_samples == 0:
        return None
    path = Path(cfg.heldout_data)
    meta_path = path.with_name(path.name + ".meta.json")
    recipe = heldout_recipe(cfg)
    current = path.exists() and (not meta_path.exists() or json.loads(meta_path.read_text()) == recipe)
    built = None
    if rank == 0 and not current:
        from ssd_eagle.io import atomic_write
        from train.heldout import generate_heldout

        generate_heldout(path, model=cfg.target, split=recipe["split"], every=recipe["every"],
                         limit=recipe["limit"], max_tokens=recipe["max_tokens"], batch_size=min(16, recipe["limit"]),
                         num_threads=cfg.num_threads)
        with atomic_write(meta_path) as tmp:
            tmp.write_text(json.dumps(recipe, indent=2) + "\n")
        built = path
    dist.barrier()
    return built
