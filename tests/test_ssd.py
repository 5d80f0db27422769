"""SSD / Saguaro: losslessness (greedy and the output law at T > 0) with cache hits and misses, the exact
(k, bonus) cache key, and the speculator in its own process (overlap, and death mid-request)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from helpers import (LAW_TOKENS, LAW_VOCAB, exact_law, make_tiny_llama, noisy_copy, pooled_chisquare, random_prompts,
                     reference_greedy)
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd import build_ssd_drafter
from ssd_eagle.ssd.speculator import SpecRequest

K = 4


def ssd_engine(target, draft, tokenizer, speculator="local", max_num_seqs=4, k=K, **spec):
    spec = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": k, "fanout": [2],
            "speculator": speculator, **spec}
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=max_num_seqs, max_model_len=512,
                       speculative_config=SpeculativeConfig(**spec))
    drafter = build_ssd_drafter(cfg, target, draft=draft)
    return LLMEngine(target, tokenizer, drafter, num_speculative_tokens=k, max_num_seqs=max_num_seqs,
                     max_model_len=512)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(fanout_strategy="geometric", fanout_budget=10, fanout_acceptance=0.6, fanout_power=1.0),
    dict(backup="fast", fanout=[1, 2, 1, 1, 3]),
    dict(saguaro_c=0.5, fanout_miss=[3]),
], ids=["uniform", "geometric", "fast_backup", "saguaro"])
def test_greedy_output_equals_target_greedy_with_hits_and_misses(variant, byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, **variant)
    prompts = random_prompts(8, seed=1)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 24)
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups - stats.cache_hits > 0, "hits and misses must both occur"
    assert max(stats.accepted_lengths) >= 2


def test_a_hit_requires_the_exact_outcome(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()  # prefill + first round (no lookup), then the cache is built
    seq = speculator.seqs[engine.requests["a"].slot]
    proposal = seq.proposal.tokens
    cached = sorted(seq.cache)
    assert cached and all(b in seq.candidates[path] for path, b in cached)
    (path, bonus) = cached[0]
    k = len(path)
    assert path == tuple(proposal[:k])
    not_cached = next(t for t in range(257) if (path, t) not in seq.cache)
    snapshot, base_tokens, base_cached = dict(seq.cache), list(seq.token_ids), seq.num_cached

    def lookup(k_: int, b_: int) -> bool:
        seq.cache, seq.token_ids, seq.num_cached = dict(snapshot), list(base_tokens), base_cached
        return speculator._commit(seq, SpecRequest(seq.slot, k_, b_, K))

    assert lookup(k, bonus) is True
    assert lookup(k, not_cached) is False
    other_k = next(kk for kk in range(K + 1) if (tuple(proposal[:kk]), bonus) not in snapshot)
    assert lookup(other_k, bonus) is False


# ---------------------------------------------------------------------------------------------------------------
# the output law at T > 0 on a 4-token vocabulary

V, T_OUT, N_REQ = LAW_VOCAB, LAW_TOKENS, 4000


@pytest.mark.parametrize("variant", [
    dict(),
    dict(saguaro_c=0.3, fanout=[1]),
    dict(backup="fast", fanout_strategy="geometric", fanout_budget=4, fanout_acceptance=0.5),
], ids=["neural_backup_uniform", "saguaro", "fast_backup_geometric"])
def test_output_law_equals_the_targets(variant, byte_tokenizer):
    target = make_tiny_llama(vocab_size=V, seed=6, init_std=0.15)
    draft = noisy_copy(target, 0.5, seed=9)
    engine = ssd_engine(target, draft, byte_tokenizer, max_num_seqs=128, k=2, **variant)
    prompt = [1, 3, 0, 2, 2]
    temperature = 0.9
    params = [SamplingParams(temperature=temperature, max_tokens=T_OUT, ignore_eos=True, seed=i)
              for i in range(N_REQ)]
    outs = LLM(engine=engine).generate([prompt] * N_REQ, params)
    flat = np.array([sum(t * V ** (T_OUT - 1 - j) for j, t in enumerate(o.token_ids)) for o in outs])
    counts = np.bincount(flat, minlength=V**T_OUT)
    stats = engine.stats
    assert stats.cache_hits > 50 and stats.cache_lookups - stats.cache_hits > 50, "need hits and misses"
    assert pooled_chisquare(counts, exact_law(target, prompt, temperature)) > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the speculator as its own process

class SlowTarget:
    """Wraps a model runner's forward: sleeps, and records the wall-clock interval of every verification."""

    def __init__(self, runner, delay: float):
        self.forward, self.delay, self.intervals = runner.forward, delay, []

    def __call__(self, batch, **kwargs):
        start = time.time()
        time.sleep(self.delay)
        out = self.forward(batch, **kwargs)
        self.intervals.append((start, time.time()))
        return out


def test_speculator_process_overlaps_verification_and_is_lossless(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process")
    try:
        slow = SlowTarget(engine.target, delay=0.05)
        engine.target.forward = slow
        prompts = random_prompts(3, seed=4)
        outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(target, prompt, 20)
        stats, build_intervals = engine.drafter.speculator.stats()
        assert stats.hits > 0
        builds = list(zip(build_intervals[::2], build_intervals[1::2]))
        overlapping = sum(any(bs < ve and vs < be for vs, ve in slow.intervals) for bs, be in builds)
        assert overlapping >= len(builds) // 2, f"only {overlapping} of {len(builds)} builds overlapped a verify"
    finally:
        engine.drafter.close()


def test_killing_the_speculator_mid_request_still_completes_it(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, speculator="process",
                        speculator_timeout=20.0)
    try:
        prompt = [9, 8, 7, 6, 5]
        engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine.drafter.healthy
        engine.drafter.speculator.process.kill()
        engine.drafter.speculator.process.join(timeout=10)
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                final = out
        assert final.token_ids == reference_greedy(target, prompt, 40, eos=set())
        assert not engine.drafter.healthy
    finally:
        engine.drafter.close()


def test_a_backup_scales_with_the_miss_fanout_it_is_cached_with(byte_tokenizer, monkeypatch):
    """Saguaro scales the top-(F_k + 1) the speculator caches: a backup (after a miss) uses ``fanout_miss``."""
    import ssd_eagle.drafters.chain as chain_module

    seen = []
    original = chain_module.sample_draft_tokens

    def recording(logits, seqs, position, saguaro=None):
        seen.append((logits.shape[0], saguaro.fanout if saguaro is not None else None))
        return original(logits, seqs, position, saguaro)

    monkeypatch.setattr(chain_module, "sample_draft_tokens", recording)
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=1, saguaro_c=0.5,
                        fanout=[1], fanout_miss=[3])
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=3, seed=0, ignore_eos=True))
    engine.step()  # no cache yet: the first proposal is a backup; then the cache is built from it
    backup = [f for rows, f in seen if rows == 1]
    branches = [f for rows, f in seen if rows > 1]
    assert backup and all(f == (3,) * (K + 1) for f in backup)
    assert branches and all(f == (1,) * (K + 1) for f in branches)
