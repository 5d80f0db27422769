"""Acceptance length tau of each draft on the held-out splits, served by our engine, next to the n-gram drafter.

Chain drafting with K tokens per round at T = 0 (greedy: tau depends only on the draft and the text), on the
held-out MT-Bench questions (first turn) and held-out HumanEval problems, rendered with the chat template.

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --draft draft_model=drafts/smollm2-135m-draftlm
    python scripts/eval_draft.py --curve runs/smollm2-135m-eagle3 --no-eval   # only the learning-curve PNG

``--curve RUN_DIR`` writes ``RUN_DIR/learning_curve.png`` from the training run's ``metrics.jsonl`` (loss, top-1
accuracy per TTT step and held-out tau against steps; :func:`train.tracking.plot_learning_curve`).

``--node-table`` serves each draft with SSD instead (speculator in this process, trees of ``--tree-budget`` nodes
(default ``auto``) and a chain, fan-out budget ``--fanout-budget``) and prints the per-node hit table of
:class:`ssd_eagle.ssd.branch_trees.NodeHitTable`: for every node (rank path; depth, rank among siblings) how often
it was proposed, how often the verification outcome landed on it (and the draft's own estimate of that), how
often the bonus was among the candidates stored there, and the histogram of the bonus's rank among the draft's
candidates there (last column: past them).

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --node-table --limit 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters import build_drafter
from ssd_eagle.engine.llm import LLM, render_chat
from ssd_eagle.engine.factory import make_drafter
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.platform import DTYPE_HELP, DTYPES, describe_line, resolve_dtype
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams
from train.tracking import plot_learning_curve


def evaluate(model, tokenizer, spec: SpeculativeConfig, prompts: list[list[int]], max_tokens: int,
             batch: int) -> dict:
    drafter = build_drafter(spec, model, batch, 4096 + 64)
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=spec.num_speculative_tokens,
                       max_num_seqs=batch, max_model_len=4096, max_draft_tokens=spec.max_draft_tokens)
    start = time.perf_counter()
    LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    s = engine.stats
    return {"tau": round(s.tau, 3), "acceptance_rate": round(s.acceptance_rate, 3), "rounds": s.num_rounds,
            "tokens": s.num_emitted, "seconds": round(time.perf_counter() - start, 1)}


def node_table(model, tokenizer, spec: SpeculativeConfig, prompts: list[list[int]], max_tokens: int) -> dict:
    """SSD with ``spec`` (speculator in this process) over ``prompts``; the speculator's per-node hit table."""
    config = EngineConfig(model="in-memory", mode="ssd", speculative_config=spec, max_num_seqs=1, max_model_len=4096)
    drafter = make_drafter(config, model, 4096)
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=spec.num_speculative_tokens, max_num_seqs=1,
                       max_model_len=4096, max_draft_tokens=spec.max_draft_tokens)
    LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    s = engine.stats
    return {"hit": s.cache_hit_rate, "tau": s.tau, "rows": drafter.speculator.speculator.node_table.rows()}


def print_node_table(name: str, result: dict) -> None:
    print(f"\n{name}: cache hit {result['hit']:.3f}, tau {result['tau']:.3f}")
    print(f"{'node':18s} {'depth':>5s} {'sib':>3s} {'proposed':>8s} {'landed':>6s} {'land':>5s} {'draft':>5s} "
          f"{'hit':>5s}  bonus rank 0..7, past")
    for r in result["rows"]:
        hit = "-" if r["stored_hit_rate"] is None else f"{r['stored_hit_rate']:.2f}"
        print(f"{str(r['node']):18s} {r['depth']:5d} {r['sibling_rank']:3d} {r['proposed']:8d} {r['landed']:6d} "
              f"{r['land_rate']:5.2f} {r['draft_land']:5.2f} {hit:>5s}  {r['bonus_rank_hist']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    ap.add_argument("--draft", action="append", default=[], metavar="METHOD=PATH",
                    help="a draft to evaluate: eagle3=PATH or draft_model=PATH (repeatable)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="prompts per split (default: all held-out)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--curve", action="append", default=[], metavar="RUN_DIR",
                    help="write RUN_DIR/learning_curve.png from a training run's metrics.jsonl (repeatable)")
    ap.add_argument("--no-eval", action="store_true", help="only write the --curve PNGs")
    ap.add_argument("--node-table", action="store_true", help="SSD per-node hit tables (trees and chains) instead")
    ap.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tree nodes, or auto (ssd_eagle.ssd.branch_trees.AUTO_TREE, whatever --tree-topk says)")
    ap.add_argument("--tree-topk", type=int, default=4)
    ap.add_argument("--fanout-budget", type=int, default=24)
    args = ap.parse_args()

    for run_dir in args.curve:
        print("learning curve:", plot_learning_curve(run_dir, Path(run_dir) / "learning_curve.png"), flush=True)
    if args.no_eval:
        return

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    model, tokenizer = load_model(args.model, dtype=dtype)
    specs = {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)}
    for item in args.draft:
        method, path = item.split("=", 1)
        specs[f"{method}:{path}"] = SpeculativeConfig(method=method, model=path, num_speculative_tokens=args.k)
    splits = {split: [render_chat(tokenizer, p["messages"]) for p in heldout_prompts(split)[: args.limit]]
              for split in ("mtbench", "humaneval")}
    if args.node_table:
        every = [p for prompts in splits.values() for p in prompts]
        for name, spec in list(specs.items())[1:]:
            ssd = {**spec.to_dict(), "speculator": "local", "fanout_budget": args.fanout_budget}
            tree = {"tree_budget": args.tree_budget, "tree_depth": args.k, "tree_topk": args.tree_topk}
            chain = {"fanout_strategy": "geometric"}
            for kind, extra in (("tree", tree), ("chain", chain)):
                config = SpeculativeConfig(**{**ssd, **extra})
                if kind == "tree":
                    kind = f"tree ({config.tree_budget} nodes, top-{config.tree_topk})"
                result = node_table(model, tokenizer, config, every, args.max_tokens)
                print_node_table(f"{name} {kind} B={args.fanout_budget}", result)
        print(f"\n{describe_line('cpu', dtype)}\nK={args.k} T=0 max_tokens={args.max_tokens} prompts={len(every)}")
        return
    table = {}
    for name, spec in specs.items():
        for split, prompts in splits.items():
            table[(name, split)] = evaluate(model, tokenizer, spec, prompts, args.max_tokens, args.batch)
            print(name, split, table[(name, split)], flush=True)
    print(f"\n{describe_line('cpu', dtype)}\nK={args.k} T=0 max_tokens={args.max_tokens} prompts: "
          + ", ".join(f"{s}={len(p)}" for s, p in splits.items()))
    print(f"{'draft':50s} {'split':10s} {'tau':>6s} {'accept':>7s}")
    for (name, split), row in table.items():
        print(f"{name:50s} {split:10s} {row['tau']:6.3f} {row['acceptance_rate']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{n}|{s}": r for (n, s), r in table.items()}, f, indent=2)


if __name__ == "__main__":
    main()
