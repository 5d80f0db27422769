"""The synchronous :class:`~ssd_eagle.engine.llm_engine.LLMEngine` driven by one background thread, for asyncio.

The engine is not thread-safe, so exactly one thread (``engine-loop``) calls it. Handlers on the event loop send
it commands through a thread-safe inbox (add, abort, stop); it runs ``engine.step()`` while anything is
unfinished and hands each step's outputs back with ``loop.call_soon_threadsafe``, where they are routed to one
asyncio queue per request (:class:`RequestStream`). Requests join the running batch in arrival order whatever
their sampling parameters (the engine batches mixed parameters).

Everything tokenizer-related for a request (chat template, tokenization, the length check) also runs on the
engine thread, inside the ``prepare`` callable given to :meth:`AsyncEngine.add_request`, so the tokenizer is used
by one thread only (the event loop only maps single token ids to strings for logprobs).

Failure handling: an exception from ``engine.step()`` fails only the requests that were decoding (they get
:class:`EngineStepError`; they are aborted in the engine so their slots are freed), waiting requests go on (unless
nothing was decoding: then they fail too, so a step that cannot even admit cannot spin) and the loop keeps
serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ssd_eagle.engine.sequence import RequestOutput
from ssd_eagle.sampling_params import SamplingParams

from inference.protocol import RequestError

log = logging.getLogger(__name__)

# prepare(tokenizer) -> (prompt token ids, sampling params); runs on the engine thread; raises RequestError
Prepare = Callable[[Any], "tuple[list[int], SamplingParams]"]


class EngineUnavailable(Exception):
    """The request cannot be taken now (HTTP 503). ``code``: ``queue_full``, ``shutting_down`` or ``engine_stopped``."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


class EngineStepError(RuntimeError):
    """The engine raised while decoding this request (HTTP 500); other requests and the server carry on."""

    code = "engine_error"


class DrainTimeout(EngineStepError):
    """The server shut down before this request finished (its ``--graceful-timeout`` ran out)."""

    code = "shutdown_timeout"


class RequestAborted(Exception):
    """The request was aborted (its stream yields nothing more)."""


def _engine_refusal(message: str) -> RequestError:
    """The 400 for a ValueError of ``LLMEngine.add_request``: a request that can never fit the KV budget names
    ``max_tokens`` (what the client can lower), other prompt checks name ``prompt``."""
    if "kv_cache_memory" in message:
        return RequestError(message, "max_tokens", "kv_cache_exceeded")
    return RequestError(message, "prompt" if message.startswith("prompt") else None)


@dataclass
class _Add:
    request_id: str
    prepare: Prepare
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable
    args: tuple
    future: asyncio.Future


_STOP = object()


