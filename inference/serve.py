"""Serve a model over an OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/ready``, ``/metrics``) with speculative decoding.

    python -m inference.serve                                   # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m inference.serve --config configs/serve.yaml       # flags from YAML; command-line flags win
    python -m inference.serve --mode ar --port 8001 --api-key "$KEY" --served-model-name smol

Engine flags are those of ``inference.generate``. Logs are JSON lines on stderr; start-up logs each stage with its
seconds (``startup_stage``: target load, draft load, speculator start, engine set-up, the planner's cost model;
:mod:`ssd_eagle.engine.factory`) and ``serving`` carries the total (``startup_s``). The port is bound before the
model loads (a port in use fails at once, exit code 2). SIGTERM (or Ctrl-C) drains: the socket stays open, new
requests get 503 with ``Retry-After``, ``/health`` says ``draining`` and ``/ready`` 503, in-flight requests finish
(up to ``--graceful-timeout`` s), then the engine and its speculator are closed and the process exits 0; when the
timeout runs out, the remaining requests end with an error and the exit code is 1. A second signal exits at once.
A signal while the model loads stops the load, closes what was built (an SSD speculator process is terminated)
and exits 0; one after the load, before the server listens, drains an empty server.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import asyncio
import logging
import os
import socket
import sys
import time
from typing import Literal

from pydantic import Field

from inference.startup import Interrupted, StartupSignals
from ssd_eagle.config import ENGINE_FLAGS, add_engine_args, engine_config_from_args
from ssd_eagle.platform import describe
from ssd_eagle.schema import ConfigModel, add_flags, flags_for, parse_flags

log = logging.getLogger("inference.serve")

API_KEY_ENV = "SSD_EAGLE_API_KEY"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC ISO 8601), ``level``, ``logger``, ``message``, the record's
    ``extra={"fields": {...}}`` entries, and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                 .isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str = "info") -> None:
    """Send every logger (ours, uvicorn's, transformers', warnings) to stderr as JSON lines; no progress bars."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.captureWarnings(True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


class ServerConfig(ConfigModel):
    """The HTTP server's settings (flags of the ``server`` group)."""

    host: str = Field("127.0.0.1", description="bind address (loopback only by default)")
    port: int = Field(8000, ge=1, le=65535)
    served_model_name: list[str] | None = Field(
        None, description="name(s) clients pass as 'model'; the first is reported (None: the --model value)")
    api_key: str | None = Field(None, description=f"require 'Authorization: Bearer <key>' on /v1/* (default: "
                                f"${API_KEY_ENV}, else none)")
    max_queue: int = Field(32, ge=1, description="most requests waiting for a batch slot; more get 503")
    max_request_bytes: int = Field(8 << 20, ge=1, description="largest request body (413 beyond)")
    graceful_timeout: float = Field(120.0, ge=0.0, description="seconds in-flight requests get to finish after "
                                    "SIGTERM")
    log_level: Literal["debug", "info", "warning", "error"] = "info"


