"""Acceptance length tau of each draft on the held-out splits, served by our engine, next to the n-gram drafter.

Chain drafting with K tokens per round at T = 0 (greedy: tau depends only on the draft and the text), on the
held-out MT-Bench questions (first turn) and held-out HumanEval problems, rendered with the chat template.
``--temperature T`` samples instead (``--seeds N`` samples per prompt, the same seeds for every draft), and
``--draft-temperature-scale 1,0.7`` serves each draft with each temperature scale s (``train.calibrate``):

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --temperature 1 --seeds 2 \
        --draft-temperature-scale 1,0.7 --max-tokens 64 --no-ngram

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --draft draft_model=drafts/smollm2-135m-draftlm
    python scripts/eval_draft.py --curve runs/smollm2-135m-eagle3 --no-eval   # only the learning-curve PNG

The full table of issue 14 (tau at K = 3, 5, 7 with the acceptance per position, the SSD bonus-candidate hit rate
at F = 1..8, teacher-forced tau and step accuracy on the target's greedy answers):

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --k 3,5,7 --max-tokens 64 --hit-curve \\
        --teacher-forced runs/heldout/mtbench-80.jsonl

``--curve RUN_DIR`` writes ``RUN_DIR/learning_curve.png`` from the training run's ``metrics.jsonl`` (loss, top-1
accuracy per TTT step and held-out tau against steps; :func:`train.tracking.plot_learning_curve`).

``--node-table`` serves each draft with SSD instead (speculator in this process, trees of ``--tree-budget`` nodes
(default ``auto``) and a chain, fan-out budget ``--fanout-budget``) and prints the per-node hit table of
:class:`ssd_eagle.ssd.branch_trees.NodeHitTable`: for every node (rank path; depth, rank among siblings) how often
it was proposed, how often the verification outcome landed on it (and the draft's own estimate of that), how
often the bonus was among the candidates stored there, and the histogram of the bonus's rank among the draft's
candidates there (last column: past them).

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --node-table --limit 4 --max-tokens 64

``--step-agreement`` checks that the engine drafts what training taught: for each EAGLE-3 draft, the share of the
engine's chain tokens at step i (K = the first ``--k``, held-out MT-Bench, T = 0) equal to the argmax of the TTT
unroll's step i on the same text, over the steps up to the first rejection (:func:`step_agreement`).

    python scripts/eval_draft.py --draft eagle3=drafts/smollm2-135m-eagle3 --step-agreement --limit 20 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
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
             batch: int, temperature: float = 0.0, seeds: int = 1) -> dict:
    """Serve ``prompts`` with ``spec``'s drafter (chain, K fixed, no planner); at ``temperature`` > 0 every prompt
    ``seeds`` times, request i's sampler seeded with i (the same seeds for every draft)."""
    drafter = build_drafter(spec, model, batch, 4096 + 64)
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=spec.num_speculative_tokens,
                       max_num_seqs=batch, max_model_len=4096, max_draft_tokens=spec.max_draft_tokens)
    start = time.perf_counter()
    copies = seeds if temperature > 0 else 1
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i)
              for i in range(copies * len(prompts))]
    LLM(engine=engine).generate(prompts * copies, params, use_tqdm=True)
    s = engine.stats
    k = spec.num_speculative_tokens
    return {"tau": round(s.tau, 3), "acceptance_rate": round(s.acceptance_rate, 3), "rounds": s.num_rounds,
            "tokens": s.num_emitted, "seconds": round(time.perf_counter() - start, 1),
            "accepted_per_position": [round(sum(a >= i for a in s.accepted_lengths) / max(s.num_rounds, 1), 3)
                                      for i in range(1, k + 1)]}


