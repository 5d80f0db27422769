"""The verifier's side of SSD: a :class:`~ssd_eagle.drafters.base.Drafter` whose proposals come from a speculator.

:class:`SSDDrafter` reports each round's outcome ``(k, bonus)`` (and, for EAGLE-3, the aux states of the verified
inputs now committed) with the next request, and turns the replies into proposals that carry their q and whether
the speculation cache answered. The speculator lives either in this process (:class:`LocalSpeculator`: same
logic, no overlap; for tests and debugging) or in its own process on its own device (:class:`RemoteSpeculator`).

If the speculator dies, stalls past the timeout, or reports an error, the drafter turns unhealthy and proposes
nothing from then on: every request finishes with ordinary decoding (the engine's K = 0 path) and loses no token.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator, decode_replies, worker_main

log = logging.getLogger(__name__)


class LocalSpeculator:
    """The speculator in this process: propose, then build right away (no overlap)."""

    def __init__(self, settings: SpeculatorSettings, draft):
        self.speculator = build_speculator(settings, draft)

    def add(self, slot, token_ids, params, seed, aux) -> None:
        self.speculator.add(slot, token_ids, params, seed, aux)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        replies = self.speculator.propose(requests)
        self.speculator.build()
        return replies

    def remove(self, slot: int) -> None:
        self.speculator.remove(slot)

    def stats(self):
        return self.speculator.stats, []

    def close(self) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteSpeculator:
    """The speculator in its own process, reached over torch.distributed point-to-point.

    Args:
        settings: what the worker needs (fan-out, backup, device, CPU cores, ...).
        draft: the draft module (sent once, tensors in shared memory).
        timeout: seconds to wait for any reply before declaring the speculator unavailable.
        cpus: CPU cores to pin *this* (the verifier's) process to, or None.
    """

    def __init__(self, settings: SpeculatorSettings, draft, timeout: float = 60.0, cpus: list[int] | None = None,
                 startup_timeout: float = 300.0, verifier_device: str = "cpu"):
        if dist.is_initialized():
            raise RuntimeError("a default process group already exists in this process; SSD needs its own")
        if cpus:
            os.sched_setaffinity(0, cpus)
        settings.init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.settings, self.timeout = settings, timeout
        ctx = mp.get_context("spawn")
        self.process = ctx.Process(target=worker_main, args=(settings, draft), daemon=True)
        self.process.start()
        dist.init_process_group(settings.dist_backend, init_method=settings.init_method, rank=0, world_size=2,
                                timeout=__import__("datetime").timedelta(seconds=startup_timeout))
        channel_device = "cpu" if settings.dist_backend == "gloo" else verifier_device
        self.channel = t.Channel(peer=1, float_dtype=settings.float_dtype, device=channel_device)
        self.closed = False

    def _check_alive(self) -> None:
        if self.closed or not self.process.is_alive():
            raise t.SpeculatorUnavailable("the speculator process is not running")

    def add(self, slot, token_ids, params, seed, aux) -> None:
        self._check_alive()
        ints = torch.tensor([slot, seed, params.top_k, int(params.greedy), len(token_ids), *token_ids])
        floats = torch.tensor([params.temperature, params.top_p], dtype=self.settings.float_dtype)
        if aux is not None:
            floats = torch.cat([floats, aux.reshape(-1).to(device="cpu", dtype=self.settings.float_dtype)])
        ints, floats = ints.to(self.channel.device), floats.to(self.channel.device)
        self._send(t.ADD, ints, floats)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        self._check_alive()
        ints = torch.tensor([len(requests)] + [v for r in requests for v in (r.slot, r.num_accepted, r.bonus,
                                                                                r.budget)]
                            + [t for r in requests for t in (r.accepted or [])])
        auxes = [r.aux.reshape(-1).cpu() for r in requests if r.aux is not None and r.num_accepted >= 0]
        self._send(t.PROPOSE, ints, torch.cat(auxes) if auxes else None)
        command, ints, floats, _ = self.channel.recv(self.timeout)
        if command != t.REPLY:
            raise t.SpeculatorUnavailable(f"the speculator answered command {command} instead of a reply")
        return decode_replies(ints, floats, self.settings.vocab_size)

    def remove(self, slot: int) -> None:
        self._check_alive()
        self._send(t.REMOVE, torch.tensor([slot]))

    def stats(self):
        """(lookups, hits, builds, bonus ranks, build time) and the build intervals (wall-clock start/end pairs)."""
        from ssd_eagle.ssd.speculator import SpeculatorStats

        self._check_alive()
        self._send(t.STATS)
        _, ints, floats, _ = self.channel.recv(self.timeout)
        lookups, hits, builds, n = ints[:4].tolist()
        s = SpeculatorStats(lookups, hits, ints[4: 4 + n].tolist(), float(floats[0]), builds)
        return s, floats[1:].tolist()

    def _send(self, command, ints=None, floats=None) -> None:
        try:
            self.channel.send(command, ints, floats)
        except RuntimeError as err:
            raise t.SpeculatorUnavailable(f"sending to the speculator failed: {err}") from err

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.process.is_alive():
            try:
                self.channel.send(t.SHUTDOWN)
            except RuntimeError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:
                pass


class SSDDrafter(Drafter):
    """Proposals from a speculator (local or remote), with fallback to ordinary decoding on failure.

    Args:
        speculator: a :class:`LocalSpeculator` or :class:`RemoteSpeculator`.
        needs_aux: whether the draft is an EAGLE-3 head (the engine then captures aux states).
        aux_layer_ids: the head's aux layer ids.
    """

    name = "ssd"
    mode = "ssd"

    def __init__(self, speculator, needs_aux: bool = False, aux_layer_ids: tuple[int, ...] | None = None,
                 draft_name: str = "draft"):
        self.speculator = speculator
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

    def add_sequence(self, seq, prompt_aux) -> None:
        if not self.healthy:
            return
        seed = int(torch.randint(0, 2**62, (1,), generator=seq.draft_generator))
        try:
            self.speculator.add(seq.slot, seq.token_ids, seq.params, seed, prompt_aux)
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
