"""The verifier's side of SSD: a :class:`~ssd_eagle.drafters.base.Drafter` whose proposals come from a speculator.

:class:`SSDDrafter` reports each round's outcome ``(k, bonus)`` (and, for EAGLE-3, the aux states of the verified
inputs now committed) with the next request, and turns the replies into proposals that carry their q and whether
the speculation cache answered. The speculator lives either in this process (:class:`LocalSpeculator`: same
logic, no overlap; for tests and debugging) or in its own process on its own device (:class:`RemoteSpeculator`,
over a :class:`SpeculatorLink`: the messages of :mod:`ssd_eagle.ssd.protocol` on a link of its own).

If the speculator dies, hangs (no heartbeat: :class:`RemoteSpeculator`), stalls past the timeout, or reports an
error, the drafter turns unhealthy and proposes nothing from then on: every request finishes with ordinary decoding
(the engine's K = 0 path) and loses no token.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch
import torch.multiprocessing as mp

from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.drafters.neural import last_rows
from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import HEARTBEAT_INTERVAL, SpeculatorSettings, build_speculator, worker_main

log = logging.getLogger(__name__)

FLUSH_ROWS = 64  # committed tokens of planned-off rounds gathered before they are sent (bounds their aux states)


class LocalSpeculator:
    """The speculator in this process: propose, then build right away (no overlap).

    Args:
        build_seconds: each build stops at its first branch-step boundary past this many seconds (its
            unfinished branches dropped), or None (no deadline).
    """

    def __init__(self, settings: SpeculatorSettings, draft, build_seconds: float | None = None):
        self.speculator = build_speculator(settings, draft)
        self.build_seconds = build_seconds

    def add(self, seq: p.NewSequence) -> None:
        self.speculator.add(seq.slot, seq.token_ids, seq.params, seq.seed, seq.aux, seq.start, seq.done)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        replies = self.speculator.propose(requests)
        seconds = self.build_seconds
        self.speculator.build(deadline=None if seconds is None else time.perf_counter() + seconds)
        return replies

    def remove(self, slot: int) -> None:
        self.speculator.remove(slot)

    def stats(self):
        """A copy of the speculator's :class:`~ssd_eagle.ssd.lookup.SpeculatorStats` (with its backup choice's
        summary) and no build intervals."""
        return dataclasses.replace(self.speculator.stats, backup=self.speculator.choice.summary()), []

    def close(self) -> None:
        pass


class SpeculatorLink:
    """A speculator at the other end of a :class:`~ssd_eagle.ssd.transport.Channel` (the methods of
    :class:`LocalSpeculator`, as messages of :mod:`ssd_eagle.ssd.protocol`).

    Args:
        channel: the verifier's end of the link.
        vocab_size: V, the width of the q rows in replies.
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
    """

    def __init__(self, channel: t.Channel, vocab_size: int, timeout: float = 60.0):
        self.channel, self.vocab_size, self.timeout = channel, vocab_size, timeout
        self.closed = False

    @property
    def alive(self) -> bool:
        """Whether the speculator can still answer (checked without a message: safe from any thread)."""
        return not self.closed

    def _check_alive(self) -> None:
        if self.closed:
            raise t.SpeculatorUnavailable("the speculator was shut down")

    def add(self, seq: p.NewSequence) -> None:
        self._check_alive()
        self._send(p.encode_add(seq))

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        self._check_alive()
        self._send(p.encode_propose(requests))
        msg = self.channel.recv(self.timeout, defer_post=(p.REPLY,))  # (the speculator sends nothing unasked)
        if msg.command != p.REPLY:
            raise t.SpeculatorUnavailable(f"the speculator answered command {msg.command} instead of a reply")
        return p.decode_reply(msg, self.vocab_size)

    def remove(self, slot: int) -> None:
        self._check_alive()
        self._send(p.encode_remove(slot))

    def stats(self):
        """The speculator's :class:`~ssd_eagle.ssd.speculator.SpeculatorStats` and its build intervals
        (wall-clock start/end pairs, seconds)."""
        self._check_alive()
        self._send(p.Message(p.STATS))
        return p.decode_stats(self.channel.recv(self.timeout))

    def _send(self, msg: p.Message) -> None:
        try:
            self.channel.send(msg)
        except RuntimeError as err:
            raise t.SpeculatorUnavailable(f"sending to the speculator failed: {err}") from err

    def close(self) -> None:
        """Tell the speculator to stop (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.channel.send(p.Message(p.SHUTDOWN))
        except RuntimeError as err:
            log.warning("could not reach the speculator to shut it down: %s", err)


class RemoteSpeculator(SpeculatorLink):
    """The speculator in a process of its own, spawned here and reached over a two-rank link of its own
    (:mod:`ssd_eagle.ssd.transport`), whatever process groups this process has.

    The process beats a heartbeat (:func:`~ssd_eagle.ssd.worker.beat`, every 0.5 s). A watchdog thread here
    checks it every ``heartbeat_timeout / 8`` s: after ``heartbeat_timeout`` s without one the speculator is hung
    (alive but not running, e.g. SIGSTOP) and is killed, which also ends a send or receive blocked on it (the link
    breaks: :class:`~ssd_eagle.ssd.transport.SpeculatorUnavailable`), so a propose never waits on a hung
    speculator much longer than ``heartbeat_timeout``.

    Args:
        settings: what the worker needs (fan-out, backup, device, CPU cores, ...).
        draft: the draft module (sent once, tensors in shared memory).
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
        cpus: CPU cores to pin *this* (the verifier's) process to, or None.
        startup_timeout: seconds the speculator has to join.
        verifier_device: this process's device (the channel's buffers live there with NCCL).
        heartbeat_timeout: seconds without a heartbeat after which the speculator is declared hung and killed.

    Raises:
        SpeculatorUnavailable: the process exited while starting (as soon as it does,
            :func:`~ssd_eagle.ssd.transport.wait_for_peer`) or did not join within ``startup_timeout``.
    """

    def __init__(self, settings: SpeculatorSettings, draft, timeout: float = 60.0, cpus: list[int] | None = None,
                 startup_timeout: float = 300.0, verifier_device: str = "cpu", heartbeat_timeout: float = 3.0):
        if heartbeat_timeout <= HEARTBEAT_INTERVAL:
            raise ValueError(f"heartbeat_timeout must exceed the heartbeat interval of {HEARTBEAT_INTERVAL} s, got "
                             f"{heartbeat_timeout}")
        if cpus:
            os.sched_setaffinity(0, cpus)
        self.settings, self.heartbeat_timeout = settings, heartbeat_timeout
        self.store = t.open_store(0, startup_timeout)
        settings.store_port = self.store.port
        context = mp.get_context("spawn")
        self.heartbeat = context.RawValue("d", time.monotonic())  # seconds of time.monotonic(), beaten there
        self.process = context.Process(target=worker_main, args=(settings, draft, startup_timeout, self.heartbeat),
                                       daemon=True)
        self.process.start()
        try:
            t.wait_for_peer(self.store, self.process, startup_timeout)
            group = t.pair_group(self.store, t.VERIFIER, settings.dist_backend, startup_timeout)
            device = "cpu" if settings.dist_backend == "gloo" else verifier_device
            spin = t.SPIN_SECONDS if cpus and settings.cpus else 0.0  # pinned apart: a reply is waited for spinning
            super().__init__(t.Channel(group, t.SPECULATOR, settings.float_dtype, device, spin=spin),
                             settings.vocab_size, timeout)
        except BaseException:  # (a failed join, or a signal during it): the process goes before the link it waits on
            self.process.kill()
            self.process.join(timeout=5)
            raise
        self.killed_hung: float | None = None  # the heartbeat's age (s) when the watchdog killed the process
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="speculator-watchdog", daemon=True).start()

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the speculator's last heartbeat."""
        return time.monotonic() - self.heartbeat.value

    @property
    def hung(self) -> bool:
        """Whether the process is alive but sent no heartbeat for ``heartbeat_timeout`` s."""
        return self.process.exitcode is None and self.heartbeat_age > self.heartbeat_timeout

    @property
    def alive(self) -> bool:
        return not self.closed and self.process.exitcode is None and not self.hung

    @property
    def down_reason(self) -> str | None:
        """Why the speculator cannot answer (None while it can)."""
        if self.killed_hung is not None:
            return f"the speculator was hung (no heartbeat for {self.killed_hung:.1f} s) and was killed"
        if self.closed:
            return "the speculator was shut down"
        if self.process.exitcode is not None:
            return f"the speculator process is not running (exit code {self.process.exitcode})"
        if self.hung:
            return f"the speculator is hung (no heartbeat for {self.heartbeat_age:.1f} s)"
        return None

    def _check_alive(self) -> None:
        if not self.alive:
            raise t.SpeculatorUnavailable(self.down_reason or "the speculator process is not running")

    def _watch(self) -> None:
        while not self._stop.wait(self.heartbeat_timeout / 8) and self.process.exitcode is None:
            if self.hung:
                self.killed_hung = self.heartbeat_age
                log.error("the speculator sent no heartbeat for %.1f s; killing it", self.killed_hung,
                          extra={"fields": {"event": "speculator_hung", "heartbeat_age_s": self.killed_hung}})
                self.process.kill()
                return

    def close(self) -> None:
        """Stop the speculator process and release the link (idempotent; a hung one is killed at once)."""
        if self.closed:
            return
        self._stop.set()
        if self.alive:
            super().close()
            self.process.join(timeout=10)
        self.closed = True
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.channel = self.store = None