def step_agreement(model, tokenizer, spec: SpeculativeConfig, prompts: list[list[int]], max_tokens: int) -> dict:
    """The engine's EAGLE-3 chains against the training-time unroll on the same text, token by token.

    Serves ``prompts`` one at a time (chain, T = 0) recording every round's proposal, then runs
    :func:`train.ttt.ttt_unroll` over prompt + answer with the target's features of that text: step ``i`` at row
    ``t = len(committed) - 2`` is fed the text's tokens, which equal the engine's drafts up to the first rejection,
    so steps ``0 .. accepted`` are compared (``agreement[i]`` over ``compared[i]`` rounds; None where no round
    reached step i).
    """
    from train.features import TargetFeatureExtractor
    from train.ttt import ttt_unroll

    k = spec.num_speculative_tokens
    drafter = build_drafter(spec, model, 1, 4096 + 64)
    head, rounds, propose = drafter.head, [], drafter.propose

    def recording(seqs, budgets):
        proposals = propose(seqs, budgets)
        rounds.append((len(seqs[0].token_ids), list(proposals[0].tokens)))
        return proposals

    drafter.propose = recording
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=k, max_num_seqs=1, max_model_len=4096)
    extractor = TargetFeatureExtractor(model, head.config.aux_layer_ids, 1, 4096 + 64)
    agree, compared = [0] * k, [0] * k
    for prompt in prompts:
        rounds.clear()
        out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
        ids = list(prompt) + list(out.outputs[0].token_ids)
        batch = extractor([{"input_ids": ids, "loss_mask": [1] * len(ids)}])
        with torch.inference_mode():
            steps = [head.draft_to_target(head.compute_logits(o.hidden[0]).argmax(-1)).tolist()
                     for o in ttt_unroll(head, batch.input_ids, batch.aux_hidden, k)]
        for length, proposal in rounds:
            for i, token in enumerate(proposal):
                compared[i] += 1
                agree[i] += steps[i][length - 2] == token
                if length + i >= len(ids) or token != ids[length + i]:
                    break  # drafts after the first rejection were fed tokens the text does not have
    return {"agreement": [round(a / c, 4) if c else None for a, c in zip(agree, compared)], "compared": compared}


