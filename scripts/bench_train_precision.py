"""Tokens/s of the trainer's optimizer step (forward + backward + step of the DeepSpeed engine) in float32, under
bf16 ``torch.autocast`` over float32 master weights (``autocast: bfloat16``), and with DeepSpeed's ``bf16``
section (``dtype: bfloat16``). One :class:`train.train_draft.Trainer` per precision, built from the same config on
the same offline features (built on demand), stepped in turn on the same micro-batches in one process, so the
ratios hold on a loaded machine.

    python scripts/bench_train_precision.py --config configs/smollm2-135m-eagle3.yaml --steps 8 \\
        --max_length 256 --data_limit 48 --features_dir /tmp/features [any TrainConfig --key value]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ssd_eagle.platform import describe_line
from train.config import load_config
from train.train_draft import Trainer, init_distributed

PRECISIONS = {"float32": [], "autocast_bf16": ["--autocast", "bfloat16"], "deepspeed_bf16": ["--dtype", "bfloat16"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, default=8, help="timed micro-steps per precision (after one warm-up)")
    args, overrides = ap.parse_known_args()

    init_distributed()
    out = Path(tempfile.mkdtemp(prefix="bench_train_precision-"))
    common = ["--heldout_data", "none", "--resume", "false", "--progress", "false", "--report_to", "none",
              "--max_steps", str(args.steps + 1), *overrides]
    trainers = {name: Trainer(load_config(args.config, [*common, *extra, "--output_dir", str(out / name)]))
                for name, extra in PRECISIONS.items()}
    times = {name: [] for name in trainers}
    tokens = []
    for micro in range(args.steps + 1):
        for name, trainer in trainers.items():
            batch = trainer.data.features(trainer._micro_batch(micro))
            t0 = time.perf_counter()
            loss = trainer._forward(batch)[0]
            trainer.engine.backward(loss)
            trainer.engine.step()
            if micro:  # the first step warms up
                times[name].append(time.perf_counter() - t0)
        tokens.append(batch.num_tokens)
    cfg = trainers["float32"].cfg
    print(describe_line("cpu", torch.float32))
    print(f"{cfg.draft} of {cfg.target}: {sum(tokens[1:])} tokens in {args.steps} micro-steps (batch "
          f"{cfg.micro_batch_size}, max_length {cfg.max_length}, TTT {cfg.ttt_steps}), precisions in turn")
    base = sum(times["float32"])
    for name, ts in times.items():
        print(f"{name:15s} {sum(ts) / len(ts) * 1e3:9.1f} ms/step {sum(tokens[1:]) / sum(ts):8.0f} tokens/s  "
              f"x{base / sum(ts):.2f} vs float32")


if __name__ == "__main__":
    main()
