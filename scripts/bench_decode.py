"""Decoding speed, side by side in one process: our loops against transformers' ``generate``.

Pairs (same model object, same thread count, same prompts, same token count, greedy):
  1. our autoregressive loop            vs  transformers ``generate``
  2. our n-gram speculative decoding    vs  transformers' prompt-lookup decoding (``prompt_lookup_num_tokens``)

Prompts: held-out MT-Bench questions and held-out HumanEval problems (``ssd_eagle.prompts``), rendered with the
chat template. Generation stops at EOS or ``--max-tokens``, identically for all (they are all greedy and
lossless, so they emit the same tokens). Each configuration decodes every prompt ``--repeats`` times, interleaved by repeat so drifting
machine load hits all configurations alike; tokens/s is the total over prompts, the spread is over repeats.

    python scripts/bench_decode.py --prompts 4 --max-tokens 128 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams


def ours(model, tokenizer, prompt, max_tokens, drafter, k, compiled=None):
    engine = LLMEngine(model, tokenizer, drafter, num_speculative_tokens=k, max_num_seqs=1,
                       max_model_len=4096)
    if compiled is not None:  # share one compiled body across engines (compile once per shape)
        engine.target.body = compiled
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
    elapsed = time.perf_counter() - start
    return outs[-1].token_ids, elapsed, outs[-1].stats.tau


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
    ap.add_argument("--prompts", type=int, default=4, help="prompts per split (MT-Bench, HumanEval)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round (both n-gram implementations)")
    ap.add_argument("--compile", action="store_true",
                    help="also time our loops with torch.compile (compilation excluded: it happens in the warm-up)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    prompts = [render_chat(tokenizer, p["messages"])
               for split in ("mtbench", "humaneval") for p in heldout_prompts(split)[: args.prompts]]
    compiled = None
    if args.compile:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64
        compiled = torch.compile(model.get_decoder(), dynamic=True)
    configs = {
        "ours AR": lambda p: ours(model, tokenizer, p, args.max_tokens, None, 0),
        "transformers generate": lambda p: transformers_generate(model, p, args.max_tokens, 0),
        "ours n-gram SD": lambda p: ours(model, tokenizer, p, args.max_tokens, NgramDrafter(2, 4), args.k),
        "transformers prompt lookup": lambda p: transformers_generate(model, p, args.max_tokens, args.k),
    }
    if compiled is not None:
        configs["ours AR (torch.compile)"] = lambda p: ours(model, tokenizer, p, args.max_tokens, None, 0, compiled)
        configs["ours n-gram SD (torch.compile)"] = lambda p: ours(model, tokenizer, p, args.max_tokens,
                                                                   NgramDrafter(2, 4), args.k, compiled)
    for p in prompts[:1]:  # warm-up
        for run in configs.values():
            run(p)
    rates = {name: [] for name in configs}
    taus = {name: [] for name in configs}
    mismatches = 0
    for _ in range(args.repeats):
        for name, run in configs.items():
            tokens, seconds = 0, 0.0
            outputs = []
            for p in prompts:
                out, elapsed, tau = run(p)
                tokens += len(out)
                seconds += elapsed
                outputs.append(out)
                if tau is not None:
                    taus[name].append(tau)
            rates[name].append(tokens / seconds)
            if name == "ours AR":
                reference = outputs
            else:
                mismatches += sum(o != r for o, r in zip(outputs, reference))
    print(f"model={args.model} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"threads={args.threads} K={args.k}")
    print(f"{'configuration':28s} {'tokens/s':>9s} {'spread':>15s} {'tau':>6s}")
    for name, r in rates.items():
        tau = f"{statistics.mean(taus[name]):.2f}" if taus[name] else "-"
        print(f"{name:28s} {statistics.median(r):9.2f} {min(r):7.2f}-{max(r):<7.2f} {tau:>6s}")
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"ratio ours AR / transformers generate:          {med['ours AR'] / med['transformers generate']:.3f}")
    print(f"ratio ours n-gram SD / transformers prompt lookup: "
          f"{med['ours n-gram SD'] / med['transformers prompt lookup']:.3f}")
    print(f"ratio ours n-gram SD / ours AR:                  {med['ours n-gram SD'] / med['ours AR']:.3f}")
    if compiled is not None:
        print(f"ratio ours AR (torch.compile) / transformers generate: "
              f"{med['ours AR (torch.compile)'] / med['transformers generate']:.3f}")
        print(f"ratio ours n-gram SD (torch.compile) / transformers prompt lookup: "
              f"{med['ours n-gram SD (torch.compile)'] / med['transformers prompt lookup']:.3f}")
    print(f"outputs differing from ours AR (greedy; float32 near-ties can differ): {mismatches}")


if __name__ == "__main__":
    main()
