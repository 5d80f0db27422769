"""The OpenAI-compatible HTTP API (FastAPI), built around an already constructed engine.

Endpoints follow OpenAI's API (and vLLM's server where OpenAI is silent):

- ``GET /v1/models``, ``GET /v1/models/{id}``
- ``POST /v1/completions``, ``POST /v1/chat/completions``: ``stream`` sends server-sent events (``data: {chunk}``
  lines in OpenAI's chunk format, then ``data: [DONE]``); responses and final chunks carry ``spec_stats``.
- ``GET /health`` (liveness): 200 ``{"status": "ok"}``, 200 ``{"status": "degraded", "reason"}`` while the drafter
  reports unhealthy (decoding goes on without speculation) or right after a failed engine step, 200
  ``{"status": "draining"}`` after a shutdown signal while in-flight requests finish, 503 ``{"status": "stopped"}``
  once the engine loop stopped; ``ok`` and ``degraded`` also name the target's device and dtype and the CPU's
  capability (:func:`ssd_eagle.platform.describe`).
- ``GET /ready`` (readiness): 200 ``{"status": "ready"}`` while the model is loaded and new requests are taken,
  else 503 ``{"status": "starting" | "draining" | "stopped"}``.
- ``GET /metrics``: Prometheus text (see :mod:`inference.metrics`).

Errors always have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests
(bad JSON or UTF-8, wrong types, unsupported parameters, too long prompts), 401 for a missing/wrong API key on
``/v1/*``, 404 for an unknown model, 413 for an oversized body, 503 when the queue is full or the server is
draining, 500 when the engine failed on the request (a stream then ends with an ``error`` event and ``[DONE]``).
A client that disconnects has its request aborted in the engine.

This module holds the app (its state and lifespan) and the routes; :mod:`inference.errors` the error shapes and
body parsing, :mod:`inference.responses` a request's lifecycle, streaming and response shapes.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.sequence import RequestOutput
from ssd_eagle.platform import describe

from inference.async_engine import AsyncEngine
from inference.errors import APIError, install_error_handlers, parse_body, require_api_key
from inference.metrics import ServerMetrics
from inference.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, RequestError,
                                TokenTexts)
from inference.responses import ChatFormatter, CompletionFormatter, serve_request
from inference.supervisor import SpeculatorSupervisor

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    """Everything the handlers need, kept on ``app.state.server``."""

    engine: object
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_names: list[str]
    api_key: str | None
    token_texts: TokenTexts
    max_request_bytes: int
    max_prompt_chars: int  # longer text cannot fit in max_model_len tokens: refused before tokenizing

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context, without spending engine-thread time on tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise RequestError(f"the {param} ({num_chars} characters) cannot fit this model's maximum context "
                               f"length of {self.engine.max_model_len} tokens", param, "context_length_exceeded")

    def check_model(self, name: str | None) -> str:
        """The model name to answer with. Raises APIError 404 for a name this server does not serve."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return name

    def spec_stats(self, out: RequestOutput) -> dict:
        stats = {"mode": self.engine.mode_name, **out.stats.summary()}
        stats.setdefault("cache_hit_rate", None)
        return stats


