"""Command line of ``scripts/regenerate_data.py``: regenerate into a work folder, or pack it into ``data/``.

Regenerate (resumable: run the same command again to continue; ``--time-limit``, ``--target-tokens`` or creating
``WORK/stop`` drains the run: requests in flight and started conversations finish, then it exits). The run behind
``data/smollm2-135m`` (one core, lowest priority, one torch thread)::

    taskset -c 1 nice -n 19 python scripts/regenerate_data.py --work-dir ~/.cache/ssd_eagle/regen/smollm2-135m-v2 \\
        --source builtin --source grounded --num-grounded 8000 --num-magpie 12000 --magpie-share 0.5 \\
        --dtype bfloat16 --batch-size 96 --num-threads 1 --max-model-len 2048 --max-new-tokens 512 \\
        --greedy-fraction 0.5 --multi-turn-fraction 0.3 --target-tokens 3500000

Pack what the work folders hold so far, with the rows of an earlier pack (deduplicated, filtered, held-out guard;
see :mod:`train.regen.pack`)::

    python scripts/regenerate_data.py --work-dir ~/.cache/ssd_eagle/regen/smollm2-135m-v2 \\
        --pack data/smollm2-135m --merge ~/.cache/ssd_eagle/regen/format1-regenerated.jsonl.gz

(``format1-regenerated.jsonl.gz``: the float32 set committed before, ``git show
8706665:data/smollm2-135m/regenerated.jsonl.gz``.)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from train.regen.scheduler import RegenConfig

REPO = Path(__file__).resolve().parents[2]
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/regenerate_data.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--work-dir", action="append", required=True,
                   help="work folder (outside the work tree); with --pack, repeatable")
    p.add_argument("--source", action="append", default=None,
                   help="'builtin', 'grounded' or a JSON/JSONL file or folder ([NAME=]PATH); repeatable")
    p.add_argument("--num-grounded", type=int, default=8000, help="conversations about local text (--source grounded)")
    p.add_argument("--field", default=None, help="JSON files whose rows sit under this top-level key")
    p.add_argument("--model", default=None, help="target (default: the project's default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float64", "float16"])
    p.add_argument("--batch-size", type=int, default=32, help="requests decoded together (engine max_num_seqs)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + turn (trainer max length)")
    p.add_argument("--prefix-cache-memory", type=float, default=0.5,
                   help="GiB of cached prompt prefixes: a follow-up and the turn after it reuse the history's keys "
                        "and values instead of prefilling it again")
    p.add_argument("--no-progress", action="store_true")
    for name, f in RegenConfig.model_fields.items():  # the flags of the config's fields (validated by it)
        if name == "stop_file":
            continue
        flag = "--time-limit" if name == "time_limit_min" else "--" + name.replace("_", "-")
        kind = int if int in (f.annotation, *getattr(f.annotation, "__args__", ())) else float
        p.add_argument(flag, dest=name, type=kind, default=f.default,
                       help=f"{f.description + '; ' if f.description else ''}default {f.default}")
    p.add_argument("--pack", default=None, metavar="OUT_DIR", help="pack the work folders into OUT_DIR and exit")
    p.add_argument("--merge", action="append", default=[], help="with --pack: rows of an earlier pack to include")
    p.add_argument("--exclude", action="append", default=[], metavar="ROWS",
                   help="rows of an earlier pack (.jsonl.gz or .jsonl) not to regenerate again: their ids and first "
                        "user turns are skipped (a new work folder next to a committed pack; pair with another --seed)")
    args = p.parse_args(argv)
    args.source = args.source or ["builtin", "grounded"]
    if args.pack is None and len(args.work_dir) != 1:
        p.error("regeneration takes one --work-dir")
    if args.model is None:
        from ssd_eagle.assets import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    return args


def regen_config(args: argparse.Namespace, work_dir: Path) -> RegenConfig:
    values = {name: getattr(args, name) for name in RegenConfig.model_fields if name != "stop_file"}
    return RegenConfig(**values, stop_file=work_dir / "stop")


def engine_config(args: argparse.Namespace, seed: int):
    """The target's engine settings (AR) of a regeneration run."""
    from ssd_eagle.config import EngineConfig

    return EngineConfig(model=args.model, mode="ar", dtype=args.dtype, max_num_seqs=args.batch_size,
                        num_threads=args.num_threads, max_model_len=args.max_model_len, seed=seed,
                        prefix_cache_memory=args.prefix_cache_memory)


def listed_conversations(args: argparse.Namespace, seed: int) -> list:
    from train.regen import grounded, sources

    convs = []
    for src in args.source:
        if src == "builtin":
            convs += sources.builtin_conversations()
        elif src == "grounded":
            convs += grounded.grounded_conversations(args.num_grounded, seed, excluded=[REPO / "data"])
        else:
            convs += sources.file_conversations(src, args.field)
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        raise SystemExit("duplicate conversation ids across --source")
    # interleave the sources (a partial run holds some of each): a fixed shuffle
    random.Random(f"order:{seed}").shuffle(convs)
    return convs


def regenerate(args: argparse.Namespace) -> int:
    from ssd_eagle.engine.llm import LLM
    from train.regen.pack import read_rows_file
    from train.regen.scheduler import Regenerator
    from train.regen.store import RunLog, WorkDir

    work = WorkDir(args.work_dir[0])
    cfg = regen_config(args, work.root)
    if cfg.stop_file.exists():
        raise SystemExit(f"{cfg.stop_file} exists (it asks a run to stop); delete it to run")
    work.check_settings({**cfg.content_settings(), "model": args.model, "dtype": args.dtype,
                         "max_model_len": args.max_model_len, "source": args.source,
                         "num_grounded": args.num_grounded})
    runlog = RunLog(work, {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, REPO)
    status = "failed"
    if args.no_progress:  # nor transformers' "Loading weights" bar
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    try:
        llm = LLM(config=engine_config(args, cfg.seed))
        regen = Regenerator(llm.engine, work, cfg, runlog, progress=not args.no_progress)
        for path in args.exclude:
            regen.exclude(read_rows_file(Path(path).expanduser()))
        regen.add(listed_conversations(args, cfg.seed))
        regen.run()
        status = "stopped (drained; rerun to continue)" if regen.draining else "complete"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        runlog.update(force=True, status=status)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pack is not None:
        from train.regen.pack import pack

        try:
            manifest = pack(args.work_dir, args.pack, merge=args.merge, model=args.model,
                            max_length_share=0.25, repo=REPO)
        except ValueError as e:  # nothing to pack: a one-line error, not a traceback
            print(f"regenerate_data.py --pack: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({k: manifest[k] for k in ("num_conversations", "assistant_tokens", "length_share",
                                                   "greedy_share", "per_source")}, indent=1))
        return 0
    return regenerate(args)


if __name__ == "__main__":
    sys.exit(main())
