#!/usr/bin/env python
"""Throughput of the regeneration workload (``scripts/regenerate_data.py``) on the real target, in a scratch work
folder: the same sources, settings and continuous batching as the background run, for a fixed wall time.

Time is this process's CPU time (``time.process_time``, one torch thread), so a run on a shared core measures the
same work as on a quiet one. Prints generated tokens/s (every token the engine emitted: assistant turns, Magpie candidates, follow-ups) and
kept tokens/s (tokens of assistant turns that passed the held-out and repetition checks), each over the whole run
and over the window after ``--warmup`` seconds (the batch fills during the warm-up: all prompts arrive at once),
with the engine's time split (prefill, decode rounds, store resizes). A short run finishes short turns first, so
its kept share is biased up; compare configurations only side by side, on the same settings.

    taskset -c 0 nice -n 5 python scripts/bench_regen.py --seconds 150 --warmup 60
    (cd <another checkout> && python <this checkout>/scripts/bench_regen.py ...) times that checkout's code
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import tempfile
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=150.0, help="CPU seconds of the run (then it stops, undrained)")
    p.add_argument("--warmup", type=float, default=60.0, help="CPU seconds before the measured window")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-grounded", type=int, default=8000)
    p.add_argument("--engine", default="{}", help="JSON of extra EngineConfig fields (e.g. max_num_batched_tokens)")
    p.add_argument("--regen", default="{}", help="JSON of extra RegenConfig fields")
    p.add_argument("--profile", default=None, help="write a cProfile of the run here")
    return p.parse_args(argv)


def cpu_name() -> str:
    """The CPU's model name and whether it runs bf16 natively (``avx512_bf16`` / ``amx_bf16``; Linux only)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    bf16 = any(flag in info for flag in ("avx512_bf16", "amx_bf16"))
    return f"{name}{' (native bf16)' if bf16 else ''}"


def main(argv: list[str] | None = None) -> None:
    from ssd_eagle.config import EngineConfig
    from ssd_eagle.engine.llm import LLM
    from train.regen import cli
    from train.regen.scheduler import RegenConfig, Regenerator
    from train.regen.store import WorkDir

    args = parse_args(argv)
    regen_args = cli.parse_args(["--work-dir", "unused", "--source", "builtin", "--source", "grounded",
                                 "--num-grounded", str(args.num_grounded), "--num-magpie", "12000",
                                 "--magpie-share", "0.5", "--max-new-tokens", "512", "--greedy-fraction", "0.5",
                                 "--multi-turn-fraction", "0.3"])
    cfg_fields = {name: getattr(regen_args, name) for name in RegenConfig.model_fields if name != "stop_file"}
    cfg = RegenConfig(**{**cfg_fields, **json.loads(args.regen)})
    for name in ("dtype", "batch_size", "num_threads", "max_model_len"):
        setattr(regen_args, name, getattr(args, name))
    if hasattr(cli, "engine_config"):  # the engine settings of the regeneration command of this checkout
        config = cli.engine_config(regen_args, cfg.seed)
    else:
        config = EngineConfig(model=regen_args.model, mode="ar", dtype=args.dtype, max_num_seqs=args.batch_size,
                              num_threads=args.num_threads, max_model_len=args.max_model_len, seed=cfg.seed)
    config = config.model_copy(update=json.loads(args.engine))
    llm = LLM(config=config)
    engine = llm.engine
    convs = cli.listed_conversations(regen_args, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="bench-regen-") as tmp:
        regen = Regenerator(engine, WorkDir(tmp), cfg, progress=False)
        regen.add(convs)
        generated = collections.Counter()
        step, timers = engine.step, collections.Counter()

        def counted_step():
            t = time.process_time()
            outs = step()
            timers["step"] += time.process_time() - t
            generated["all"] += sum(len(o.delta_token_ids) for o in outs)
            return outs

        engine.step = counted_step
        turn_done = regen._turn_done

        def counted_turn_done(job, out, token_ids):  # a turn is kept when it joins its conversation
            before = len(job.num_tokens)
            turn_done(job, out, token_ids)
            if len(job.num_tokens) > before:
                generated["kept"] += len(token_ids)

        regen._turn_done = counted_turn_done
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile(time.process_time)
            profiler.enable()
        start, wall = time.process_time(), time.perf_counter()
        mark = None
        steps = 0
        while time.process_time() - start < args.seconds:
            if mark is None and time.process_time() - start >= args.warmup:
                mark = (time.process_time(), generated["all"], generated["kept"], steps)
            regen.step()
            steps += 1
        end, wall = time.process_time(), time.perf_counter() - wall
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    total = end - start
    row = {"cpu": cpu_name(), "dtype": args.dtype, "threads": torch.get_num_threads(),
           "batch": args.batch_size, "cpu_s": round(total, 1), "wall_s": round(wall, 1), "steps": steps,
           "engine_share": round(timers["step"] / total, 3),
           "generated_tok_s": round(generated["all"] / total, 1),
           "kept_tok_s": round(generated["kept"] / total, 1)}
    if mark is not None:
        window = end - mark[0]
        row.update(window_cpu_s=round(window, 1), window_steps=steps - mark[3],
                   window_generated_tok_s=round((generated["all"] - mark[1]) / window, 1),
                   window_kept_tok_s=round((generated["kept"] - mark[2]) / window, 1))
    row["counts"] = {k: v for k, v in sorted(regen.counts.items()) if v}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