class SSDDrafter(Drafter):
    """Proposals from a speculator (local or remote), with fallback to ordinary decoding on failure.

    Args:
        speculator: a :class:`LocalSpeculator` or a :class:`SpeculatorLink` (:class:`RemoteSpeculator`,
            :class:`~ssd_eagle.parallel.speculator.JoinedSpeculator`).
        needs_aux: whether the draft is an EAGLE-3 head (the engine then captures aux states).
        aux_layer_ids: the head's aux layer ids.
        respawn: builds a fresh speculator of the same kind (for :meth:`adopt` after a crash), or None.
    """

    name = "ssd"
    mode = "ssd"

    def __init__(self, speculator, needs_aux: bool = False, aux_layer_ids: tuple[int, ...] | None = None,
                 draft_name: str = "draft", respawn=None):
        self.speculator = speculator
        self.respawn = respawn
        self.needs_aux_hidden = needs_aux
        self.aux_layer_ids = aux_layer_ids
        self.name = draft_name
        self.healthy = True
        self.error: str | None = None
        self._outcome: dict[str, SpecRequest] = {}  # per request, its outcomes not sent yet (merged)
        self._registered: set[str] = set()
        self._sent: dict[str, int] = {}  # prompt tokens already sent of the sequences still prefilling

    def _fail(self, err: Exception) -> None:
        # the speculator's own account (e.g. hung, then killed) over the broken link's
        error = getattr(self.speculator, "down_reason", None) or str(err)
        if self.healthy:
            log.error("speculator unavailable, continuing with ordinary decoding: %s", error)
        self.healthy, self.error = False, error

    def probe(self) -> bool:
        """Mark the drafter unhealthy when its speculator is gone or hung (no message sent: safe from any thread,
        at any time). Returns ``healthy``."""
        if self.healthy and not getattr(self.speculator, "alive", True):
            self._fail(t.SpeculatorUnavailable("the speculator process is not running"))
        return self.healthy

    def adopt(self, speculator) -> None:
        """Replace a failed speculator by a fresh one (call from the engine's thread, between steps): requests
        already running go on without speculation (the new speculator never saw them), new ones use it."""
        old, self.speculator = self.speculator, speculator
        self._registered, self._outcome, self._sent = set(), {}, {}
        self.healthy, self.error = True, None
        old.close()

    def prefill(self, seq, aux) -> None:
        """Send the prompt chunk the target just cached (one ADD per chunk: the speculator prefills it meanwhile)."""
        sent = self._sent.get(seq.request_id, 0)
        new = last_rows(aux, seq.num_cached - sent) if aux is not None else None
        self._add(seq, sent, seq.token_ids[sent: seq.num_cached], new, False)

    def add_sequence(self, seq, prompt_aux) -> None:
        sent = self._sent.pop(seq.request_id, 0)
        self._add(seq, sent, seq.token_ids[sent:], None if prompt_aux is None else prompt_aux[sent:], True)

    def _add(self, seq, start: int, tokens: list[int], aux, done: bool) -> None:
        if not self.healthy:
            return
        gen = seq.draft_generator
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device)) if start == 0 else 0
        try:
            self.speculator.add(p.NewSequence(seq.slot, tokens, seq.params, seed, aux, start, done))
            self._registered.add(seq.request_id)
            if not done:
                self._sent[seq.request_id] = start + len(tokens)
        except t.SpeculatorUnavailable as err:
            self._fail(err)

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        """Rows the planner runs without speculation (``num_tokens`` 0) send nothing: their outcomes go, merged,
        with the row's next request (:meth:`SpecRequest.merged`), or once ``FLUSH_ROWS`` tokens have gathered
        (bounded memory; the speculator then commits them and builds nothing). A round where no row speculates
        sends no message at all: the verifier does not wait for the speculator."""
        rows = [i for i, s in enumerate(seqs) if s.request_id in self._registered and
                (num_tokens[i] > 0 or self._outcome_tokens(s.request_id) >= FLUSH_ROWS)]
        if not self.healthy or not rows:
            return [Proposal([]) for _ in seqs]
        requests = []
        for i in rows:
            slot = seqs[i].slot
            request = self._outcome.pop(seqs[i].request_id, None) or SpecRequest(slot, -1, 0, 0, None, [])
            request.budget = num_tokens[i]
            requests.append(request)
        try:
            replies = self.speculator.propose(requests)
        except t.SpeculatorUnavailable as err:
            self._fail(err)
            return [Proposal([]) for _ in seqs]
        proposals = [Proposal([]) for _ in seqs]
        for i, r in zip(rows, replies):
            proposals[i] = r.cut(num_tokens[i])  # (a tree is already cut to the budget's depth)
        return proposals

    def on_verified(self, seq, num_accepted: int, aux) -> None:
        if seq.request_id in self._registered:
            accepted = seq.token_ids[-1 - num_accepted: -1] if num_accepted else []
            outcome = SpecRequest(seq.slot, num_accepted, seq.token_ids[-1], 0, aux, accepted)
            unsent = self._outcome.get(seq.request_id)
            self._outcome[seq.request_id] = outcome if unsent is None else unsent.merged(outcome)

    def _outcome_tokens(self, request_id: str) -> int:
        unsent = self._outcome.get(request_id)
        return 0 if unsent is None else unsent.num_accepted + 1

    def remove_sequence(self, seq) -> None:
        self._outcome.pop(seq.request_id, None)
        self._sent.pop(seq.request_id, None)
        if seq.request_id in self._registered:
            self._registered.discard(seq.request_id)
            if self.healthy:
                try:
                    self.speculator.remove(seq.slot)
                except t.SpeculatorUnavailable as err:
                    self._fail(err)

    def close(self) -> None:
        self.speculator.close()
