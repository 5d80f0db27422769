"""Precompute the target's features once for offline draft training.

    python train/precompute_features.py --config configs/smollm2-135m-eagle3.yaml [--key value ...]
    deepspeed --num_gpus N train/precompute_features.py --config ...      # each rank writes its shard

Reads the training conversations of the config (``data``, ``data_limit``, ``max_length``), runs the frozen target
over them through :class:`~train.features.TargetFeatureExtractor` (the serving ``ModelRunner`` path) and writes
safetensors shards plus an index into ``features_dir`` (layout in :mod:`train.features`): aux hidden states of
``aux_layer_ids`` (default ``(2, L//2, L-3)``, input-of-layer), the final-normed last hidden state, and the
target's greedy next token, hidden states in ``feature_dtype``. The same directory serves both draft kinds (the
draft LM ignores the aux states). No process group is needed: the rank and world size come from the environment.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from train.config import TrainConfig, parse_args


def precompute(cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> dict:
    """Write this rank's feature shards; returns ``{"index", "samples", "tokens", "seconds"}``.

    Raises:
        ValueError: no ``features_dir`` or no ``data`` in the config.
    """
    from ssd_eagle.assets import load_model
    from ssd_eagle.model_runner import default_aux_layer_ids
    from train.data import build_dataset, load_conversations
    from train.features import TargetFeatureExtractor, write_feature_shards

    if not cfg.features_dir or not cfg.data:
        raise ValueError("precomputing features needs features_dir and data in the config")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    target, tokenizer = load_model(cfg.target, dtype=torch.float32, device=device)
    num_layers = target.config.get_text_config().num_hidden_layers
    aux_ids = tuple(cfg.aux_layer_ids) if cfg.aux_layer_ids else default_aux_layer_ids(num_layers)
    convs = load_conversations(cfg.data, limit=cfg.data_limit)
    dataset, stats = build_dataset([c["messages"] for c in convs], tokenizer, max_length=cfg.max_length, rank=rank,
                                   world_size=world_size, shuffle_seed=cfg.seed, check_heldout=cfg.check_heldout,
                                   progress=cfg.progress and rank == 0)
    extractor = TargetFeatureExtractor(target, aux_ids, max_batch=cfg.micro_batch_size, max_len=cfg.max_length)
    t0 = time.perf_counter()
    rows = ({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in dataset)
    meta = {"target": cfg.target, "data": cfg.data, "data_limit": cfg.data_limit, "max_length": cfg.max_length,
            "world_size": world_size, "seed": cfg.seed, "mask_stats": stats.as_dict()}
    index = write_feature_shards(rows, extractor, cfg.features_dir, rank=rank, dtype=getattr(torch, cfg.feature_dtype),
                                 batch_size=cfg.micro_batch_size, meta=meta, total=len(dataset),
                                 progress=cfg.progress and rank == 0)
    return {"index": str(index), "samples": len(dataset), "tokens": int(sum(dataset["length"])),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    result = precompute(cfg, rank, world)
    print(f"rank {rank}: {result['samples']} samples, {result['tokens']} tokens in {result['seconds']:.0f} s "
          f"({result['tokens'] / max(result['seconds'], 1e-9):.0f} tokens/s) -> {result['index']}")
    return result


if __name__ == "__main__":
    main()
