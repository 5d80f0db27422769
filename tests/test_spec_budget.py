"""Time-sized builds of the speculation cache (issue 13 item 2): the branch cap, the cost model it reads, and an SSD
engine whose draft is made slow, which must cap its branches, fit its builds in the verification budget and stay
lossless; the worker's measure of the verification while a longer build runs; and the verifier's wait per round on
hits and on misses."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.drafters.base import Proposal
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd import protocol as p
from ssd_eagle.ssd.budget import BuildBudget, branch_cap
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import serve
from ssd_eagle.stats import SpecStats
from test_ssd import K, ssd_engine
from test_ssd_protocol import _pair


def test_branch_cap_against_hand_computed_numbers():
    # 0.8 * 10 ms - 1 ms fixed - 4 forwards * 0.5 ms = 5 ms left; a branch costs 4 * 0.25 ms = 1 ms -> 5 branches
    assert branch_cap(10e-3, 1e-3, 4, 0.5e-3, 0.25e-3, margin=0.8) == 5
    # 0.8 * 12 ms - 2 ms - 3 * 1 ms = 4.6 ms; 3 * 0.5 ms = 1.5 ms a branch -> 3 branches (4.5 ms)
    assert branch_cap(12e-3, 2e-3, 3, 1e-3, 0.5e-3, margin=0.8) == 3
    assert branch_cap(5e-3, 1e-3, 4, 1e-3, 0.1e-3) == 0  # the fixed costs alone overrun the budget
    assert branch_cap(5e-3, 0.0, 4, 0.0, 0.0) >= 1 << 20  # branches cost nothing: no cap
    with pytest.raises(ValueError, match="margin"):
        branch_cap(1.0, 0.0, 1, 0.0, 1.0, margin=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        branch_cap(-1.0, 0.0, 1, 0.0, 1.0)


def test_build_budget_fits_the_per_forward_cost_and_caps():
    budget = BuildBudget(margin=0.8)
    assert budget.cap() is None  # nothing measured: no cap
    budget.observe_build(1.0, 10, 4, 9.0)  # the first build (warm-up) is not observed
    assert budget.forward_cost() == (0.0, 0.0)
    budget.observe_build(2e-3, 10, 4, 4 * (1e-3 + 0.5e-3 * 10))
    assert budget.forward_cost() == pytest.approx((0.0, 0.6e-3))  # one branch count seen: proportional
    assert budget.cap() is None  # no verification measured yet
    for n in (4, 8, 4, 8, 6):
        budget.observe_build(2e-3, n, 4, 4 * (1e-3 + 0.5e-3 * n))
    a, b = budget.forward_cost()
    assert a == pytest.approx(1e-3) and b == pytest.approx(0.5e-3)
    budget.observe_verify(20e-3)
    # 0.8 * 20 - 2 - 4 * 1 = 10 ms; 4 * 0.5 ms = 2 ms a branch -> 5
    assert budget.cap() == 5
    budget.observe_verify(0.0)  # the EMA: 0.8 * 20 ms = 16 ms
    assert budget.verify_s == pytest.approx(16e-3)
    budget.verify_s = 5e-3  # not even one branch fits: no branch, but one per row every probe_every builds
    assert [budget.cap() for _ in range(2 * budget.probe_every)] == ([0] * (budget.probe_every - 1) + [1]) * 2


def greedy_with_hits_and_misses(engine, target, prompts: list[list[int]], max_tokens: int = 24) -> None:
    """Greedy SSD output equals the target's own decode, and the speculation cache both hit and missed."""
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, max_tokens)
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups > stats.cache_hits, "hits and misses must both occur"


class SlowForward:
    """Wraps a draft backend's forward: sleeps ``fixed + per_token * tokens`` seconds first."""

    def __init__(self, forward, fixed: float, per_token: float):
        self.inner, self.fixed, self.per_token = forward, fixed, per_token

    def __call__(self, batch, *args, **kwargs):
        time.sleep(self.fixed + self.per_token * batch.input_ids.numel())
        return self.inner(batch, *args, **kwargs)


