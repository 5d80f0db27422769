"""Generate for one prompt from the command line and print the text and the decoding statistics.

    python -m inference.generate --prompt "Write a haiku about the sea." --max-tokens 64 --temperature 0
    python -m inference.generate --mode ar --prompt "..."            # autoregressive baseline
    python -m inference.generate --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' ...

The prompt is rendered with the model's chat template unless ``--no-chat`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ssd_eagle.config import ENGINE_FLAGS, add_engine_args, engine_config_from_args
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.schema import Flag, add_flags, parse_flags

SAMPLING_FLAGS = (
    Flag(SamplingParams, "max_tokens", default=128),
    Flag(SamplingParams, "temperature", default=0.0),
    Flag(SamplingParams, "top_p"),
    Flag(SamplingParams, "top_k"),
    Flag(SamplingParams, "seed", dest="request_seed", names=("--seed-request",)),
    Flag(SamplingParams, "stop", help="stop string (repeatable)"),
)


def add_sampling_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_flags(parser.add_argument_group("sampling"), SAMPLING_FLAGS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, no chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_engine_args(parser)
    add_sampling_args(parser)
    args = parse_flags(parser, (*ENGINE_FLAGS, *SAMPLING_FLAGS), argv)
    from ssd_eagle.engine.llm import LLM

    try:
        params = SamplingParams(**{f.field: getattr(args, f.dest) for f in SAMPLING_FLAGS})
        llm = LLM(config=engine_config_from_args(args))
        start = time.perf_counter()
        if args.no_chat:
            out = llm.generate(args.prompt, params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    stats = {**out.stats.summary(), "tokens_per_s": round(len(out.token_ids) / elapsed, 2),
             "finish_reason": out.finish_reason, "mode": llm.engine.mode_name}
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": stats}))
    else:
        print(out.text)
        print("--- " + " ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
