"""Where the trainer's samples and target features come from: online or offline, this rank's shard, the held-out set.

* **online**: the training conversations are tokenized (:func:`train.data.build_dataset`, sharded by rank) and the
  frozen target runs forward on every micro-batch (:class:`train.features.TargetFeatureExtractor`).
* **offline**: the features were computed beforehand (``train/precompute_features.py``) and are read from a
  :class:`train.features.FeatureStore`; a ``data`` file selects exactly its conversations, which must all have
  features of this config's :func:`~train.precompute_features.feature_key` (target, aux layer ids, storage dtype,
  hidden size, max length; the trainer builds missing ones first, :mod:`train.prepare`).

The held-out set (``heldout_data``) always gets its features from the target, once, at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from train.config import TrainConfig
from train.distributed import all_reduce


@dataclass
class FeatureSource:
    """This rank's training samples and the held-out set.

    Attributes:
        lengths: token count of each of this rank's samples (what :func:`train.schedule.epoch_batches` groups).
        get_sample: sample ``i`` of this rank (a tokenized row online, a feature row offline).
        token_rows: iterate this rank's ``{"input_ids", "loss_mask"}`` rows (for the draft-vocabulary count).
        stats: data statistics recorded in checkpoints and model cards (``source``, ``num_conversations``, ...).
        extractor: the target-feature extractor (online mode), else None.
        device: where feature batches go.
        heldout: ``[{"batch": TargetBatch}]``, one per held-out conversation (empty when disabled).
    """

    lengths: list[int]
    get_sample: Callable[[int], dict]
    token_rows: Callable[[], Iterable[dict]]
    stats: dict
    extractor: object | None
    device: torch.device
    heldout: list[dict] = field(default_factory=list)

    def features(self, samples: list[dict]):
        """The :class:`~train.features.TargetBatch` of a micro-batch (a target forward online, a collate offline)."""
        if self.extractor is not None:
            return self.extractor(samples)
        from train.features import collate_features
        return collate_features(samples).to(self.device)


def load_feature_source(cfg: TrainConfig, text_config, feature_target: Callable[[], nn.Module], tokenizer,
                        aux_layer_ids: tuple[int, ...] | None, rank: int, world: int,
                        device: torch.device) -> FeatureSource:
    """This rank's samples (module docstring), global data stats, and the held-out set.

    ``text_config`` is the target's text config; ``feature_target()`` returns the target in ``cfg.target_dtype``
    and is called only where a forward is needed (online training, the held-out set's features), so offline
    training on precomputed features without a held-out set never loads it.

    Raises:
        ValueError: online mode without ``data``; offline features that lack some of ``data``'s conversations;
            a rank left without samples.
        FileNotFoundError: offline, no features of this config's key in ``features_dir``.
    """
    if cfg.mode == "online":
        from train.data import build_dataset, load_conversations
        from train.features import TargetFeatureExtractor

        if not cfg.data:
            raise ValueError("online mode needs data (training conversations)")
        convs = load_conversations(cfg.data, limit=cfg.data_limit, progress=cfg.progress and rank == 0)
        dataset, stats = build_dataset([c["messages"] for c in convs], tokenizer, max_length=cfg.max_length,
                                       rank=rank, world_size=world, shuffle_seed=cfg.seed,
                                       check_heldout=cfg.check_heldout, progress=cfg.progress and rank == 0)
        source = FeatureSource(
            lengths=list(dataset["length"]), get_sample=lambda i: dataset[i],
            token_rows=lambda: ({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in dataset),
            stats={"source": cfg.data, **stats.as_dict()},
            extractor=TargetFeatureExtractor(feature_target(), aux_layer_ids, cfg.micro_batch_size, cfg.max_length),
            device=device)
    else:
        from train.data import load_conversations
        from train.features import FeatureStore, conversation_key
        from train.precompute_features import feature_key

        key = feature_key(cfg, text_config)
        store = FeatureStore(cfg.features_dir, matching=key)
        if cfg.data:  # train on exactly the conversations of the data file, all of which must have features
            keys = [conversation_key(c["messages"]) for c in load_conversations(
                cfg.data, limit=cfg.data_limit, progress=cfg.progress and rank == 0)]
            missing = set(keys) - store.keys - store.dropped
            if missing:
                raise ValueError(f"{len(missing)} of the {len(keys)} conversations of {cfg.data} have no features "
                                 f"in {cfg.features_dir}: run train/precompute_features.py with this config")
            store = FeatureStore(cfg.features_dir, only=keys, matching=key)
        meta = store.meta
        indices = list(range(len(store)))[: None if cfg.data else cfg.data_limit]
        mine = indices[rank * len(indices) // world:(rank + 1) * len(indices) // world]
        lengths = [store.lengths[i] for i in mine]
        tokens = all_reduce([sum(lengths)])
        source = FeatureSource(
            lengths=lengths, get_sample=lambda i: store.get(mine[i]),
            token_rows=lambda: (store.get(i, with_hidden=False) for i in mine),
            stats={"source": cfg.data or meta.get("data", cfg.features_dir),  # the selected rows' file
                   "features_dir": cfg.features_dir, "num_conversations": len(indices),
                   "num_tokens": int(tokens[0]), "max_length": meta.get("max_length")},
            extractor=None, device=device)
    if not source.lengths:
        raise ValueError(f"rank {rank} has no training samples")
    source.heldout = _heldout_features(cfg, feature_target, tokenizer, aux_layer_ids, source.extractor)
    return source


def _heldout_features(cfg: TrainConfig, feature_target, tokenizer, aux_layer_ids, extractor) -> list[dict]:
    """Held-out samples with target features (computed once, through the same extractor path)."""
    if not cfg.heldout_data or cfg.heldout_samples == 0:
        return []
    from train.data import build_dataset, load_conversations
    from train.features import TargetFeatureExtractor

    convs = load_conversations(cfg.heldout_data, limit=cfg.heldout_samples, progress=False)
    dataset, _ = build_dataset([c["messages"] for c in convs], tokenizer, max_length=cfg.max_length,
                               shuffle_seed=None, check_heldout=False, progress=False)
    extractor = extractor or TargetFeatureExtractor(feature_target(), aux_layer_ids, 1, cfg.max_length)
    return [{"batch": extractor([{"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}])}
            for row in dataset]