def test_a_slow_draft_caps_its_branches_fits_the_budget_and_stays_lossless(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=1)
    speculator = engine.drafter.speculator.speculator
    speculator.backend.forward = SlowForward(speculator.backend.forward, 2e-3, 3e-3)
    verify_s = 0.1  # what the worker's serve loop measures; set here since the speculator runs in-process
    speculator.budget.observe_verify(verify_s)
    builds = []  # (seconds, cache entries built, longest cached chain)
    build = speculator.build

    def timed_build(*args, **kwargs):
        start = time.perf_counter()
        build(*args, **kwargs)
        cached = [s.cache for s in speculator.seqs.values()]
        builds.append((time.perf_counter() - start, max(map(len, cached), default=0),
                       max((len(p.tokens) for c in cached for p in c.values()), default=0)))

    speculator.build = timed_build
    greedy_with_hits_and_misses(engine, target, random_prompts(3, seed=2))
    full = (K + 1) * 2  # fan-out [2] at every node of a K-chain
    # full fan-out sleeps ~17 ms (proposal forward) + 4 forwards * 32 ms: far past the 100 ms verification
    assert builds[0][1:] == (full, K) and builds[0][0] > verify_s
    later = [b for b in builds[3:] if b[1]]  # capped: fewer branches, or shorter chains (BuildBudget.chain_depth)
    assert later and all(n < full or depth < K for _, n, depth in later), builds
    assert sorted(s for s, _, _ in later)[len(later) // 2] <= verify_s, builds


def test_wait_on_hit_and_on_miss_are_recorded_merged_and_summarised(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer)
    outs = LLM(engine=engine).generate(random_prompts(4, seed=1), SamplingParams(temperature=0.0, max_tokens=16))
    total = SpecStats()
    for out in outs:
        total.merge(out.stats)
    assert total.rounds_on_hit > 0 and total.rounds_on_miss > 0
    assert total.rounds_on_hit + total.rounds_on_miss == total.cache_lookups
    assert total.wait_on_hit > 0 and total.wait_on_miss > 0
    summary = total.summary()
    assert summary["rounds_on_hit"] == total.rounds_on_hit
    assert summary["wait_on_hit_ms"] == pytest.approx(1e3 * total.wait_on_hit / total.rounds_on_hit, abs=1e-3)
    assert summary["wait_on_miss_ms"] == pytest.approx(1e3 * total.wait_on_miss / total.rounds_on_miss, abs=1e-3)


def test_record_lookup_splits_the_wait_by_outcome():
    stats = SpecStats()
    stats.record_lookup(2, True, 3, wait=0.001)
    stats.record_lookup(0, False, 1, wait=0.004)
    stats.record_lookup(1, False, 2, wait=0.002)
    assert (stats.wait_on_hit, stats.rounds_on_hit) == (pytest.approx(0.001), 1)
    assert (stats.wait_on_miss, stats.rounds_on_miss) == (pytest.approx(0.006), 2)
    assert stats.summary()["wait_on_miss_ms"] == pytest.approx(3.0)


class SlowBuildSpeculator:
    """A speculator whose build takes 60 ms in six steps, polling between them (as the branch forwards do)."""

    def __init__(self):
        self.budget, self.seqs = BuildBudget(), {}

    def peek(self, requests):
        return None

    def propose(self, requests):
        return [Proposal([]) for _ in requests]

    def observe_verify(self, seconds):
        self.budget.observe_verify(seconds)

    def build(self, poll):
        for _ in range(6):
            time.sleep(0.01)
            poll()


def test_serve_measures_the_verification_not_the_longer_build():
    verifier, speculator_end, _store = _pair()
    assert not speculator_end.poll()  # nothing sent yet (posts the header's receive)

    def verify_rounds():
        for _ in range(4):
            verifier.send(p.encode_propose([SpecRequest(0, -1, 0, 3)]))
            verifier.recv(timeout=10)
            time.sleep(0.02)  # the verification
        verifier.send(p.Message(p.SHUTDOWN))

    thread = threading.Thread(target=verify_rounds)
    thread.start()
    fake = SlowBuildSpeculator()
    serve(fake, speculator_end, [])
    thread.join()
    # PROPOSE arrives 20 ms after the reply, within the 60 ms build: noticed at the next poll (<= 10 ms later)
    assert 0.015 <= fake.budget.verify_s <= 0.045
