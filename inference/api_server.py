"""The OpenAI-compatible HTTP API (FastAPI), built around an already constructed engine.

Endpoints follow OpenAI's API (and vLLM's server where OpenAI is silent):

- ``GET /v1/models``, ``GET /v1/models/{id}``
- ``POST /v1/completions``, ``POST /v1/chat/completions``: ``stream`` sends server-sent events (``data: {chunk}``
  lines in OpenAI's chunk format, then ``data: [DONE]``); responses and final chunks carry ``spec_stats``.
- ``GET /health``: 200 ``{"status": "ok"}``, 200 ``{"status": "degraded", "reason"}`` while the drafter reports
  unhealthy (decoding goes on without speculation) or right after a failed engine step, 503 while draining or when
  the engine loop stopped; a 200 also names the target's device and dtype and the CPU's capability
  (:func:`ssd_eagle.platform.describe`).
- ``GET /metrics``: Prometheus text (see :mod:`inference.metrics`).

Errors always have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests
(bad JSON or UTF-8, wrong types, unsupported parameters, too long prompts), 401 for a missing/wrong API key on
``/v1/*``, 404 for an unknown model, 413 for an oversized body, 503 when the queue is full or the server is
draining, 500 when the engine failed on the request (a stream then ends with an ``error`` event and ``[DONE]``).
A client that disconnects has its request aborted in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.sequence import RequestOutput
from ssd_eagle.platform import describe

from inference.async_engine import AsyncEngine, EngineStepError, EngineUnavailable, RequestStream
from inference.metrics import ServerMetrics
from inference.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionLogprobs,
                                CompletionLogprobsBuilder, CompletionRequest, CompletionResponse, DeltaMessage,
                                ErrorInfo, ErrorResponse, ModelCard, ModelList, RequestError, TokenTexts, Usage,
                                chat_logprobs, dump_chunk)

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


class APIError(Exception):
    """An error response in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        log.info("engine loop started", extra={"fields": {"event": "startup", "models": names,
                                                          "mode": engine.mode_name, "max_queue": max_queue,
                                                          "max_model_len": engine.max_model_len}})
        try:
            yield
        finally:
            await async_engine.shutdown()
            log.info("engine loop stopped", extra={"fields": {"event": "shutdown"}})

    app = FastAPI(title="ssd-eagle OpenAI-compatible server", lifespan=lifespan)
    longest_token = max((len(t) for t in engine.tokenizer.get_vocab()), default=1)
    app.state.server = ServerState(engine, async_engine, metrics, names, api_key, TokenTexts(engine.tokenizer),
                                   max_request_bytes, engine.max_model_len * max(longest_token, 1))
    _install_error_handlers(app)
    app.include_router(_ops_router)
    app.include_router(_v1_router)
    return app


