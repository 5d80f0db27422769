"""The SSD link's hit-path plumbing (ssd_eagle/ssd/transport.py, issue 13 item 2): a spinning receive returns as
soon as its message lands, falls back to the blocking wait (which keeps the timeout and still reports a dead peer),
and gives way at once when its core runs another process; a deferred post is made by the answer; one send frame
serves every message, from any thread."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.lookup import SpecRequest
from test_ssd_protocol import _pair, assert_same_requests


def _send_later(channel: t.Channel, msg: p.Message, delay: float) -> threading.Thread:
    def send():
        time.sleep(delay)
        channel.send(msg)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_spinning_receive_returns_when_its_message_lands():
    verifier, speculator, _store = _pair()
    speculator.spin = 5.0
    requests = [SpecRequest(0, 2, 7, 3, torch.randn(3, 16), [4, 5])]
    thread = _send_later(verifier, p.encode_propose(requests), 0.05)
    start = time.perf_counter()
    got = p.decode_propose(speculator.recv(timeout=10))
    assert time.perf_counter() - start < 2.5  # the spin ended with the message, not at its 5 s bound
    thread.join()
    assert_same_requests(got, requests)


def test_a_spin_that_sees_nothing_falls_back_to_the_blocking_wait():
    verifier, speculator, _store = _pair()
    speculator.spin = 0.02
    thread = _send_later(verifier, p.encode_remove(11), 0.3)
    start = time.perf_counter()
    assert p.decode_remove(speculator.recv(timeout=10)) == 11
    assert time.perf_counter() - start >= 0.25
    thread.join()


@pytest.mark.parametrize("spin", [5.0, 0.05])
def test_a_spinning_receive_keeps_its_timeout(spin):
    """Nothing arrives: the receive fails after ``timeout`` whether the spin outlasts it or not (the spin never
    leaves the blocking wait a zero timeout, which would mean no timeout)."""
    _verifier, speculator, _store = _pair()
    speculator.spin = spin
    start = time.perf_counter()
    with pytest.raises(t.SpeculatorUnavailable):  # (raised by the spin, or by gloo's timed-out wait after it)
        speculator.recv(timeout=0.3)
    assert 0.25 <= time.perf_counter() - start < 2.5


def test_a_spin_gives_way_when_its_core_runs_another_process(monkeypatch):
    """A yield that comes back late ran another process on this core: the spin stops at once and the blocking
    wait gets the message."""
    verifier, speculator, _store = _pair()
    speculator.spin = 5.0
    yields = []

    def busy_core_yield():  # another process ran for 2 ms
        yields.append(1)
        time.sleep(2e-3)

    monkeypatch.setattr(os, "sched_yield", busy_core_yield)
    thread = _send_later(verifier, p.encode_remove(9), 0.3)
    assert p.decode_remove(speculator.recv(timeout=10)) == 9
    thread.join()
    assert len(yields) == 1


def _join_then_die(port: int) -> None:
    store = t.open_store(port, timeout=30)
    group = t.pair_group(store, t.SPECULATOR, timeout=30)  # (kept: a dropped group closes the link at once)
    store.wait(["channel-built"])  # dying before the verifier's channel posted its receive broke its constructor
    os._exit(0 if group is not None else 1)


def test_a_dead_peer_still_fails_a_spinning_receive():
    store = t.open_store(0, timeout=30)
    peer = mp.get_context("spawn").Process(target=_join_then_die, args=(store.port,))
    peer.start()
    channel = t.Channel(t.pair_group(store, t.VERIFIER, timeout=30), t.SPECULATOR, spin=0.2)
    store.set("channel-built", "1")
    peer.join(timeout=30)
    start = time.perf_counter()
    with pytest.raises(t.SpeculatorUnavailable):
        channel.recv(timeout=30)
    assert time.perf_counter() - start < 10  # the broken link, not the 30 s timeout


def test_a_deferred_post_is_made_by_the_answer():
    """After a request received with ``defer_post``, a message the peer sends before the answer waits for it (the
    documented price); the answer's send posts the receive and that message then arrives."""
    verifier, speculator, _store = _pair()
    sent = threading.Event()
    thread = _send_later(verifier, p.encode_propose([SpecRequest(0, -1, 0, 3)]), 0.0)
    assert p.decode_propose(speculator.recv(timeout=10, defer_post=(p.PROPOSE,)))[0].num_accepted == -1
    thread.join()
    early = threading.Thread(target=lambda: (verifier.send(p.encode_remove(5)), sent.set()))
    early.start()
    assert not sent.wait(0.3)  # no receive posted for it yet
    speculator.send(p.Message(p.ERROR))  # the answer: posts the next frame's receive once it is out
    assert verifier.recv(timeout=10, defer_post=(p.ERROR,)).command == p.ERROR
    assert sent.wait(10)
    early.join()
    assert p.decode_remove(speculator.recv(timeout=10)) == 5
    start = time.perf_counter()  # not deferred: posted at once, so a send to a busy peer returns
    verifier.send(p.encode_remove(6))
    assert time.perf_counter() - start < 0.2
    assert p.decode_remove(speculator.recv(timeout=10)) == 6


