"""SSD with a draft LM (issue 13): the speculator's lookups hit exactly when the verifier's outcome is among the
bonus candidates it stored, and a draft LM whose K-token branch build cannot fit in a verification builds shorter
branch chains (``BuildBudget.chain_depth``) that still hit, where a K-token build cached nothing; greedy output
equals the target's own decode either way."""

from __future__ import annotations

import time

import pytest

from helpers import make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.budget import BuildBudget

K = 4


def draft_lm_ssd(target, draft, tokenizer, **spec):
    """An SSD engine, one sequence at a time, whose in-process speculator drafts with the causal LM ``draft``."""
    spec = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": K, "speculator": "local",
            "fanout_strategy": "geometric", "fanout_budget": 10, "fanout_acceptance": 0.6, **spec}
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=1, max_model_len=512,
                       speculative_config=SpeculativeConfig(**spec))
    return build(cfg, target, tokenizer=tokenizer, draft=draft)


def record_lookups(speculator) -> list[tuple[bool, bool]]:
    """Wraps ``speculator._commit``: per lookup (was the outcome among the stored candidates, did it hit)."""
    seen, commit = [], speculator._commit

    def recording(seq, req):
        path, bonus = speculator._key(seq, req)
        stored = bonus in seq.candidates.get(path, ())
        hit = commit(seq, req)
        seen.append((stored, hit))
        return hit

    speculator._commit = recording
    return seen


def greedy_matches(engine, target, prompts, max_tokens: int = 24) -> None:
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, max_tokens)


def test_a_draft_lm_hits_exactly_when_the_outcome_is_a_stored_candidate(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = draft_lm_ssd(target, noisy_copy(target, 0.05), byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    lookups = record_lookups(speculator)
    greedy_matches(engine, target, random_prompts(6, seed=5))
    assert all(stored == hit for stored, hit in lookups), lookups  # builds run to their end in-process
    hits = sum(hit for _, hit in lookups)
    assert hits > 0 and len(lookups) - hits > 0, "hits and misses must both occur"
    assert (speculator.stats.hits, speculator.stats.lookups) == (hits, len(lookups))
    assert engine.stats.cache_hits > 0  # (the engine counts only the rounds that asked for drafts)


def test_chain_depth_is_the_longest_build_that_fits_against_hand_computed_numbers():
    budget = BuildBudget(margin=0.8)
    assert budget.chain_depth(5, 12) == 5  # nothing measured: K
    budget.observe_build(1.0, 8, 5, 1.0)  # the first build (warm-up) is not observed
    for n in (4, 8, 4, 8):  # a forward costs 20 ms + 1 ms a branch; the proposal's forward 20 ms
        budget.observe_build(20e-3, n, 5, 5 * (20e-3 + 1e-3 * n))
    budget.observe_verify(100e-3)
    # 80 ms - 20 ms fixed = 60 ms: L steps of (20 + n) ms fit n <= 60 / L - 20 branches: L=1: 40, L=2: 10, L=3: 0
    assert budget.cap(1) == 40 and budget.cap(2) == 10 and budget.cap(3) == 0
    assert budget.chain_depth(5, 12) == 1
    assert budget.chain_depth(5, 10) == 2
    assert budget.chain_depth(5, 1) == 2
    assert budget.chain_depth(1, 1) == 1
    budget.verify_s = 30e-3  # not even one branch of one token fits: one token (the cap then probes)
    assert budget.chain_depth(5, 1) == 1


class SlowDraft:
    """Wraps a draft backend's forward: every forward sleeps ``seconds`` first (a draft-LM step on a CPU, where it
    costs a fifth of a verification, not the EAGLE-3 head's twentieth)."""

    def __init__(self, forward, seconds: float):
        self.inner, self.seconds = forward, seconds

    def __call__(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("fixed_depth", [False, True], ids=["time_sized_depth", "k_token_branches"])
def test_a_draft_lm_slower_than_a_fifth_of_a_verification_builds_shorter_chains_that_hit(fixed_depth,
                                                                                           byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = draft_lm_ssd(target, noisy_copy(target, 0.02), byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    speculator.backend.forward = SlowDraft(speculator.backend.forward, 25e-3)
    verify_s = 0.12  # what the worker measures; set here since the speculator runs in-process
    speculator.budget.observe_verify(verify_s)
    if fixed_depth:  # the build before chain_depth: always K tokens per branch
        speculator.budget.chain_depth = lambda max_steps, min_branches: max_steps
    builds, build = [], speculator.build  # per build: (seconds, longest cached proposal)

    def timed_build(*args, **kwargs):
        start = time.perf_counter()
        build(*args, **kwargs)
        cached = [len(p.tokens) for s in speculator.seqs.values() for p in s.cache.values()]
        builds.append((time.perf_counter() - start, max(cached, default=0)))

    speculator.build = timed_build
    greedy_matches(engine, target, random_prompts(3, seed=2))
    # a K-token build is the proposal's forward + K = 4 branch forwards, >= 125 ms: past 0.8 x 120 ms with one branch
    later = builds[3:]
    if fixed_depth:  # the cap then builds no branch, but one every probe_every builds: hardly any hits
        assert sum(n > 0 for _, n in later) <= len(later) // speculator.budget.probe_every + 1, builds
        return
    assert later and all(0 < n < K for _, n in later), builds  # 3 forwards (75 ms) fit: chains of 2 tokens
    assert sorted(s for s, _ in later)[len(later) // 2] <= verify_s, builds
    stats = speculator.stats
    assert stats.hits >= 0.3 * stats.lookups, (stats.hits, stats.lookups)