def hit_curve(rows: list[dict]) -> list[float]:
    """SSD bonus-candidate hit rate at F = 1..8 from a chain's node table: the share of rounds whose bonus token is
    among the draft's top-F candidates at the node where verification ended (what a fan-out of F per node could
    hit, whatever was stored)."""
    landed = sum(r["landed"] for r in rows)
    width = max(len(r["bonus_rank_hist"]) - 1 for r in rows)
    within = [sum(sum(r["bonus_rank_hist"][:f]) for r in rows) for f in range(1, width + 1)]
    return [round(w / max(landed, 1), 3) for w in within]


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
    ap.add_argument("--k", default="5", help="draft tokens per round, or a comma list (3,5,7)")
    ap.add_argument("--no-ngram", action="store_true", help="leave out the n-gram baseline")
    ap.add_argument("--hit-curve", action="store_true",
                    help="also the SSD bonus-candidate hit rate at F = 1..8 (a chain served by SSD, first K)")
    ap.add_argument("--teacher-forced", default=None, metavar="HELDOUT_JSONL",
                    help="also teacher-forced tau and step accuracy on this held-out file (python -m train.heldout "
                         "generate)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (> 0: seeded per request, the same seeds for every draft)")
    ap.add_argument("--seeds", type=int, default=1, help="at --temperature > 0: samples per prompt")
    ap.add_argument("--draft-temperature-scale", default=None, metavar="S[,S...]",
                    help="serve each draft with these temperature scales s (speculative_config."
                         "draft_temperature_scale; default: the s each draft's config.json records)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="prompts per split (default: all held-out)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process may use)")
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--curve", action="append", default=[], metavar="RUN_DIR",
                    help="write RUN_DIR/learning_curve.png from a training run's metrics.jsonl (repeatable)")
    ap.add_argument("--no-eval", action="store_true", help="only write the --curve PNGs")
    ap.add_argument("--node-table", action="store_true", help="SSD per-node hit tables (trees and chains) instead")
    ap.add_argument("--step-agreement", action="store_true",
                    help="EAGLE-3 drafts: the engine's proposals against the TTT unroll, per step, instead")
    ap.add_argument("--tree-budget", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tree nodes, or auto (ssd_eagle.ssd.branch_trees.AUTO_TREE)")
    ap.add_argument("--tree-topk", type=int, default=None, help="expansions per level (default: auto's, else 4)")
    ap.add_argument("--fanout-budget", type=int, default=24)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    if args.draft_temperature_scale is not None and args.temperature <= 0:
        ap.error("--draft-temperature-scale only changes sampled drafts: give --temperature > 0")

    for run_dir in args.curve:
        print("learning curve:", plot_learning_curve(run_dir, Path(run_dir) / "learning_curve.png"), flush=True)
    if args.no_eval:
        return

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    dtype = resolve_dtype(args.dtype, "cpu")
    model, tokenizer = load_model(args.model, dtype=dtype)
    ks = [int(k) for k in str(args.k).split(",")]
    specs = {} if args.no_ngram else {"ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=ks[0])}
    scales = [None] if args.draft_temperature_scale is None else \
        [float(x) for x in args.draft_temperature_scale.split(",")]
    for item in args.draft:
        method, path = item.split("=", 1)
        for scale in scales:
            specs[f"{method}:{path}" + ("" if scale is None else f"@s={scale:g}")] = SpeculativeConfig(
                method=method, model=path, num_speculative_tokens=ks[0], draft_temperature_scale=scale)
    splits = {split: [render_chat(tokenizer, p["messages"]) for p in heldout_prompts(split)[: args.limit]]
              for split in ("mtbench", "humaneval")}
    if args.node_table:
        every = [p for prompts in splits.values() for p in prompts]
        for name, spec in [(n, s) for n, s in specs.items() if s.method != "ngram"]:
            ssd = {**spec.to_dict(), "speculator": "local", "fanout_budget": args.fanout_budget}
            tree = {"tree_budget": args.tree_budget, "tree_depth": ks[0],
                    **({"tree_topk": args.tree_topk} if args.tree_topk else {})}
            chain = {"fanout_strategy": "geometric"}
            for kind, extra in (("tree", tree), ("chain", chain)):
                config = SpeculativeConfig(**{**ssd, **extra})
                if kind == "tree":
                    kind = f"tree ({config.tree_budget} nodes, top-{config.tree_topk})"
                result = node_table(model, tokenizer, config, every, args.max_tokens)
                print_node_table(f"{name} {kind} B={args.fanout_budget}", result)
        print(f"\n{describe_line('cpu', dtype)}\nK={args.k} T=0 max_tokens={args.max_tokens} prompts={len(every)}")
        return
    if args.step_agreement:
        for name, spec in [(n, s) for n, s in specs.items() if s.method == "eagle3"]:
            print(name, "engine vs TTT step argmax, mtbench:",
                  step_agreement(model, tokenizer, spec, splits["mtbench"], args.max_tokens), flush=True)
        print(f"\n{describe_line('cpu', dtype)}\nK={args.k} T=0 max_tokens={args.max_tokens}")
        return
    table, extra = {}, {}
    for name, spec in specs.items():
        for split, prompts in splits.items():
            for k in ks:
                kspec = SpeculativeConfig(**{**spec.to_dict(), "num_speculative_tokens": k})
                table[(name, split, k)] = evaluate(model, tokenizer, kspec, prompts, args.max_tokens, args.batch,
                                                   args.temperature, args.seeds)
                print(name, split, k, table[(name, split, k)], flush=True)
            if args.hit_curve and spec.method != "ngram":
                ssd = SpeculativeConfig(**{**spec.to_dict(), "speculator": "local", "fanout_strategy": "geometric",
                                           "fanout_budget": args.fanout_budget})
                curve = hit_curve(node_table(model, tokenizer, ssd, prompts, args.max_tokens)["rows"])
                extra[f"{name}|{split}|hit_at_F"] = curve
                print(name, split, "SSD hit rate at F = 1..", curve, flush=True)
        if args.teacher_forced and spec.method != "ngram":
            from train.heldout import estimate_tau
            tf = estimate_tau(spec.model, args.teacher_forced, target=args.model, num_draft=max(ks),
                              dtype=args.dtype, progress=False)
            extra[f"{name}|teacher_forced"] = {k: tf[k] for k in ("tau", "feature_fed_tau", "step_accuracy",
                                                                        "samples")}
            print(name, "teacher-forced", extra[f"{name}|teacher_forced"], flush=True)
    sampled = f" seeds={args.seeds}" if args.temperature > 0 else ""
    print(f"\n{describe_line('cpu', dtype)}\nK={args.k} T={args.temperature:g}{sampled} max_tokens={args.max_tokens} "
          "prompts: "
          + ", ".join(f"{s}={len(p)}" for s, p in splits.items()))
    print(f"{'draft':50s} {'split':10s} {'K':>2s} {'tau':>6s} {'accept':>7s}  acceptance per position")
    for (name, split, k), row in table.items():
        print(f"{name:50s} {split:10s} {k:2d} {row['tau']:6.3f} {row['acceptance_rate']:7.3f}  "
              f"{row['accepted_per_position']}")
    for key, value in extra.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"{n}|{s}|K={k}": r for (n, s, k), r in table.items()}, **extra}, f, indent=2)


if __name__ == "__main__":
    main()