class RequestStream:
    """The :class:`RequestOutput` objects of one request, in order, ending with the finished one.

    Iterate with ``async for``. Raises :class:`EngineStepError` when the engine failed on the request and
    :class:`RequestAborted` after an abort. A finished output's ``stats`` are final (the engine no longer touches
    them); earlier outputs' ``delta_*`` fields and ``outputs[0]`` lists are private copies.

    Attributes:
        request_id: the engine's id.
        num_prompt_tokens: prompt length after the chat template and tokenization.
        finished: the last output (or an error) was taken.
    """

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncEngine:
    """Owns the engine thread and the per-request streams.

    Args:
        engine: an :class:`~ssd_eagle.engine.llm_engine.LLMEngine` (no other thread may call it afterwards).
        max_queue: most requests accepted but not yet decoding; beyond it :meth:`add_request` raises
            :class:`EngineUnavailable` (``queue_full``).
        metrics: a :class:`~inference.metrics.ServerMetrics`, or None.

    Lifecycle: :meth:`start` (on the event loop), :meth:`begin_shutdown` (refuse new requests; safe from a signal
    handler), ``await`` :meth:`drain` (wait for in-flight requests, up to a timeout), ``await`` :meth:`shutdown`
    (finish in-flight requests, stop the thread).
    """

    def __init__(self, engine, max_queue: int = 32, metrics=None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.accepting = False
        self.last_step_failed = False  # written by the engine thread
        self.num_step_errors = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._queued: set[str] = set()  # accepted, no output yet (event loop only)
        self._acks: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- event loop side
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished (queued or decoding)."""
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return len(self._streams) - len(self._queued)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._loop = asyncio.get_running_loop()
        if self.metrics is not None:  # before the thread: nobody else touches the engine yet
            self.metrics.set_kv_usage(*self.engine.kv_cache_usage)
        self._thread = threading.Thread(target=self._thread_main, name="engine-loop", daemon=True)
        self._thread.start()
        self.accepting = True

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on (503 ``shutting_down``); in-flight ones go on."""
        self.accepting = False

    async def drain(self, timeout: float, poll: float = 0.05) -> bool:
        """Refuse new requests and wait up to ``timeout`` s for the in-flight ones to finish; those still running
        then end with :class:`DrainTimeout` (and are aborted in the engine). Returns True when all finished."""
        self.begin_shutdown()
        deadline = self._loop.time() + timeout
        while self._streams and self._loop.time() < deadline:
            await asyncio.sleep(poll)
        if not self._streams:
            return True
        left = list(self._streams)
        log.error("graceful timeout expired; ending the remaining requests", extra={"fields": {
            "event": "drain_timeout", "timeout_s": timeout, "failed_requests": left}})
        for request_id in left:
            self._inbox.put(_Abort(request_id))
        self._fail(left, DrainTimeout(f"the server shut down before this request finished (graceful timeout of "
                                      f"{timeout:g} s)"))
        return False

    async def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish, then stop the engine thread (waits up to ``timeout``)."""
        self.accepting = False
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)

    async def add_request(self, request_id: str, prepare: Prepare) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises:
            EngineUnavailable: shutting down, the engine loop stopped, or ``max_queue`` requests already wait.
            RequestError: ``prepare`` or the engine rejected the request (bad prompt, too long ...).
        """
        if not self.accepting:
            raise EngineUnavailable("the server is shutting down; no new requests are accepted", "shutting_down")
        if not self.alive:
            raise EngineUnavailable("the engine loop is not running", "engine_stopped")
        if len(self._queued) >= self.max_queue:
            raise EngineUnavailable(f"the request queue is full ({self.max_queue} requests waiting); retry later",
                                    "queue_full")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        future = self._loop.create_future()
        self._streams[request_id] = stream
        self._queued.add(request_id)
        self._acks[request_id] = future
        self._update_gauges()
        self._inbox.put(_Add(request_id, prepare, future))
        try:
            stream.num_prompt_tokens = await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the engine may have taken it already
            raise
        except BaseException:
            self._forget(request_id)
            raise
        finally:
            self._acks.pop(request_id, None)
        return stream

    async def call(self, fn: Callable, *args) -> Any:
        """Run ``fn(*args)`` on the engine thread between two steps (the engine is not thread-safe) and return
        its result; raises what it raises."""
        future = self._loop.create_future()
        self._inbox.put(_Call(fn, args, future))
        return await future

    def abort(self, request_id: str) -> bool:
        """Abort a request that has not finished; the engine stops decoding it at its next command check (before
        its next step). Returns False when it was unknown or already finished."""
        stream = self._forget(request_id)
        if stream is None:
            return False
        self._inbox.put(_Abort(request_id))
        stream._put(RequestAborted(request_id))
        return True

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        self._queued.discard(request_id)
        self._update_gauges()
        return stream

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(self.num_queued, self.num_running)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            self._queued.discard(out.request_id)
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        self._update_gauges()

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._forget(request_id)
            if stream is not None:
                stream._put(error)

    @staticmethod
    def _resolve(future: asyncio.Future, result: Any) -> None:
        if future.done():  # the caller was cancelled; it aborts the request itself
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _on_thread_exit(self) -> None:
        self.accepting = False
        error = EngineStepError("the engine loop stopped")
        for future in self._acks.values():
            if not future.done():
                future.set_exception(EngineUnavailable("the engine loop stopped", "engine_stopped"))
        self._fail(list(self._streams), error)

    def _call(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---------------------------------------------------------------------------------------------- engine thread
    def _thread_main(self) -> None:
        try:
            with torch.no_grad():
                self._run()
        except BaseException:
            log.exception("the engine loop crashed", extra={"fields": {"event": "engine_loop_crashed"}})
        finally:
            self._call(self._on_thread_exit)

    def _run(self) -> None:
        engine = self.engine
        stopping = False
        while True:
            idle = not engine.has_unfinished()
            if idle and stopping:
                return
            for command in self._commands(block=idle):
                if command is _STOP:
                    stopping = True
                elif isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Call):
                    self._run_call(command)
                else:
                    self._abort(command.request_id)
            if engine.has_unfinished():
                self._step()

    def _commands(self, block: bool):
        if block:
            yield self._inbox.get()
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: _Add) -> None:
        try:
            prompt_ids, params = command.prepare(self.engine.tokenizer)
            self.engine.add_request(command.request_id, prompt_ids, params)
            result: Any = len(prompt_ids)
        except RequestError as err:
            result = err
        except ValueError as err:  # the engine's own checks
            result = _engine_refusal(str(err))
        except Exception as err:  # noqa: BLE001 - reported to the caller as a 500
            log.exception("adding a request failed", extra={"fields": {"request_id": command.request_id}})
            result = err
        self._call(self._resolve, command.future, result)

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.fn(*command.args)
        except Exception as err:  # noqa: BLE001 - handed to the caller
            result = err
        self._call(self._resolve, command.future, result)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("abort failed", extra={"fields": {"request_id": request_id}})

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as err:  # noqa: BLE001 - must not kill the loop
            self._on_step_error(err)
            return
        self.last_step_failed = False
        if self.metrics is not None:
            self.metrics.observe_step(engine.stats, sum(len(o.delta_token_ids) for o in outputs),
                                      bool(getattr(engine.drafter, "healthy", True)))
            self.metrics.set_kv_usage(*engine.kv_cache_usage)
        if outputs:
            self._call(self._dispatch, outputs)

    def _on_step_error(self, err: Exception) -> None:
        engine = self.engine
        waiting = {seq.request_id for seq in engine.waiting}
        affected = [rid for rid in list(engine.requests) if rid not in waiting]
        if not affected:  # it failed before decoding anything: fail the waiting ones rather than retry forever
            affected = list(engine.requests)
        log.error("engine step failed; failing the requests being decoded", exc_info=err,
                  extra={"fields": {"event": "engine_step_error", "error": f"{type(err).__name__}: {err}",
                                    "failed_requests": affected}})
        self.num_step_errors += 1
        self.last_step_failed = True
        if self.metrics is not None:
            self.metrics.step_errors.inc()
        for request_id in affected:
            self._abort(request_id)
        error = EngineStepError(f"the engine failed while decoding this request ({type(err).__name__}); "
                                "details are in the server log")
        self._call(self._fail, affected, error)
