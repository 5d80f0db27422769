"""What an SD round costs at each draft length K, per drafter, against a plain decoding step, side by side in one run.

The planner (:mod:`ssd_eagle.planner`) prices a round as its drafting plus its verification, and a round it plans off
(K = 0) as an AR step. This script checks both on the real target: every drafter runs with K fixed for every round
(0 included: the drafter is called with a zero budget, as on a planned-off round), and the table gives, per round,
the wall and main-thread CPU milliseconds, the engine's drafting and verification time (``SpecStats``) and the
rest (the engine's bookkeeping), with the ratio to AR's step; then the tokens a round emits (tau) and the decoding
speed over AR's, so that every fixed K stands next to the planner's choice (``--plan``: a row ``plan`` per drafter,
the planner picking K in 0..5 as the serving default does). One core, one torch thread, batch 1, held-out prompts;
``--repeats`` interleaved passes (every configuration once per pass), medians. At T > 0 a different K draws a
different text (the seeded sampler's stream is consumed differently), so tau differs between rows by more than the
drafts do on a few prompts; T = 0 compares like with like.

    python scripts/bench_round_cost.py --ks 0,1,2,5 --temperature 1.0 --repeats 3
    python scripts/bench_round_cost.py --drafters eagle3 --ks 1,2,3,4,5 --plan --temperature 0 --prompts 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ssd_eagle.assets import load_model
from ssd_eagle.config import EngineConfig, SpeculativeConfig, add_bench_model_args
from ssd_eagle.engine.factory import make_drafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.planner import planner_for
from ssd_eagle.platform import describe_line, resolve_dtype
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams

class FixedK:
    """A planner stand-in that drafts ``k`` tokens (at most the budget) in every round."""

    def __init__(self, k: int):
        self.k = k

    def plan(self, seqs, budgets, totals=None) -> list[int]:
        return [min(b, self.k) for b in budgets]

    def observe_round(self, *args, **kwargs) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


def run(model, tokenizer, drafter, k: int | str, prompts, params: SamplingParams,
        spec: SpeculativeConfig | None = None) -> list[float]:
    """Per decoding round: wall ms, main-thread CPU ms, drafting ms, verification ms, emitted tokens. ``k``: a fixed
    draft length, or ``"plan"`` (the planner of ``spec``). A request's steps up to its first round (its prefill)
    are not timed."""
    K = spec.num_speculative_tokens if k == "plan" else max(k, 1) if drafter else 0
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=1, max_model_len=4096)
    if drafter is not None:
        engine.planner = planner_for(engine, spec) if k == "plan" else FixedK(k)
    totals = [0.0] * 6  # wall, cpu, draft, verify (seconds), emitted tokens, rounds
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        start = engine.stats.num_rounds
        while engine.has_unfinished() and engine.stats.num_rounds == start:
            engine.step()
        stats = engine.stats
        before = (time.perf_counter(), time.thread_time(), stats.draft_time, stats.verify_time, stats.num_emitted,
                  stats.num_rounds)
        while engine.has_unfinished():
            engine.step()
        after = (time.perf_counter(), time.thread_time(), stats.draft_time, stats.verify_time, stats.num_emitted,
                 stats.num_rounds)
        totals = [t + b - a for t, a, b in zip(totals, before, after)]
    return [1e3 * x / totals[5] for x in totals[:4]] + [totals[4] / totals[5]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_model_args(ap)
    ap.add_argument("--drafters", default="ngram,draft_model,eagle3", help="comma-separated methods")
    ap.add_argument("--ks", default="0,1,2,5", help="comma-separated draft lengths (0: a planned-off round)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per split (MT-Bench, HumanEval)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plan", action="store_true", help="add the planner's choice (K in 0..5) per drafter")
    args = ap.parse_args()

    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    torch.set_num_threads(1)
    dtype = resolve_dtype(args.dtype, "cpu")
    print(describe_line("cpu", dtype), flush=True)
    model, tokenizer = load_model(args.model, dtype=dtype)
    prompts = [render_chat(tokenizer, p["messages"])
               for split in ("mtbench", "humaneval") for p in heldout_prompts(split)[: args.prompts]]
    ks = [int(k) for k in args.ks.split(",")]
    paths = {"draft_model": args.draft_lm, "eagle3": args.eagle3, "ngram": None}
    drafters, planned = {"ar": None}, {}
    for method in args.drafters.split(","):
        planned[method] = SpeculativeConfig(method=method, model=paths[method])  # the serving default: K in 0..5
        spec = SpeculativeConfig(method=method, model=paths[method],
                                 num_speculative_tokens=max(ks + [1, planned[method].num_speculative_tokens]))
        config = EngineConfig(model=args.model, mode="sd", speculative_config=spec, max_num_seqs=1, max_model_len=4096)
        drafters[method] = make_drafter(config, model, 4096)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1234, ignore_eos=True)
    rows: dict[tuple[str, int | str], list[list[float]]] = {}
    for _ in range(args.repeats):  # interleaved: the ratios of one pass share the machine's state
        for name, drafter in drafters.items():
            for k in [0] if drafter is None else ks + ["plan"] * args.plan:
                rows.setdefault((name, k), []).append(run(model, tokenizer, drafter, k, prompts, params,
                                                          planned.get(name)))
    med = {key: [statistics.median(col) for col in zip(*runs)] for key, runs in rows.items()}
    ar_wall, ar_cpu = med[("ar", 0)][:2]
    print(f"\nmodel={args.model} T={args.temperature} prompts/split={args.prompts} max_tokens={args.max_tokens} "
          f"repeats={args.repeats} (ms per decoding round, medians; one core)")
    print(f"{'drafter':12s} {'K':>4s} {'wall':>7s} {'xAR':>6s} {'cpu':>7s} {'xAR':>6s} {'draft':>6s} {'verify':>7s} "
          f"{'rest':>5s} {'tau':>5s} {'tok/s xAR':>9s}")
    for (name, k), (wall, cpu, draft, verify, tau) in med.items():
        print(f"{name:12s} {k:>4} {wall:7.2f} {wall / ar_wall:6.3f} {cpu:7.2f} {cpu / ar_cpu:6.3f} {draft:6.2f} "
              f"{verify:7.2f} {wall - draft - verify:5.2f} {tau:5.2f} {tau * ar_wall / wall:9.3f}")
    print("K = 0: the drafter is called with a zero budget (a round the planner turns off); plan: the planner's choice; "
          "xAR: over AR's step; tau: tokens a round emits; tok/s xAR: tau x AR's step / the round.")


if __name__ == "__main__":
    main()
