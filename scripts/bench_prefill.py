"""Prefill behaviour of the engine on the real model (CPU, the model's dtype), each figure side by side in one run.

  ttft  time to first token of a conversation's second turn with its first turn in the prefix cache, against an
        uncached prefill of the same prompt (interleaved, ``--repeats`` times)
  gap   a running stream's longest and median time between tokens while a long prompt is admitted
  rss   resident memory after a warm-up request, after a long prompt has finished, and its peak KV store
  decode  autoregressive decode tokens/s of one request (held-out prompts; only the engine arguments every version
        has, so ``PYTHONPATH=<another checkout>`` times that checkout's engine)

    python scripts/bench_prefill.py ttft --context-tokens 1500 --repeats 3
    python scripts/bench_prefill.py gap --long-tokens 4000 --max-num-batched-tokens 128
    python scripts/bench_prefill.py rss --long-tokens 5000
    python scripts/bench_prefill.py decode --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch

from ssd_eagle.assets import DEFAULT_MODEL, load_model
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.prompts import heldout_prompts
from ssd_eagle.sampling_params import SamplingParams


def long_text(tokenizer, num_tokens: int) -> str:
    """Held-out prompts joined until the text has about ``num_tokens`` tokens."""
    parts = [p["messages"][-1]["content"] for split in ("mtbench", "humaneval") for p in heldout_prompts(split)]
    text, i = "", 0
    while len(tokenizer(text).input_ids) < num_tokens:
        text += parts[i % len(parts)] + "\n\n"
        i += 1
    return text


def first_token_seconds(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, list]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seq, start = engine.requests[rid], time.monotonic()
    while engine.has_unfinished():
        engine.step()
    return seq.first_token_time - start, seq.output_token_ids


def ttft(model, tokenizer, args) -> None:
    engine = LLMEngine(model, tokenizer, max_num_seqs=1, max_model_len=8192)
    plain = LLMEngine(model, tokenizer, max_num_seqs=1, max_model_len=8192, enable_prefix_caching=False)
    cached, uncached = [], []
    for r in range(args.repeats):
        messages = [{"role": "system", "content": f"Session {r}.\n" + long_text(tokenizer, args.context_tokens)},
                    {"role": "user", "content": "Summarize the questions above in one paragraph."}]
        _, answer = first_token_seconds(engine, f"t1-{r}", render_chat(tokenizer, messages), args.answer_tokens)
        messages += [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                     {"role": "user", "content": "Now list them as bullet points."}]
        second = render_chat(tokenizer, messages)
        seconds, out = first_token_seconds(engine, f"t2-{r}", second)
        cached.append(seconds)
        seconds, ref = first_token_seconds(plain, f"t2-{r}", second)
        uncached.append(seconds)
        assert out == ref, "the prefix cache changed the output"
    c, u = statistics.median(cached), statistics.median(uncached)
    print(f"second-turn prompt {len(second)} tokens; TTFT cached {c * 1000:.0f} ms vs uncached {u * 1000:.0f} ms "
          f"(median of {args.repeats}); ratio {c / u:.3f}")


def gap(model, tokenizer, args) -> None:
    engine = LLMEngine(model, tokenizer, max_num_seqs=2, max_model_len=8192,
                       max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    engine.add_request("stream", render_chat(tokenizer, [{"role": "user", "content": "Tell me a long story."}]),
                       SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    stream, times = engine.requests["stream"], []
    for _ in range(10):  # the stream's own pace first
        engine.step()
        times.append(time.monotonic())
    engine.add_request("long", tokenizer(long_text(tokenizer, args.long_tokens)).input_ids,
                       SamplingParams(temperature=0.0, max_tokens=1))
    while "long" in engine.requests:
        before = stream.num_output_tokens
        engine.step()
        if stream.num_output_tokens > before:
            times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times, times[1:])]
    med = statistics.median(gaps)
    print(f"max_num_batched_tokens {args.max_num_batched_tokens}, long prompt {args.long_tokens} tokens: "
          f"stream gap median {med * 1000:.0f} ms, longest {max(gaps) * 1000:.0f} ms ({max(gaps) / med:.2f}x)")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss(model, tokenizer, args) -> None:
    for prefix in (False, True):
        engine = LLMEngine(model, tokenizer, max_num_seqs=8, max_model_len=8192, enable_prefix_caching=prefix)
        first_token_seconds(engine, "warm", render_chat(tokenizer, [{"role": "user", "content": "Hi!"}]), 16)
        gc.collect()
        warm = rss_mib()
        engine.add_request("long", tokenizer(long_text(tokenizer, args.long_tokens)).input_ids,
                           SamplingParams(temperature=0.0, max_tokens=16))
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.target.kv.nbytes)
        gc.collect()
        after = rss_mib()
        used = engine.kv_cache_usage[0]
        print(f"prefix cache {'on ' if prefix else 'off'}: RSS after warm-up {warm:.0f} MiB, after a "
              f"{args.long_tokens}-token prompt {after:.0f} MiB ({after / warm:.3f}x); KV store peak "
              f"{peak / 2**20:.0f} MiB, now {used / 2**20:.0f} MiB (store + prefix cache)")
        del engine
        gc.collect()


def decode(model, tokenizer, args) -> None:
    prompts = [render_chat(tokenizer, p["messages"]) for split in ("mtbench", "humaneval")
               for p in heldout_prompts(split)[:1]]
    rates = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        tokens, seconds = 0, 0.0
        for prompt in prompts:
            engine = LLMEngine(model, tokenizer, max_num_seqs=1, max_model_len=4096)
            engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=64))
            engine.step()  # prefill (and the first round)
            start = time.perf_counter()
            while engine.has_unfinished():
                out = engine.step()
            seconds += time.perf_counter() - start
            tokens += len(out[-1].token_ids) - 1
        rates.append(tokens / seconds)
    print(f"AR decode {statistics.median(rates[1:]):.2f} tok/s (median of {args.repeats}; "
          f"{min(rates[1:]):.2f}-{max(rates[1:]):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["ttft", "gap", "rss", "decode"])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--context-tokens", type=int, default=1500, help="ttft: first turn's system prompt length")
    ap.add_argument("--answer-tokens", type=int, default=32, help="ttft: first turn's answer length")
    ap.add_argument("--long-tokens", type=int, default=5000, help="gap, rss: the long prompt's length")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    print(f"model={args.model} dtype={next(model.parameters()).dtype} threads={args.threads}")
    {"ttft": ttft, "gap": gap, "rss": rss, "decode": decode}[args.what](model, tokenizer, args)


if __name__ == "__main__":
    main()