SERVER_FLAGS = flags_for(ServerConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inference.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="YAML mapping of flag names (dashes or underscores) to values; command-line flags "
                             "win (e.g. configs/serve.yaml)")
    add_engine_args(parser)
    add_flags(parser.add_argument_group("server"), SERVER_FLAGS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags, with ``--config`` YAML values over the defaults and command-line flags over both. Exits with a
    message naming a bad key or flag."""
    return parse_flags(build_parser(), (*ENGINE_FLAGS, *SERVER_FLAGS), argv,
                       defaults={"api_key": os.environ.get(API_KEY_ENV)})


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening (uvicorn serves on it; connections made while the model
    loads wait in the backlog). Raises OSError (e.g. the port is in use). It listens at once because with
    SO_REUSEADDR two sockets that are bound but not listening may share a port on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT leftovers do not block
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def _draining_server(config, async_engine, graceful_timeout: float):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a drain before its shutdown: from the first SIGTERM/SIGINT new requests get 503 while
        in-flight ones have ``graceful_timeout`` s (the socket stays open); then uvicorn closes the socket and the
        app's lifespan stops the engine loop. A second signal exits at once. ``drained``: all requests finished."""

        def __init__(self):
            super().__init__(config)
            self.signalled, self.drained, self._drain = False, False, None

        def handle_exit(self, sig, frame) -> None:  # not uvicorn's: it re-raises the signal (exit code 143)
            if self.signalled:
                self.should_exit = self.force_exit = True
                return
            self.signalled = True
            async_engine.begin_shutdown()
            log.info("shutdown signal received; draining", extra={"fields": {
                "event": "draining", "signal": sig, "in_flight": async_engine.num_in_flight,
                "graceful_timeout_s": graceful_timeout}})

        async def on_tick(self, counter: int) -> bool:
            if self.signalled and self._drain is None:
                self._drain = asyncio.ensure_future(self._drain_then_exit())
            return await super().on_tick(counter)

        async def _drain_then_exit(self) -> None:
            self.drained = await async_engine.drain(graceful_timeout)
            self.should_exit = True

    return DrainingServer()


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    configure_logging(args.log_level)
    startup, engine, sock = StartupSignals(log), None, None  # (from here a signal ends the startup cleanly)
    try:
        with startup:
            import uvicorn

            from ssd_eagle.engine.llm import build_engine

            from inference.api_server import build_app

            try:
                sock = bind_socket(args.host, args.port)
            except OSError as err:
                log.error(f"cannot listen on {args.host}:{args.port}: {err.strerror}", extra={"fields": {
                    "event": "bind_failed", "host": args.host, "port": args.port, "error": str(err)}})
                return 2
            config = engine_config_from_args(args)
            log.info("building the engine", extra={"fields": {"event": "startup", "model": config.model,
                                                              "mode": config.mode}})
            engine = build_engine(config)
    except (ValueError, FileNotFoundError) as err:
        sock.close()
        log.error("could not build the engine", extra={"fields": {"event": "startup_failed", "error": str(err)}})
        return 2
    except Interrupted as err:  # (the signal may land after build_engine returned)
        if engine is not None:
            engine.close()
        if sock is not None:
            sock.close()
        log.info("exited", extra={"fields": {"event": "exited", "clean": True, "during": "startup",
                                             "signal": str(err)}})
        startup.unwound.set()
        return 0
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("serving on a non-loopback address without --api-key: anyone who can reach it can use it",
                    extra={"fields": {"event": "no_api_key", "host": args.host}})
    app = build_app(engine, args.served_model_name or [args.model], api_key=args.api_key,
                    max_queue=args.max_queue, max_request_bytes=args.max_request_bytes)
    # the drain is ours: uvicorn's grace period only lets the finished responses flush
    server = _draining_server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                             timeout_graceful_shutdown=5), app.state.server.async_engine,
                              args.graceful_timeout)
    spec = config.speculative_config if engine.drafter is not None else None
    log.info("serving", extra={"fields": {"event": "serving", "host": args.host, "port": args.port,
                                          "model": args.model, "mode": engine.mode_name,
                                          "speculative_config": spec.to_dict() if spec is not None else None,
                                          "planner": engine.planner is not None,
                                          "max_model_len": engine.max_model_len, "max_num_seqs": engine.max_num_seqs,
                                          "auth": bool(args.api_key),
                                          "startup_s": round(time.perf_counter() - started, 3),
                                          **describe(engine.target.device, engine.target.weight_dtype)}})
    if startup.pending is not None:  # a signal since the load: start, drain (nothing is in flight) and exit
        server.handle_exit(startup.pending, None)
    try:
        server.run(sockets=[sock])
    finally:  # the engine thread has stopped: releasing the drafter (e.g. SSD's speculator process) is safe now
        engine.close()
        sock.close()
    clean = server.started and (server.drained or not server.signalled) and not server.force_exit
    log.info("exited", extra={"fields": {"event": "exited", "clean": clean}})
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
