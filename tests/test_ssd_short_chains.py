"""SSD with branch chains shorter than K (``BuildBudget.chain_depth`` < K: a draft whose K-token build does not fit
in a verification): a hit answers with a cached proposal of L < K tokens, whose q must be the law its tokens were
sampled from; greedy output still equals the target's greedy decode and the output law at T > 0 the target's."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import (LAW_TOKENS, LAW_VOCAB, exact_law, make_tiny_llama, noisy_copy, pooled_chisquare, random_prompts,
                     reference_greedy)
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.budget import BuildBudget


def short_chain_ssd(target, draft, tokenizer, depth: int, k: int, max_num_seqs: int, monkeypatch, **spec):
    """An in-process SSD engine whose speculator builds branch chains of ``depth`` tokens (K = ``k``)."""
    monkeypatch.setattr(BuildBudget, "chain_depth", lambda self, max_steps, min_branches: min(depth, max_steps))
    spec = {"method": "draft_model", "model": "in-memory", "num_speculative_tokens": k, "fanout": [2],
            "speculator": "local", **spec}
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=max_num_seqs, max_model_len=512,
                       speculative_config=SpeculativeConfig(**spec))
    return build(cfg, target, tokenizer=tokenizer, draft=draft)


def cached_lengths(speculator) -> list[int]:
    return [len(p.tokens) for s in speculator.seqs.values() for p in s.cache.values()]


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_with_chains_shorter_than_k_equals_target_greedy(depth, byte_tokenizer, monkeypatch):
    target = make_tiny_llama(seed=3)
    engine = short_chain_ssd(target, noisy_copy(target, 0.02), byte_tokenizer, depth, 4, 4, monkeypatch)
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
    V, T_OUT, N_REQ = LAW_VOCAB, LAW_TOKENS, 4000
    target = make_tiny_llama(vocab_size=V, seed=6, init_std=0.15)
    engine = short_chain_ssd(target, noisy_copy(target, 0.5, seed=9), byte_tokenizer, 1, 3, 128, monkeypatch,
                             **variant)
    prompt, temperature = [1, 3, 0, 2, 2], 0.9
    params = [SamplingParams(temperature=temperature, max_tokens=T_OUT, ignore_eos=True, seed=i)
              for i in range(N_REQ)]
    outs = LLM(engine=engine).generate([prompt] * N_REQ, params)
    flat = np.array([sum(t * V ** (T_OUT - 1 - j) for j, t in enumerate(o.token_ids)) for o in outs])
    counts = np.bincount(flat, minlength=V**T_OUT)
    stats = engine.stats
    assert stats.cache_hits > 50 and stats.cache_lookups - stats.cache_hits > 50, "need hits and misses"
    assert pooled_chisquare(counts, exact_law(target, prompt, temperature)) > 1e-4