# ------------------------------------------------------------------------------------------------------- errors
def _install_error_handlers(app: FastAPI) -> None:
    def refuse(request: Request, err: APIError) -> JSONResponse:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            request.app.state.server.metrics.observe_request(endpoint, str(err.status))
            log.info("request refused", extra={"fields": {
                "event": "request_refused", "endpoint": endpoint, "status": err.status, "code": err.code,
                "param": err.param, "message": err.message}})
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return refuse(request, err)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError):
        return refuse(request, APIError(400, err.message, param=err.param, code=err.code))

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, err: EngineUnavailable):
        return refuse(request, APIError(503, err.message, type="server_error", code=err.code,
                                        headers={"Retry-After": "1"}))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError):
        return refuse(request, _validation_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException):
        return refuse(request, APIError(err.status_code, str(err.detail),
                                        "invalid_request_error" if err.status_code < 500 else "server_error",
                                        headers=getattr(err, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.error("unhandled error", exc_info=err, extra={"fields": {"event": "unhandled_error",
                                                                     "path": request.url.path}})
        return refuse(request, APIError(500, f"internal server error ({type(err).__name__})", "server_error",
                                        code="internal_error"))


def _param_of(loc: tuple) -> tuple[str | None, str | None]:
    """(``messages[0].content``-style parameter, union member tag) of a pydantic error location."""
    param, tag = "", None
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part) and part not in _TYPE_TAGS:
            param += ("." if param else "") + part
        elif tag is None:
            tag = part
    return param or None, tag


def _validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic errors into one 400 naming the first offending parameter."""
    # the most specific error: with a union (str | list[...]) the deepest location names the real culprit
    first = max(errors, key=lambda e: len([p for p in e["loc"] if _param_of((p,))[0] or isinstance(p, int)]))
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return APIError(400, f"the request body is not valid JSON: {detail}", code="invalid_json")
    param, _ = _param_of(tuple(first["loc"]))
    if param is None:
        return APIError(400, "the request body must be a JSON object", code="invalid_request_body")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported parameter '{param}'", param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param, code="missing_required_parameter")
    same = [e for e in errors if _param_of(tuple(e["loc"]))[0] == param]
    tags = [t for t in (_param_of(tuple(e["loc"]))[1] for e in same) if t]
    if len(same) > 1 and len(set(tags)) > 1:
        message = f"invalid value for '{param}': expected one of {', '.join(dict.fromkeys(tags))}"
    else:
        message = f"invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}"
    return APIError(400, message, param=param, code="invalid_value")


async def _parse_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """Read and validate a JSON body (strict UTF-8, size-limited). Raises APIError 400/413."""
    limit = request.app.state.server.max_request_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    try:
        return schema.model_validate_json(text)
    except ValidationError as err:
        raise _validation_error(err.errors(include_url=False)) from None


async def _require_api_key(request: Request) -> None:
    key = request.app.state.server.api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# ------------------------------------------------------------------------------------------- operational routes
_ops_router = APIRouter()


@_ops_router.get("/health")
async def health(request: Request) -> JSONResponse:
    server: ServerState = request.app.state.server
    if not server.async_engine.accepting:
        status = "draining" if server.async_engine.alive else "stopped"
        return JSONResponse({"status": status}, status_code=503)
    drafter = server.engine.drafter
    platform = describe(server.engine.target.device, server.engine.target.dtype)
    if not getattr(drafter, "healthy", True):
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
_v1_router = APIRouter(prefix="/v1", dependencies=[Depends(_require_api_key)])


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


def _check_length(prompt_ids: list[int], max_tokens: int, max_model_len: int, vocab_size: int,
                  prompt_param: str, max_tokens_given: bool) -> None:
    if not prompt_ids:
        raise RequestError(f"{prompt_param} must not be empty", prompt_param)
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", prompt_param)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request has {len(prompt_ids)} "
            f"prompt tokens and max_tokens={max_tokens}; shorten the {prompt_param} or lower max_tokens",
            "max_tokens" if max_tokens_given else prompt_param, "context_length_exceeded")


@_v1_router.post("/completions")
async def create_completion(request: Request):
    arrival = time.monotonic()
    server: ServerState = request.app.state.server
    req: CompletionRequest = await _parse_body(request, CompletionRequest)
    model = server.check_model(req.model)
    req.check_supported()
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        server.check_prompt_chars(len(prompt), "prompt")
    params = req.sampling_params(req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS, req.logprobs)
    engine = server.engine

    def prepare(tokenizer):
        ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        _check_length(ids, params.max_tokens, engine.max_model_len, engine.vocab_size, "prompt",
                      req.max_tokens is not None)
        return ids, params

    formatter = _CompletionFormatter(server, f"cmpl-{uuid.uuid4().hex}", model, req.logprobs is not None,
                                     _include_usage(req))
    return await _serve(request, server, "completions", formatter, prepare, req.stream, arrival)


@_v1_router.post("/chat/completions")
async def create_chat_completion(request: Request):
    arrival = time.monotonic()
    server: ServerState = request.app.state.server
    req: ChatCompletionRequest = await _parse_body(request, ChatCompletionRequest)
    model = server.check_model(req.model)
    req.check_supported()
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
        max_tokens = requested or engine.max_model_len - len(ids)  # chat default: the rest of the context
        if max_tokens < 1:
            raise RequestError(f"this model's maximum context length is {engine.max_model_len} tokens and the "
                               f"messages already take {len(ids)}", "messages", "context_length_exceeded")
        _check_length(ids, max_tokens, engine.max_model_len, engine.vocab_size, "messages", requested is not None)
        return ids, dataclasses.replace(params, max_tokens=max_tokens)

    formatter = _ChatFormatter(server, f"chatcmpl-{uuid.uuid4().hex}", model, req.logprobs, _include_usage(req))
    return await _serve(request, server, "chat", formatter, prepare, req.stream, arrival)


def _include_usage(req) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


# ------------------------------------------------------------------------------------------- request lifecycle
class _Tracker:
    """Timing and token counts of one request; records metrics and one JSON log line when it ends."""

    def __init__(self, server: ServerState, endpoint: str, request_id: str, stream: bool, arrival: float):
        self.server, self.endpoint, self.request_id, self.stream = server, endpoint, request_id, stream
        self.start = arrival  # time.monotonic() when the handler was entered
        self.first_token: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.stats: dict | None = None

    def on_output(self, out: RequestOutput) -> None:
        if out.delta_token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.completion_tokens += len(out.delta_token_ids)

    def done(self, outcome: str, status: int) -> None:
        latency = time.monotonic() - self.start
        ttft = None if self.first_token is None else self.first_token - self.start
        self.server.metrics.observe_request(self.endpoint, outcome, self.prompt_tokens, self.completion_tokens,
                                            latency if outcome in ("stop", "length") else None, ttft)
        fields = {"event": "request_finished", "request_id": self.request_id, "endpoint": self.endpoint,
                  "stream": self.stream, "status": status, "outcome": outcome, "prompt_tokens": self.prompt_tokens,
                  "completion_tokens": self.completion_tokens, "latency_s": round(latency, 4),
                  "ttft_s": None if ttft is None else round(ttft, 4)}
        if self.stats:
            fields.update(tau=self.stats.get("tau"), cache_hit_rate=self.stats.get("cache_hit_rate"))
        log.info("request finished", extra={"fields": fields})


async def _serve(request: Request, server: ServerState, endpoint: str, formatter, prepare, stream: bool,
                 arrival: float):
    """Queue the request, then stream its events or wait for its response (aborting it if the client leaves)."""
    tracker = _Tracker(server, endpoint, formatter.request_id, stream, arrival)
    rs = await server.async_engine.add_request(formatter.request_id, prepare)
    tracker.prompt_tokens = rs.num_prompt_tokens
    headers = {"X-Request-Id": formatter.request_id}
    if stream:
        return StreamingResponse(_event_stream(server, rs, formatter, tracker), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    final = await _collect_unless_disconnected(request, server, rs, tracker)
    if final is None:  # the client went away; nobody reads this
        return Response(status_code=499, headers=headers)
    return JSONResponse(formatter.response(final), headers=headers)


async def _collect_unless_disconnected(request: Request, server: ServerState, rs: RequestStream,
                                       tracker: _Tracker) -> RequestOutput | None:
    """The finished output, or None when the client disconnected first (the request is then aborted)."""
    async def collect() -> RequestOutput:
        final = None
        async for out in rs:
            tracker.on_output(out)
            final = out
        return final

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        server.async_engine.abort(rs.request_id)
        raise
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        server.async_engine.abort(rs.request_id)
        tracker.done("aborted", 499)
        return None
    try:
        final = work.result()
    except EngineStepError as err:
        tracker.done("error", 500)
        raise APIError(500, str(err), "server_error", code="engine_error") from None
    tracker.stats = server.spec_stats(final)
    tracker.done(final.finish_reason, 200)
    return final


def _sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _event_stream(server: ServerState, rs: RequestStream, formatter, tracker: _Tracker):
    """Server-sent events of one request; aborts it in the engine if the client goes away (cancellation)."""
    outcome, status = "aborted", 499
    try:
        try:
            final = None
            async for out in rs:
                tracker.on_output(out)
                final = out
                chunk = formatter.chunk(out)
                if chunk is not None:
                    yield _sse(chunk)
            tracker.stats = server.spec_stats(final)
            outcome, status = final.finish_reason, 200
            if formatter.include_usage:
                yield _sse(formatter.usage_chunk(final))
        except EngineStepError as err:
            outcome, status = "error", 500
            yield _sse(APIError(500, str(err), "server_error", code="engine_error").body())
        yield _sse("[DONE]")
    finally:
        if outcome == "aborted":
            server.async_engine.abort(rs.request_id)
        tracker.done(outcome, status)


# ---------------------------------------------------------------------------------------------- response shapes
class _CompletionFormatter:
    """``text_completion`` responses and chunks of one request."""

    def __init__(self, server: ServerState, request_id: str, model: str, logprobs: bool, include_usage: bool):
        self.server, self.request_id, self.model = server, request_id, model
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self._logprobs_builder = CompletionLogprobsBuilder(server.token_texts)

    def _logprobs(self, out: RequestOutput, num_tokens: int) -> CompletionLogprobs | None:
        if not self.logprobs or num_tokens == 0:
            return None
        entries = out.outputs[0].logprobs
        return self._logprobs_builder.build(entries[len(entries) - num_tokens:])

    def _wrap(self, choice: CompletionChoice, out: RequestOutput | None, usage: Usage | None = None) -> dict:
        stats = self.server.spec_stats(out) if out is not None and out.finished else None
        return dump_chunk(CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                             choices=[] if choice is None else [choice], usage=usage, spec_stats=stats),
                          self.include_usage)

    def response(self, out: RequestOutput) -> dict:
        choice = CompletionChoice(text=out.text, logprobs=self._logprobs(out, len(out.token_ids)),
                                  finish_reason=out.finish_reason)
        return self._wrap(choice, out, _usage(out))

    def chunk(self, out: RequestOutput) -> dict | None:
        lp = self._logprobs(out, len(out.delta_token_ids))
        if not out.delta_text and lp is None and not out.finished:
            return None
        choice = CompletionChoice(text=out.delta_text, logprobs=lp,
                                  finish_reason=out.finish_reason if out.finished else None)
        return self._wrap(choice, out)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._wrap(None, out, _usage(out))


class _ChatFormatter:
    """``chat.completion`` responses and ``chat.completion.chunk`` chunks of one request."""

    def __init__(self, server: ServerState, request_id: str, model: str, logprobs: bool, include_usage: bool):
        self.server, self.request_id, self.model = server, request_id, model
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self._sent_role = False

    def _logprobs(self, out: RequestOutput, num_tokens: int):
        if not self.logprobs or num_tokens == 0:
            return None
        entries = out.outputs[0].logprobs
        return chat_logprobs(entries[len(entries) - num_tokens:], self.server.token_texts)

    def response(self, out: RequestOutput) -> dict:
        choice = ChatChoice(message=ChatMessageOut(content=out.text),
                            logprobs=self._logprobs(out, len(out.token_ids)), finish_reason=out.finish_reason)
        return dump_chunk(ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                                 choices=[choice], usage=_usage(out),
                                                 spec_stats=self.server.spec_stats(out)), True)

    def _chunk(self, choices: list[ChatChunkChoice], out: RequestOutput, usage: Usage | None = None) -> dict:
        stats = self.server.spec_stats(out) if out.finished else None
        return dump_chunk(ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                              choices=choices, usage=usage, spec_stats=stats), self.include_usage)

    def chunk(self, out: RequestOutput) -> dict | None:
        lp = self._logprobs(out, len(out.delta_token_ids))
        first = not self._sent_role
        if not (out.delta_text or lp or out.finished or first):
            return None
        self._sent_role = True
        delta = DeltaMessage(role="assistant" if first else None,
                             content=out.delta_text if out.delta_text or first else None)
        return self._chunk([ChatChunkChoice(delta=delta, logprobs=lp,
                                            finish_reason=out.finish_reason if out.finished else None)], out)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self._chunk([], out, _usage(out))


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(len(out.prompt_token_ids), len(out.token_ids))
