"""Prefill behaviour of the engine on the real model (CPU, the model's dtype), each figure side by side in one run.

  ttft  time to first token of a conversation's second turn with its first turn in the prefix cache, against an
        uncached prefill of the same prompt (interleaved, ``--repeats`` times)
  gap   a running stream's longest and median time between tokens while a long prompt is admitted (the drafts
        prefill it chunk by chunk too in SD and SSD)
  rss   resident memory (this process plus an SSD speculator process) after a warm-up request and after a long
        prompt has finished, with the prefix cache off and on, and the peak KV store
  decode  autoregressive decode tokens/s of one request (held-out prompts; only the engine arguments every version
        has, so ``PYTHONPATH=<another checkout>`` times that checkout's engine)

``--modes`` runs gap and rss in AR, SD and SSD (the committed EAGLE-3 head, ``--drafter`` to change it; SSD with
its speculator in a process of its own, as the server runs it), one after the other in one run.

    python scripts/bench_prefill.py ttft --context-tokens 1500 --repeats 3
    python scripts/bench_prefill.py gap --long-tokens 8000 --max-num-batched-tokens 128 --modes ar,sd,ssd
    python scripts/bench_prefill.py rss --long-tokens 5000 --modes ar,sd,ssd
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
from ssd_eagle.config import EngineConfig, SpeculativeConfig, default_draft_model
from ssd_eagle.engine.factory import build
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


def first_token_seconds(engine: LLMEngine, rid: str, prompt: list[int],
                        max_tokens: int = 1) -> tuple[tuple[float, float], list]:
    """Wall and CPU seconds (this process) to the first token of a new request, and its output."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seq, start, cpu = engine.requests[rid], time.monotonic(), time.process_time()
    while seq.first_token_time is None:
        engine.step()
    cpu = time.process_time() - cpu
    while engine.has_unfinished():
        engine.step()
    return (seq.first_token_time - start, cpu), seq.output_token_ids


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
    for name, col in (("wall", 0), ("cpu", 1)):
        c, u = statistics.median(x[col] for x in cached), statistics.median(x[col] for x in uncached)
        print(f"second-turn prompt {len(second)} tokens, {name} time; TTFT cached {c * 1000:.0f} ms vs uncached "
              f"{u * 1000:.0f} ms (median of {args.repeats}); ratio {c / u:.3f}; prefix cache bound "
              f"{engine.prefix_cache.max_bytes / 2**20:.0f} MiB")


def mode_engine(model, tokenizer, args, mode: str, **engine_args) -> LLMEngine:
    """An engine in ``mode`` (ar, sd, ssd) built as the server builds it, with ``engine_args``."""
    spec = None
    if mode != "ar":
        spec = SpeculativeConfig(method=args.drafter, model=default_draft_model(args.drafter), adaptive=False,
                                 num_speculative_tokens=5)
    config = EngineConfig(model=args.model, mode=mode, speculative_config=spec, max_model_len=8192,
                          draft_threads=args.threads, **engine_args)
    return build(config, model, tokenizer=tokenizer)


def modes(args) -> list[str]:
    return args.modes.split(",")


def gap(model, tokenizer, args) -> None:
    for mode in modes(args):
        engine = mode_engine(model, tokenizer, args, mode, max_num_seqs=2, enable_prefix_caching=False,
                             max_num_batched_tokens=args.max_num_batched_tokens)
        try:
            stream_gaps(engine, tokenizer, args, mode)
        finally:
            engine.close()


