"""Precompute the target's features once for offline draft training.

    python train/precompute_features.py --config configs/smollm2-135m-eagle3.yaml [--key value ...]
    deepspeed --num_gpus N train/precompute_features.py --config ...      # each rank writes its shard

Reads the training conversations of the config (``data``, ``data_limit``, ``max_length``), runs the frozen target
over them through :class:`~train.features.TargetFeatureExtractor` (the serving ``ModelRunner`` path) and writes
safetensors shards plus an index into ``features_dir`` (layout in :mod:`train.features`): aux hidden states of
``aux_layer_ids`` (default ``(2, L//2, L-3)``, input-of-layer), the final-normed last hidden state, and the
target's greedy next token, hidden states in ``feature_dtype``. The same directory serves both draft kinds (the
draft LM ignores the aux states). No process group is needed: the rank and world size come from the environment.

Incremental and resumable: conversations already in ``features_dir`` (same content, same :func:`feature_key`) are
skipped, so a run over a data file that has grown computes only the new rows, and a killed run continues from its
last complete shard. The trainer runs the same steps itself when its features are missing (:mod:`train.prepare`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ssd_eagle.model_runner import default_aux_layer_ids
from train.config import TrainConfig, parse_args


def masked_samples(conversations: list[dict], tokenizer, max_length: int, check_heldout: bool = True,
                   progress: bool = True) -> tuple[list[dict], list[str], dict]:
    """Assistant-masked samples of ``[{"messages"}, ...]`` keyed by :func:`~train.features.conversation_key`.

    Returns:
        ``(samples [{"input_ids", "loss_mask", "conv"}], keys of conversations without a loss token, mask stats)``.

    Raises:
        HeldoutLeakError: with ``check_heldout``, a held-out prompt in the data.
        ValueError: an assistant turn that cannot be located (the message names the conversation).
    """
    from tqdm.auto import tqdm

    from train.data import MaskStats, assert_no_heldout, assistant_mask
    from train.features import conversation_key

    if check_heldout:
        assert_no_heldout([c["messages"] for c in conversations])
    stats = MaskStats(max_length=max_length)
    samples, dropped = [], []
    for conv in tqdm(conversations, desc="masking conversations", disable=not progress, leave=False):
        key = conversation_key(conv["messages"])
        try:
            sample = assistant_mask(conv["messages"], tokenizer, max_length, stats=stats)
        except ValueError as err:
            raise ValueError(f"conversation {conv.get('id')}: {err}") from err
        if not any(sample["loss_mask"]):
            stats.num_dropped_no_loss += 1
            dropped.append(key)
            continue
        samples.append({"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"], "conv": key})
    return samples, dropped, stats.as_dict()


def feature_key(cfg: TrainConfig, text_config) -> dict:
    """The :data:`~train.features.SHARED_META` values of the features ``cfg`` trains on (``text_config``: the
    target's text config). Runs of a features directory with other values (another target or target dtype, aux ids,
    storage dtype, hidden size or ``max_length``) are ignored, not mixed in, so changing any of them builds new
    features."""
    aux = cfg.aux_layer_ids or default_aux_layer_ids(text_config.num_hidden_layers)
    return {"target": cfg.target, "target_dtype": cfg.target_dtype, "aux_layer_ids": list(aux),
            "dtype": cfg.feature_dtype, "hidden_size": int(text_config.hidden_size), "max_length": cfg.max_length}


def missing_conversations(cfg: TrainConfig, key: dict) -> tuple[int, list[dict]]:
    """``(number of conversations of cfg.data, those without features of this key in features_dir)``.

    Raises:
        ValueError: no ``features_dir`` or no ``data`` in the config.
    """
    from train.data import load_conversations
    from train.features import FeatureStore, conversation_key

    if not cfg.features_dir or not cfg.data:
        raise ValueError("precomputing features needs features_dir and data in the config")
    convs = load_conversations(cfg.data, limit=cfg.data_limit, progress=cfg.progress)
    try:
        store = FeatureStore(cfg.features_dir, matching=key)
        done = store.keys | store.dropped
    except FileNotFoundError:
        done = set()
    return len(convs), [c for c in convs if conversation_key(c["messages"]) not in done]


def write_features(cfg: TrainConfig, todo: list[dict], target, tokenizer, key: dict, rank: int = 0,
                   world_size: int = 1, run: str | None = None) -> dict:
    """Mask this rank's share of ``todo`` and write its feature shards (tqdm bar on rank 0).

    Returns:
        ``{"index", "samples", "tokens", "seconds"}`` (``index`` None when this rank had nothing to do).
    """
    from train.features import TargetFeatureExtractor, write_feature_shards

    todo = todo[rank * len(todo) // world_size: (rank + 1) * len(todo) // world_size]
    samples, dropped, stats = masked_samples(todo, tokenizer, cfg.max_length, cfg.check_heldout,
                                             cfg.progress and rank == 0)
    result = {"index": None, "samples": len(samples), "tokens": sum(len(s["input_ids"]) for s in samples),
              "seconds": 0.0}
    if not samples and not dropped:
        return result
    extractor = TargetFeatureExtractor(target, key["aux_layer_ids"], max_batch=cfg.micro_batch_size,
                                       max_len=cfg.max_length)
    t0 = time.perf_counter()
    meta = {"target": cfg.target, "target_dtype": cfg.target_dtype, "data": cfg.data, "data_limit": cfg.data_limit, "max_length": cfg.max_length,
            "world_size": world_size, "mask_stats": stats, "dropped": dropped}
    run = run or time.strftime("%Y%m%d-%H%M%S")
    index = write_feature_shards(samples, extractor, cfg.features_dir, run=run, rank=rank,
                                 dtype=getattr(torch, cfg.feature_dtype), batch_size=cfg.micro_batch_size, meta=meta,
                                 total=len(samples), progress=cfg.progress and rank == 0)
    result.update(index=str(index), seconds=time.perf_counter() - t0)
    return result


def precompute(cfg: TrainConfig, rank: int = 0, world_size: int = 1, run: str | None = None) -> dict:
    """Write this rank's feature shards for the conversations of ``cfg.data`` that ``cfg.features_dir`` lacks.

    Returns:
        ``{"index", "samples", "tokens", "seconds", "skipped"}`` (``index`` None when nothing was missing).

    Raises:
        ValueError: no ``features_dir`` or no ``data`` in the config.
    """
    from ssd_eagle.assets import load_model

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_model(cfg.target, dtype=getattr(torch, cfg.target_dtype), device=device,
                                   progress=cfg.progress and rank == 0)
    key = feature_key(cfg, target.config.get_text_config())
    total, todo = missing_conversations(cfg, key)
    result = write_features(cfg, todo, target, tokenizer, key, rank, world_size, run)
    return dict(result, skipped=total - len(todo))


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    result = precompute(cfg, rank, world)
    print(f"rank {rank}: {result['skipped']} conversations already done; {result['samples']} samples, "
          f"{result['tokens']} tokens in {result['seconds']:.0f} s "
          f"({result['tokens'] / max(result['seconds'], 1e-9):.0f} tokens/s) -> {result['index']}")
    return result


if __name__ == "__main__":
    main()
