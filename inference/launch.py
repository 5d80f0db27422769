"""Run ``inference.generate`` or ``inference.serve`` with the target sharded over N ranks (tensor parallel) and,
in SSD mode, the speculator as rank N -- one command places every process.

    python -m inference.launch --tp 3 generate --prompt "Hi" --mode ar    # SmolLM2-135M: 9 heads, 3 kv heads
    python -m inference.launch --tp 4 serve --device cuda --model meta-llama/Llama-3.1-70B-Instruct \\
        --mode ssd --speculative-config '{"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct"}'

Everything after the command is that command's own flags (``--config YAML`` included for ``serve``). Started
directly, the launcher re-executes itself under ``python -m torch.distributed.run --standalone --nproc-per-node W``
with W = N + 1 when the mode is ``ssd`` (``--mode``, else the serve YAML's ``mode``, else the default serving
config) and W = N otherwise. Under an existing torchrun (custom rendezvous, pinned ports, several nodes) it runs
as is and reads the layout from the environment::

    torchrun --nproc-per-node 5 -m inference.launch --tp 4 serve --config configs/llama-3.1-70b-tp4-draftlm.yaml

Ranks 0 .. N-1 take GPUs ``LOCAL_RANK`` (``--device cuda``) and hold a 1/N shard of the target; rank N (SSD) runs
the speculator on its own GPU. Rank 0 runs the command and prints its output; the other ranks follow it and ignore
SIGINT/SIGTERM: rank 0 drains (``serve``), then releases them. SIGTERM to rank 0 alone drains for up to
``--graceful-timeout``; SIGTERM to torchrun reaches every rank and torchrun kills what is left after its own 30 s.
See :mod:`ssd_eagle.parallel`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

COMMANDS = ("generate", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True, metavar="N", help="ranks the target is sharded over")
    parser.add_argument("command", choices=COMMANDS, help="what rank 0 runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own flags")
    return parser


def wants_speculator(command_args: list[str]) -> bool:
    """Whether the command's flags select SSD (``--mode``, else a ``--config`` YAML's ``mode``, else the default
    serving config's mode)."""
    from ssd_eagle.config import default_mode
    from ssd_eagle.schema import load_yaml

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(command_args)
    mode = known.mode
    if mode is None and known.config and Path(known.config).is_file():
        mode = load_yaml(known.config).get("mode")
    return (mode or default_mode()) == "ssd"


def torchrun_argv(tp: int, argv: list[str], command_args: list[str]) -> list[str]:
    """The command line that runs this launch under torchrun on this node."""
    world = tp + (1 if wants_speculator(command_args) else 0)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "-m", "inference.launch", *argv]


@contextlib.contextmanager
def engine_builder(build):
    """Make :func:`ssd_eagle.engine.llm.build_engine` (what ``inference.generate`` and ``inference.serve`` call)
    be ``build`` inside the block."""
    import ssd_eagle.engine.llm as llm_module

    saved = llm_module.build_engine
    llm_module.build_engine = build
    try:
        yield
    finally:
        llm_module.build_engine = saved


def _exit_on_sigterm(command: str):
    """A SIGTERM handler that unwinds through ``finally`` blocks: a server stops normally on SIGTERM (status 0,
    after uvicorn's drain), anything else reports the signal (status 143)."""
    def handler(signum, frame):
        raise SystemExit(0 if command == "serve" else 128 + signum)
    return handler


def _run_command(command: str, args: list[str]) -> int:
    if command == "generate":
        from inference.generate import main as command_main
    else:
        from inference.serve import main as command_main
    return command_main(args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        print("error: --tp must be >= 1", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        command = torchrun_argv(args.tp, argv, args.args)
        os.execv(command[0], command)

    import torch.distributed as dist

    from ssd_eagle.parallel.engine import DriverSession, run_follower
    from ssd_eagle.parallel.topology import init_topology

    topo = init_topology(args.tp)
    rc = 0
    try:
        if topo.rank == 0:
            # uvicorn drains on SIGTERM, then re-raises it: exit through the finally blocks so the other ranks
            # are released instead of dying with a broken connection
            signal.signal(signal.SIGTERM, _exit_on_sigterm(args.command))
            session = DriverSession(topo)
            try:
                with engine_builder(session.build_engine):
                    rc = _run_command(args.command, args.args)
            finally:
                session.close()
        else:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # (rank 0 prints; inference.serve turns the bars off there too)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            run_follower(topo)
    finally:
        dist.destroy_process_group()
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