def stream_gaps(engine: LLMEngine, tokenizer, args, mode: str) -> None:
    engine.add_request("stream", render_chat(tokenizer, [{"role": "user", "content": "Tell me a long story."}]),
                       SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True))
    stream, clocks = engine.requests["stream"], []
    for _ in range(10):  # the stream's own pace first
        engine.step()
        clocks.append((time.monotonic(), cpu_seconds(engine)))
    engine.add_request("long", tokenizer(long_text(tokenizer, args.long_tokens)).input_ids,
                       SamplingParams(temperature=0.0, max_tokens=4))  # (its drafts start: the last chunk's prefill)
    while "long" in engine.requests:
        before = stream.num_output_tokens
        engine.step()
        if stream.num_output_tokens > before:
            clocks.append((time.monotonic(), cpu_seconds(engine)))
    for name, col in (("wall", 0), ("cpu", 1)):
        gaps = [b[col] - a[col] for a, b in zip(clocks, clocks[1:])]
        med, alone = statistics.median(gaps), statistics.median(gaps[:9])
        print(f"{mode}: max_num_batched_tokens {args.max_num_batched_tokens}, long prompt {args.long_tokens} "
              f"tokens, {name} time: stream gap median {med * 1000:.0f} ms (alone {alone * 1000:.0f} ms), longest "
              f"{max(gaps) * 1000:.0f} ms ({max(gaps) / med:.2f}x the median, {max(gaps) / alone:.2f}x alone)",
              flush=True)


def speculator_process(engine: LLMEngine):
    """The engine's SSD speculator process (a ``multiprocessing.Process``), or None."""
    process = getattr(getattr(engine.drafter, "speculator", None), "process", None)
    return process if process is not None and process.is_alive() else None


def cpu_seconds(engine: LLMEngine) -> float:
    """CPU seconds this process and its SSD speculator process have used (a loaded machine's stand-in for wall
    time: the sum over both processes is an upper bound on what one round of them costs on idle cores)."""
    process = speculator_process(engine)
    if process is None:
        return time.process_time()
    with open(f"/proc/{process.pid}/stat") as f:  # utime and stime, in clock ticks
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return time.process_time() + (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def engine_rss(engine: LLMEngine) -> float:
    """RSS of this process plus the engine's speculator process, if it has one."""
    process = speculator_process(engine)
    return rss_mib() + (rss_mib(process.pid) if process is not None else 0.0)


def rss(model, tokenizer, args) -> None:
    for mode in modes(args):
        for prefix in {"both": (False, True), "off": (False,), "on": (True,)}[args.prefix_caching]:
            engine = mode_engine(model, tokenizer, args, mode, max_num_seqs=8, enable_prefix_caching=prefix)
            try:
                request_rss(engine, tokenizer, args, f"{mode}, prefix cache {'on ' if prefix else 'off'}")
            finally:
                engine.close()
            del engine
            gc.collect()


def request_rss(engine: LLMEngine, tokenizer, args, label: str) -> None:
    first_token_seconds(engine, "warm", render_chat(tokenizer, [{"role": "user", "content": "Hi!"}]), 16)
    gc.collect()
    time.sleep(0.5)  # (an SSD speculator finishes its last build)
    warm = engine_rss(engine)
    engine.add_request("long", tokenizer(long_text(tokenizer, args.long_tokens)).input_ids,
                       SamplingParams(temperature=0.0, max_tokens=16))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.target.kv.nbytes)
    gc.collect()
    time.sleep(0.5)
    after = engine_rss(engine)
    used = engine.kv_cache_usage[0]
    print(f"{label}: RSS after warm-up {warm:.0f} MiB, after a {args.long_tokens}-token prompt {after:.0f} MiB "
          f"({after / warm:.3f}x); target KV store peak {peak / 2**20:.0f} MiB, now {used / 2**20:.0f} MiB "
          f"(store + prefix cache)", flush=True)


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
    ap.add_argument("--prefix-caching", default="both", choices=["both", "off", "on"], help="rss: with and/or "
                    "without the prefix cache")
    ap.add_argument("--modes", default="ar", help="gap, rss: comma-separated engine modes (ar, sd, ssd)")
    ap.add_argument("--drafter", default="eagle3", choices=["eagle3", "draft_model"],
                    help="gap, rss: the committed draft SD and SSD use")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    print(f"model={args.model} dtype={next(model.parameters()).dtype} threads={args.threads}")
    {"ttft": ttft, "gap": gap, "rss": rss, "decode": decode}[args.what](model, tokenizer, args)


if __name__ == "__main__":
    main()
