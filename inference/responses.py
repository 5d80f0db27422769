"""One request's life in the server: queueing, waiting or streaming (server-sent events), aborting when the
client leaves, and the OpenAI response and chunk shapes of the two completion endpoints.

A request is queued on the :class:`~inference.async_engine.AsyncEngine`; a non-streamed one waits for its final
output while watching for a disconnect (then it is aborted, status 499 logged), a streamed one yields ``data:``
events and ``data: [DONE]`` (an engine failure sends an ``error`` event first). Each request ends with its metrics
recorded and one ``request finished`` log record (latency, time to first token, tau, cache hit rate, and with a
planner the rounds without speculation and the probes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ssd_eagle.engine.sequence import RequestOutput

from inference.async_engine import EngineStepError, RequestStream
from inference.errors import APIError
from inference.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                ChatMessageOut, CompletionChoice, CompletionLogprobs, CompletionLogprobsBuilder,
                                CompletionResponse, DeltaMessage, Usage, chat_logprobs, dump_chunk)

if TYPE_CHECKING:
    from inference.api_server import ServerState

log = logging.getLogger("inference.api_server")  # the server's request records share one logger


class Tracker:
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
            if "planned_rounds_per_k" in self.stats:  # the planner's decisions (ssd_eagle.stats.SpecStats.summary)
                fields.update({key: self.stats[key] for key in ("rounds_without_speculation", "probes")})
        log.info("request finished", extra={"fields": fields})


async def serve_request(request: Request, server: ServerState, endpoint: str, formatter, prepare, stream: bool,
                 arrival: float):
    """Queue the request, then stream its events or wait for its response (aborting it if the client leaves)."""
    tracker = Tracker(server, endpoint, formatter.request_id, stream, arrival)
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
                                       tracker: Tracker) -> RequestOutput | None:
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
        raise APIError(500, str(err), "server_error", code=err.code) from None
    tracker.stats = server.spec_stats(final)
    tracker.done(final.finish_reason, 200)
    return final


def _sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def _event_stream(server: ServerState, rs: RequestStream, formatter, tracker: Tracker):
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
            yield _sse(APIError(500, str(err), "server_error", code=err.code).body())
        yield _sse("[DONE]")
    finally:
        if outcome == "aborted":
            server.async_engine.abort(rs.request_id)
        tracker.done(outcome, status)


# ---------------------------------------------------------------------------------------------- response shapes
class CompletionFormatter:
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


class ChatFormatter:
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
