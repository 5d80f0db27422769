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

from ssd_eagle.config import add_engine_args, engine_config_from_args
from ssd_eagle.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-request", dest="request_seed", type=int, default=None, help="the request's own seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, no chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_engine_args(parser)
    add_sampling_args(parser)
    args = parser.parse_args(argv)
    from ssd_eagle.engine.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.request_seed, stop=args.stop)
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
