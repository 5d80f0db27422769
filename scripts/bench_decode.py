"""Decoding speed, side by side in one process: our loops against transformers' ``generate``.

Pairs (same model object, same thread count, same prompts, same token count, greedy):
  1. our autoregressive loop            vs  transformers ``generate``
  2. our n-gram speculative decoding    vs  transformers' prompt-lookup decoding (``prompt_lookup_num_tokens``)
and the planner's choice (:mod:`ssd_eagle.planner`: K in 0..K per round from measured costs) for our n-gram
drafter, with its median ratio to our AR over the repeats (issue 13's goal: >= 0.97).

Prompts: held-out MT-Bench questions and held-out HumanEval problems (``ssd_eagle.prompts``), rendered with the
chat template. Generation stops at EOS or ``--max-tokens``, identically for all (they are all greedy and
lossless, so in float32 they emit the same tokens). Each configuration decodes every prompt ``--repeats`` times,
interleaved by repeat so drifting machine load hits all configurations alike; tokens/s is the total over prompts,
the spread is over repeats. Each SD row shows its measured verify time V and draft time D per round and the bound
``(V + D) / V`` on what overlapping the two (SSD) could gain over it. Outputs are judged against our AR decode by
the near-tie rule (:mod:`ssd_eagle.exactness`): in bfloat16 a divergence is allowed only where AR's top-2 logits
are a near tie. The header names the CPU, its bf16 flags and the dtype (``--dtype auto``: bfloat16 where matmuls
run bf16 natively, see :mod:`ssd_eagle.platform`).

    python scripts/bench_decode.py --prompts 4 --max-tokens 128 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.exactness import TopTwoRecorder, judge
from ssd_eagle.planner import Planner, PlannerConfig, measure_verify_costs
from ssd_eagle.platform import DTYPE_HELP, DTYPES, describe_line, resolve_dtype
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams


def ours(model, tokenizer, prompt, max_tokens, drafter, k, compiled=None, top2=None, plan=False):
    """One greedy decode by our engine: (tokens, seconds, stats); ``top2`` (a list) receives AR's top-2 logits;
    ``plan``: the planner chooses K in 0..k from the measured verify costs (cached on disk) and the acceptance."""
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=k, max_num_seqs=1,
                       max_model_len=4096)
    if plan:
        engine.planner = Planner(PlannerConfig(max_k=k), measure_verify_costs(engine.target, k + 1, 1))
    if compiled is not None:  # share one compiled body across engines (compile once per shape)
        engine.target.body = compiled
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    recorder = TopTwoRecorder(model) if top2 is not None else None
    start = time.perf_counter()
    with recorder or nullcontext():
        while engine.has_unfinished():
            outs = engine.step()
    elapsed = time.perf_counter() - start
    if recorder is not None:
        top2.append(recorder.rows)
    return outs[-1].token_ids, elapsed, outs[-1].stats


def transformers_generate(model, prompt, max_tokens, lookup):
    ids = torch.tensor([prompt])
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist(), time.perf_counter() - start, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per split (MT-Bench, HumanEval)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round (both n-gram implementations)")
    ap.add_argument("--compile", action="store_true",
                    help="also time our loops with torch.compile (compilation excluded: it happens in the warm-up)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    print(describe_line("cpu", dtype), flush=True)  # the header, once: before the long warm-up
    model, tokenizer = load_model(args.model, dtype=dtype)
    prompts = [render_chat(tokenizer, p["messages"])
               for split in ("mtbench", "humaneval") for p in heldout_prompts(split)[: args.prompts]]
    compiled = None
    if args.compile:
        from torch._dynamo import config as dynamo_config  # (a bare `import torch._dynamo` would make torch local)

        dynamo_config.cache_size_limit = 64
        compiled = torch.compile(model.get_decoder(), dynamic=True)
    top2 = []  # AR's top-2 logits per prompt, recorded in the first measured repeat
    configs = {
        "ours AR": lambda p, rec=None: ours(model, tokenizer, p, args.max_tokens, None, 0, top2=rec),
        "transformers generate": lambda p, rec=None: transformers_generate(model, p, args.max_tokens, 0),
        "ours n-gram SD": lambda p, rec=None: ours(model, tokenizer, p, args.max_tokens, NgramDrafter(2, 4), args.k),
        "transformers prompt lookup": lambda p, rec=None: transformers_generate(model, p, args.max_tokens, args.k),
        "ours n-gram SD (planned)": lambda p, rec=None: ours(model, tokenizer, p, args.max_tokens, NgramDrafter(2, 4),
                                                             args.k, plan=True),
    }
    if compiled is not None:
        configs["ours AR (torch.compile)"] = lambda p, rec=None: ours(model, tokenizer, p, args.max_tokens, None, 0,
                                                                      compiled)
        configs["ours n-gram SD (torch.compile)"] = lambda p, rec=None: ours(model, tokenizer, p, args.max_tokens,
                                                                             NgramDrafter(2, 4), args.k, compiled)
    for p in prompts[:1]:  # warm-up
        for run in configs.values():
            run(p)
    rates = {name: [] for name in configs}
    stats = {name: [] for name in configs}
    outputs = {}
    for repeat in range(args.repeats):
        for name, run in configs.items():
            tokens, seconds, outs = 0, 0.0, []
            for p in prompts:
                out, elapsed, s = run(p, top2 if repeat == 0 and name == "ours AR" else None)
                tokens += len(out)
                seconds += elapsed
                outs.append(out)
                if s is not None:
                    stats[name].append(s)
            rates[name].append(tokens / seconds)
            outputs.setdefault(name, outs)
    report(args, rates, stats, outputs, top2)


def report(args, rates, stats, outputs, top2) -> None:
    print(f"model={args.model} prompts={len(outputs['ours AR'])} max_tokens={args.max_tokens} "
          f"repeats={args.repeats} threads={args.threads} K={args.k}")
    print(f"{'configuration':32s} {'tokens/s':>9s} {'spread':>15s} {'xAR':>5s} {'tau':>5s} {'V ms':>6s} "
          f"{'D ms':>6s} {'bound':>5s} {'div':>5s}")
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name, r in rates.items():
        s = stats[name]
        rounds = sum(x.num_rounds for x in s)
        V = sum(x.verify_time for x in s) / rounds if rounds else None
        D = sum(x.draft_time for x in s) / rounds if rounds else None
        tau = statistics.mean(x.tau for x in s) if s and "SD" in name else None
        bound = (V + D) / V if V and "SD" in name else None
        divs = [d for d in (judge(ref, rows, out) for ref, rows, out in zip(outputs["ours AR"], top2, outputs[name]))
                if d is not None]
        div = f"{len(divs)}/{len(top2)}" + ("" if all(d.allowed for d in divs) else "!")
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{name:32s} {med[name]:9.2f} {min(r):7.2f}-{max(r):<7.2f} {med[name] / med['ours AR']:5.2f} "
              f"{fmt(tau, '5.2f'):>5s} {fmt(V and V * 1e3, '6.1f'):>6s} {fmt(D and D * 1e3, '6.1f'):>6s} "
              f"{fmt(bound, '5.2f'):>5s} {div:>5s}")
        if divs:
            print("    first-divergence AR top-2 gaps (gap vs bound): "
                  + ", ".join(f"{d.gap:.4g}{'<=' if d.allowed else '>'}{d.bound:.4g}" for d in divs))
    print(f"ratio ours AR / transformers generate:             {med['ours AR'] / med['transformers generate']:.3f}")
    print(f"ratio ours n-gram SD / transformers prompt lookup: "
          f"{med['ours n-gram SD'] / med['transformers prompt lookup']:.3f}")
    planned = statistics.median(p / a for p, a in zip(rates["ours n-gram SD (planned)"], rates["ours AR"]))
    print(f"ratio ours n-gram SD (planned) / ours AR, median over {args.repeats} repeats: {planned:.3f} "
          f"(goal >= 0.97{'' if planned >= 0.97 else ', MISSED'})")
    print("bound: (V + D) / V, what overlapping drafting with verification (SSD) could gain over that SD.\n"
          "div: prompts whose output differs from ours AR; '!' marks a first divergence that is not a near tie "
          "(AR top-2 gap > 2^-6 max(|top1|, 1)).")


if __name__ == "__main__":
    main()
