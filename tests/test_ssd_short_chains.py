"""SSD with branch chains shorter than K (``BuildBudget.chain_depth`` < K: a draft whose K-token build does not fit
in a verification): a hit answers with a cached proposal of L < K tokens, whose q must be the law its tokens were
sampled from; greedy output still equals the target's greedy decode and the output law at T > 0 the target's."""

from __future__ import annotations

import pytest

import test_ssd
from helpers import make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.budget import BuildBudget


def short_chains(monkeypatch, depth: int) -> None:
    """Every build's branch chains are ``depth`` tokens (at most K)."""
    monkeypatch.setattr(BuildBudget, "chain_depth", lambda self, max_steps, min_branches: min(depth, max_steps))


def cached_lengths(speculator) -> list[int]:
    return [len(p.tokens) for s in speculator.seqs.values() for p in s.cache.values()]


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_with_chains_shorter_than_k_equals_target_greedy(depth, byte_tokenizer, monkeypatch):
    target = make_tiny_llama(seed=3)
    short_chains(monkeypatch, depth)
    engine = test_ssd.ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer)  # K = 4
    speculator = engine.drafter.speculator.speculator
    lengths, build_ = [], speculator.build

    def recording(*args, **kwargs):
        done = build_(*args, **kwargs)
        lengths.extend(cached_lengths(speculator))
        return done

    speculator.build = recording
    prompts = random_prompts(6, seed=1)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 24)
    assert lengths and set(lengths) == {depth}
    assert engine.stats.cache_hits > 0


@pytest.mark.parametrize("variant", [dict(), dict(saguaro_c=0.3, fanout=[1])], ids=["plain", "saguaro"])
def test_output_law_with_chains_shorter_than_k_equals_the_targets(variant, byte_tokenizer, monkeypatch):
    """test_ssd's chi-square law test (K = 2) with one-token branch chains."""
    short_chains(monkeypatch, 1)
    test_ssd.test_output_law_equals_the_targets(variant, byte_tokenizer)
