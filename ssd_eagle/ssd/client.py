"""The verifier's side of SSD: a :class:`~ssd_eagle.drafters.base.Drafter` whose proposals come from a speculator.

:class:`SSDDrafter` reports each round's outcome ``(k, bonus)`` (and, for EAGLE-3, the aux states of the verified
inputs now committed) with the next request, and turns the replies into proposals that carry their q and whether
the speculation cache answered. The speculator lives either in this process (:class:`LocalSpeculator`: same
logic, no overlap; for tests and debugging) or in its own process on its own device (:class:`RemoteSpeculator`,
over a :class:`SpeculatorLink`: the messages of :mod:`ssd_eagle.ssd.protocol` on a link of its own).

If the speculator dies, stalls past the timeout, or reports an error, the drafter turns unhealthy and proposes
nothing from then on: every request finishes with ordinary decoding (the engine's K = 0 path) and loses no token.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.multiprocessing as mp

from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator, worker_main

log = logging.getLogger(__name__)


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
        self.speculator.add(seq.slot, seq.token_ids, seq.params, seq.seed, seq.aux)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        replies = self.speculator.propose(requests)
        seconds = self.build_seconds
        self.speculator.build(deadline=None if seconds is None else time.perf_counter() + seconds)
        return replies

    def remove(self, slot: int) -> None:
        self.speculator.remove(slot)

    def stats(self):
        return self.speculator.stats, []

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
        msg = self.channel.recv(self.timeout)
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

    Args:
        settings: what the worker needs (fan-out, backup, device, CPU cores, ...).
        draft: the draft module (sent once, tensors in shared memory).
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
        cpus: CPU cores to pin *this* (the verifier's) process to, or None.
        startup_timeout: seconds the speculator has to join.
        verifier_device: this process's device (the channel's buffers live there with NCCL).
    """

    def __init__(self, settings: SpeculatorSettings, draft, timeout: float = 60.0, cpus: list[int] | None = None,
                 startup_timeout: float = 300.0, verifier_device: str = "cpu"):
        if cpus:
            os.sched_setaffinity(0, cpus)
        self.settings = settings
        self.store = t.open_store(0, startup_timeout)
        settings.store_port = self.store.port
        self.process = mp.get_context("spawn").Process(target=worker_main, args=(settings, draft, startup_timeout),
                                                       daemon=True)
        self.process.start()
        group = t.pair_group(self.store, t.VERIFIER, settings.dist_backend, startup_timeout)
        device = "cpu" if settings.dist_backend == "gloo" else verifier_device
        super().__init__(t.Channel(group, t.SPECULATOR, settings.float_dtype, device), settings.vocab_size, timeout)

    @property
    def alive(self) -> bool:
        return not self.closed and self.process.exitcode is None

    def _check_alive(self) -> None:
        if self.closed or not self.process.is_alive():
            raise t.SpeculatorUnavailable("the speculator process is not running")

    def close(self) -> None:
        """Stop the speculator process and release the link (idempotent)."""
        if self.closed:
            return
        if self.process.is_alive():
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
        self._outcome: dict[str, tuple[int, int, torch.Tensor | None, list[int]]] = {}
        self._registered: set[str] = set()

    def _fail(self, err: Exception) -> None:
        if self.healthy:
            log.error("speculator unavailable, continuing with ordinary decoding: %s", err)
        self.healthy, self.error = False, str(err)

    def probe(self) -> bool:
        """Mark the drafter unhealthy when its speculator is gone (no message sent: safe from any thread, at any
        time). Returns ``healthy``."""
        if self.healthy and not getattr(self.speculator, "alive", True):
            self._fail(t.SpeculatorUnavailable("the speculator process is not running"))
        return self.healthy

    def adopt(self, speculator) -> None:
        """Replace a failed speculator by a fresh one (call from the engine's thread, between steps): requests
        already running go on without speculation (the new speculator never saw them), new ones use it."""
        old, self.speculator = self.speculator, speculator
        self._registered, self._outcome = set(), {}
        self.healthy, self.error = True, None
        old.close()

    def add_sequence(self, seq, prompt_aux) -> None:
        if not self.healthy:
            return
        seed = int(torch.randint(0, 2**62, (1,), generator=seq.draft_generator))
        try:
            self.speculator.add(p.NewSequence(seq.slot, seq.token_ids, seq.params, seed, prompt_aux))
            self._registered.add(seq.request_id)
        except t.SpeculatorUnavailable as err:
            self._fail(err)

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        rows = [i for i, s in enumerate(seqs) if s.request_id in self._registered]
        if not self.healthy or not rows:
            return [Proposal([]) for _ in seqs]
        requests = []
        for i in rows:
            k, bonus, aux, accepted = self._outcome.pop(seqs[i].request_id, (-1, 0, None, []))
            requests.append(SpecRequest(seqs[i].slot, k, bonus, num_tokens[i], aux, accepted))
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
            self._outcome[seq.request_id] = (num_accepted, seq.token_ids[-1], aux, accepted)

    def remove_sequence(self, seq) -> None:
        self._outcome.pop(seq.request_id, None)
        if seq.request_id in self._registered:
            self._registered.discard(seq.request_id)
            if self.healthy:
                try:
                    self.speculator.remove(seq.slot)
                except t.SpeculatorUnavailable as err:
                    self._fail(err)

    def close(self) -> None:
        self.speculator.close()