def build_app(engine, served_model_name: str | Sequence[str], *, api_key: str | None = None, max_queue: int = 32,
              max_request_bytes: int = 8 << 20, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: an :class:`~ssd_eagle.engine.llm_engine.LLMEngine` (from then on driven by the app's engine
            thread only; it starts and stops with the app's lifespan).
        served_model_name: the name(s) clients may pass as ``model`` (responses echo the name used; the first
            when the request omits it).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        max_queue: most requests waiting for a batch slot before 503.
        max_request_bytes: largest request body (413 beyond).
        metrics: the metrics to record into (default: a fresh registry).
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    metrics = metrics or ServerMetrics()
    async_engine = AsyncEngine(engine, max_queue=max_queue, metrics=metrics)
    supervisor = SpeculatorSupervisor(async_engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        supervisor.start()
        log.info("engine loop started", extra={"fields": {"event": "startup", "models": names,
                                                          "mode": engine.mode_name, "max_queue": max_queue,
                                                          "max_model_len": engine.max_model_len}})
        try:
            yield
        finally:
            await supervisor.stop()
            await async_engine.shutdown()
            log.info("engine loop stopped", extra={"fields": {"event": "shutdown"}})

    app = FastAPI(title="ssd-eagle OpenAI-compatible server", lifespan=lifespan)
    longest_token = max((len(t) for t in engine.tokenizer.get_vocab()), default=1)
    app.state.server = ServerState(engine, async_engine, metrics, names, api_key, TokenTexts(engine.tokenizer),
                                   max_request_bytes, engine.max_model_len * max(longest_token, 1))
    app.state.supervisor = supervisor
    install_error_handlers(app)
    app.include_router(_ops_router)
    app.include_router(_v1_router)
    return app


# ------------------------------------------------------------------------------------------- operational routes
_ops_router = APIRouter()


def _lifecycle(server: ServerState) -> str:
    """``starting`` (the engine loop not started yet), ``ready``, ``draining`` or ``stopped``."""
    engine = server.async_engine
    if engine.accepting:
        return "ready"
    if engine.alive:
        return "draining"
    return "stopped" if engine.started else "starting"


@_ops_router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    status = _lifecycle(request.app.state.server)
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


@_ops_router.get("/health")
async def health(request: Request) -> JSONResponse:
    server: ServerState = request.app.state.server
    status = _lifecycle(server)
    if status == "draining":  # alive: a liveness probe must not kill a server that is finishing requests
        return JSONResponse({"status": status})
    if status != "ready":
        return JSONResponse({"status": status}, status_code=503)
    drafter = server.engine.drafter
    platform = describe(server.engine.target.device, server.engine.target.weight_dtype)
    if not (drafter.probe() if callable(getattr(drafter, "probe", None)) else getattr(drafter, "healthy", True)):
        error = getattr(drafter, "error", None)
        return JSONResponse({"status": "degraded", "reason": "the drafter reports unhealthy; decoding continues "
                                                           "without speculation" + (f" ({error})" if error else ""),
                             **platform})
    if server.async_engine.last_step_failed:
        return JSONResponse({"status": "degraded", "reason": "the last engine step failed", **platform})
    return JSONResponse({"status": "ok", **platform})


@_ops_router.get("/metrics")
async def metrics(request: Request) -> Response:
    server: ServerState = request.app.state.server
    server.metrics.drafter_healthy.set(1 if getattr(server.engine.drafter, "healthy", True) else 0)
    body, content_type = server.metrics.render()
    return Response(body, media_type=content_type)


# ------------------------------------------------------------------------------------------------- /v1 routes
_v1_router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def _model_card(server: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, max_model_len=server.engine.max_model_len)


@_v1_router.get("/models")
async def list_models(request: Request) -> dict:
    server: ServerState = request.app.state.server
    return ModelList(data=[_model_card(server, n) for n in server.model_names]).model_dump()


@_v1_router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    server: ServerState = request.app.state.server
    return _model_card(server, server.check_model(model_id)).model_dump()


def _check_length(prompt_ids: list[int], max_tokens: int | None, engine, prompt_param: str,
                  default_max_tokens: int | None = None) -> int:
    """Check a prompt against the context and return the request's ``max_tokens``: the one given, or
    ``default_max_tokens`` capped to the room the prompt leaves in the context and in the KV budget (vLLM's
    default; None: all of that room). Call on the engine thread (it reads the engine's scheduler).

    Raises:
        RequestError: an empty prompt or one out of the vocabulary, a prompt that alone leaves no room for a token
            in the context or, without ``max_tokens``, in the KV budget (naming the prompt), or a given
            ``max_tokens`` past the room left in the context (naming ``max_tokens``).
    """
    if not prompt_ids:
        raise RequestError(f"{prompt_param} must not be empty", prompt_param)
    if any(not 0 <= t < engine.vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be in [0, {engine.vocab_size})", prompt_param)
    max_model_len = engine.max_model_len
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestError(f"this model's maximum context length is {max_model_len} tokens and the {prompt_param} "
                           f"alone takes {len(prompt_ids)}; shorten the {prompt_param}", prompt_param,
                           "context_length_exceeded")
    if max_tokens is None:
        kv_room = engine.scheduler.max_new_tokens(len(prompt_ids))
        if kv_room is not None and kv_room < 1:
            raise RequestError(f"the {prompt_param} ({len(prompt_ids)} tokens) leaves no room for a token in this "
                               f"server's KV cache budget (kv_cache_memory); shorten the {prompt_param}",
                               prompt_param, "kv_cache_exceeded")
        return min(x for x in (room, default_max_tokens, kv_room) if x is not None)
    if max_tokens > room:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request has {len(prompt_ids)} "
            f"prompt tokens and max_tokens={max_tokens}; shorten the {prompt_param} or lower max_tokens",
            "max_tokens", "context_length_exceeded")
    return max_tokens


async def _accept(request: Request, schema: type[CompletionRequest | ChatCompletionRequest]):
    """Parse and check a completion request. Returns ``(server state, request body, the model name to answer
    with)``; raises APIError 400/404/413 or RequestError for what the server refuses."""
    server: ServerState = request.app.state.server
    req = await parse_body(request, schema)
    model = server.check_model(req.model)
    req.check_supported()
    return server, req, model


@_v1_router.post("/completions")
async def create_completion(request: Request):
    arrival = time.monotonic()
    server, req, model = await _accept(request, CompletionRequest)
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        server.check_prompt_chars(len(prompt), "prompt")
    params = req.sampling_params(req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
    engine = server.engine

    def prepare(tokenizer):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        max_tokens = _check_length(ids, req.max_tokens, engine, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return ids, params.model_copy(update={"max_tokens": max_tokens})

    formatter = CompletionFormatter(server, f"cmpl-{uuid.uuid4().hex}", model, req.logprobs is not None,
                                     _include_usage(req))
    return await serve_request(request, server, "completions", formatter, prepare, req.stream, arrival)


@_v1_router.post("/chat/completions")
async def create_chat_completion(request: Request):
    arrival = time.monotonic()
    server, req, model = await _accept(request, ChatCompletionRequest)
    requested = req.requested_max_tokens
    params = req.sampling_params(requested or 1, req.num_logprobs)
    messages = [m.to_template() for m in req.messages]
    server.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    engine = server.engine

    def prepare(tokenizer):
        try:
            ids = render_chat(tokenizer, messages)
        except ValueError as err:  # no chat template
            raise RequestError(str(err), "messages") from None
        except Exception as err:  # noqa: BLE001 - template errors (e.g. raise_exception on bad roles)
            raise RequestError(f"the messages could not be rendered with the model's chat template: {err}",
                               "messages") from None
        # chat default: the rest of the context (and of the KV budget)
        max_tokens = _check_length(ids, requested, engine, "messages")
        return ids, params.model_copy(update={"max_tokens": max_tokens})

    formatter = ChatFormatter(server, f"chatcmpl-{uuid.uuid4().hex}", model, req.logprobs, _include_usage(req))
    return await serve_request(request, server, "chat", formatter, prepare, req.stream, arrival)


def _include_usage(req) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
