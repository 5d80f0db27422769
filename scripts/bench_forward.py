"""The target's forward cost for n new tokens after a C-token context, per dtype, side by side in one process.

What a verification of K drafts costs (n = K + 1) next to a one-token decode step (n = 1): the ratio decides
whether speculation can pay (issue 13). The context is a held-out prompt's first C tokens, prefilled once into the
engine's :class:`~ssd_eagle.kv_cache.KVCache`; each timed forward writes positions C .. C+n-1 (what a verification
does) and computes the logits of all n positions. Median of ``--repeats`` forwards after ``--warmup``, one
configuration after another, in the dtypes given (``auto``: see :mod:`ssd_eagle.platform`).

    python scripts/bench_forward.py --context 200 --tokens 1,2,4,6,8,16 --dtypes float32,bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.platform import describe_line, resolve_dtype
from ssd_eagle.prompts import heldout_prompts


def forward_ms(runner: ModelRunner, context: list[int], n: int, repeats: int, warmup: int) -> float:
    """Median milliseconds of one forward over ``n`` new tokens after ``context`` (already cached)."""
    batch = ForwardBatch.causal([context[-1:] * n], [0], [len(context)], runner.dtype, runner.device)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        runner.forward(batch)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the new ones")
    ap.add_argument("--tokens", default="1,2,4,6,8,16", help="comma-separated n (new tokens per forward)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated --dtype values")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    ns = [int(n) for n in args.tokens.split(",")]
    table = {}
    for name in args.dtypes.split(","):
        dtype = resolve_dtype(name, "cpu")
        print(describe_line("cpu", dtype), flush=True)
        model, tokenizer = load_model(args.model, dtype=dtype)
        ids = [t for p in heldout_prompts("mtbench") for t in render_chat(tokenizer, p["messages"])]
        context = ids[: args.context]
        runner = ModelRunner(model, 1, args.context + max(ns) + 1)
        runner.forward(ForwardBatch.causal([context], [0], [0], runner.dtype, runner.device))
        table[name] = {n: forward_ms(runner, context, n, args.repeats, args.warmup) for n in ns}
        print(f"{name}: " + ", ".join(f"n={n} {ms:.1f} ms" for n, ms in table[name].items()), flush=True)
    print(f"\ncontext={args.context} threads={args.threads} repeats={args.repeats} (median ms per forward; "
          f"x1: ratio to n=1 in the same dtype)")
    print(f"{'dtype':10s} " + " ".join(f"{'n=' + str(n):>14s}" for n in ns))
    for name, row in table.items():
        print(f"{name:10s} " + " ".join(f"{ms:7.1f} (x{ms / row[ns[0]]:4.2f})" for ms in row.values()))


if __name__ == "__main__":
    main()