class _PostWhileReading(list):
    """A channel's frame views that, the first time a header is read, have another thread post a receive (as a
    send from another thread does once its message is out) and give it 0.3 s."""

    def __init__(self, channel: t.Channel):
        super().__init__(channel._words)
        self.channel, self.racer = channel, None

    def __getitem__(self, index):
        if self.racer is None:
            self.racer = threading.Thread(target=self.channel.post)
            self.racer.start()
            self.racer.join(0.3)
        return super().__getitem__(index)


def test_a_post_from_another_thread_waits_while_a_message_is_read():
    """Regression (a CI run of stop 25): a send on one thread posted the next receive into the frame another
    thread's ``recv`` had just completed but not read yet, zeroing its version word (``ProtocolMismatch``: "the
    peer speaks SSD protocol version 0")."""
    verifier, speculator, _store = _pair()
    verifier._words = racing = _PostWhileReading(verifier)
    speculator.send(p.encode_remove(3))
    assert p.decode_remove(verifier.recv(timeout=10)) == 3
    racing.racer.join(10)
    assert not racing.racer.is_alive()
    for n in (4, 5):  # the link still pairs every message with its frame
        speculator.send(p.encode_remove(n))
        assert p.decode_remove(verifier.recv(timeout=10)) == n


def test_sends_from_two_threads_share_the_channel_and_arrive_whole():
    verifier, speculator, _store = _pair(torch.bfloat16)
    sent = {n: [SpecRequest(n, 1, n, 4, torch.randn(2, 8 + n, dtype=torch.bfloat16), [n])] for n in range(40)}

    def sender(ns):
        for n in ns:
            verifier.send(p.encode_propose(sent[n]))

    threads = [threading.Thread(target=sender, args=(range(k, 40, 2),)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    got = [p.decode_propose(speculator.recv(timeout=10)) for _ in range(40)]
    for thread in threads:
        thread.join()
    assert sorted(r[0].slot for r in got) == list(range(40))
    for requests in got:
        assert_same_requests(requests, [SpecRequest(r.slot, r.num_accepted, r.bonus, r.budget, r.aux.float(),
                                                    r.accepted) for r in sent[requests[0].slot]])


def test_a_bf16_aux_crosses_exactly_in_one_row_and_in_several():
    """Floats are converted to the link's dtype in the send frame itself (one row's aux, or several concatenated)."""
    verifier, speculator, _store = _pair(torch.bfloat16)
    one = [SpecRequest(0, 2, 7, 5, torch.randn(3, 1728, dtype=torch.bfloat16), [4, 5])]
    two = one + [SpecRequest(1, 0, 3, 5, torch.randn(1, 1728, dtype=torch.bfloat16), [])]
    for requests in (one, two, one):
        thread = _send_later(verifier, p.encode_propose(requests), 0.0)
        got = p.decode_propose(speculator.recv(timeout=10))
        thread.join()
        assert_same_requests(got, [SpecRequest(r.slot, r.num_accepted, r.bonus, r.budget, r.aux.float(),
                                               r.accepted) for r in requests])


def test_the_speculators_end_waits_for_a_request_longer_than_its_join_may_take():
    """An idle server: the speculator's receive has no timeout of its own, and gloo used the pair group's (the
    join's ``startup_timeout``, 300 s by default), then closed the pair for good: an idle speculator died after 5
    minutes and was respawned (found in review)."""
    from types import SimpleNamespace

    from ssd_eagle.ssd.worker import join_link

    store = t.open_store(0, timeout=30)
    settings = SimpleNamespace(store_port=store.port, dist_backend="gloo", float_dtype=torch.float32, cpus=None)
    ends = {}
    joiner = threading.Thread(target=lambda: ends.update(link=join_link(settings, torch.device("cpu"), 1.0)))
    joiner.start()
    verifier = t.Channel(t.pair_group(store, t.VERIFIER, timeout=30), t.SPECULATOR)
    joiner.join()
    speculator, _speculator_store = ends["link"]
    thread = _send_later(verifier, p.encode_remove(5), 2.0)  # twice the join's timeout
    assert p.decode_remove(speculator.recv()) == 5
    thread.join()
