"""The power-law fit of the cache hit rate: censored at the stored candidates, it recovers a known r; with
``fanout_power: "auto"`` the speculator re-fits it online and re-makes its geometric fan-out (issue 13 item 5)."""

from __future__ import annotations

import random

import pytest

from helpers import make_tiny_llama, noisy_copy, random_prompts, reference_greedy
from ssd_eagle.config import SpeculativeConfig
from ssd_eagle.drafters.base import Proposal
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.fanout import OnlinePowerFit, fit_power_law, geometric_fanout, hit_rate_by_rank
from ssd_eagle.ssd.speculator import SpecRequest
from ssd_eagle.ssd.worker import SpeculatorSettings, build_speculator
from ssd_eagle.stats import SpecStats
from test_ssd import ssd_engine


def power_law_ranks(n: int, r: float, c: float, seed: int = 0) -> list[int]:
    """Bonus ranks with ``P(rank >= F) = c F^-r`` for F >= 1 (so P(rank = 0) = 1 - c)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        out.append(0 if u > c else int((u / c) ** (-1.0 / r)))
    return out


def test_censored_sample_recovers_known_r():
    true_r, c = 0.6, 0.7
    ranks = power_law_ranks(20000, true_r, c)
    rng = random.Random(1)
    stored = [rng.choice([2, 3, 4, 6]) for _ in ranks]  # what the speculator kept for each lookup
    censored = [r if r < s else -1 for r, s in zip(ranks, stored)]
    fs, hits = hit_rate_by_rank(censored, 16, stored)
    assert fs == [1, 2, 3, 4, 5, 6]  # nobody is at risk past the largest stored count
    fit = fit_power_law(fs, hits)
    assert fit.power == pytest.approx(true_r, abs=0.05) and fit.scale == pytest.approx(c, abs=0.03)
    # treating censored lookups as misses flattens the curve past the stored candidates and biases r down
    naive = fit_power_law(*hit_rate_by_rank(censored, 6))
    assert naive.power < true_r - 0.15


def test_uncensored_hit_rates_are_the_plain_fractions():
    fs, hits = hit_rate_by_rank([0, 1, -1, 0], 3, [4, 4, 4, 4])
    assert fs == [1, 2, 3] and hits == pytest.approx([0.5, 0.75, 0.75])
    with pytest.raises(ValueError, match="stored"):
        hit_rate_by_rank([0, 1], 3, [4])


def test_online_fit_waits_for_enough_lookups():
    fit = OnlinePowerFit(default=1.0, min_lookups=50)
    ranks = power_law_ranks(2000, 0.4, 0.8, seed=3)
    for r in ranks[:49]:
        fit.record(r if r < 5 else -1, 5)
    assert fit.power == 1.0
    for r in ranks[49:]:
        fit.record(r if r < 5 else -1, 5)
    assert fit.power == pytest.approx(0.4, abs=0.08)


# ---------------------------------------------------------------------------------------------------------------
# fanout_power: "auto" in the speculator and the config

def test_the_speculator_refits_its_fanout_after_50_lookups():
    """A synthetic stream of outcomes: accepted lengths k and bonus ranks among the stored candidates (censored).
    After 50 lookups the next build re-makes the fan-out geometric from the fitted r and the measured a."""
    K, start = 4, geometric_fanout(12, 4, 0.7, 1.0)
    draft = make_tiny_llama(seed=3)
    settings = SpeculatorSettings("draft_model", K, start, None, "neural", 8, 1.0, (1, 4), 1, 512,
                                  vocab_size=draft.config.vocab_size, fanout_power="auto")
    spec = build_speculator(settings, draft)
    spec.add(0, [5, 6, 7], SamplingParams(temperature=0.0), seed=0)
    seq = spec.seqs[0]
    rng = random.Random(4)
    ranks, stored, accepted, rejected = [], [], 0, 0
    for i, r in enumerate(power_law_ranks(60, 0.4, 0.8, seed=5)):
        k = rng.choice([0, 0, 1, 2, 4])
        seq.proposal, seq.source = Proposal([10, 11, 12, 13]), "neural"  # (a proposal the backup drafted)
        cands = [100 + j for j in range(start[k])]
        seq.candidates = {tuple(seq.proposal.tokens[:k]): cands}
        bonus = cands[r] if r < len(cands) else 99
        spec._commit(seq, SpecRequest(0, k, bonus, K))
        ranks.append(r if r < len(cands) else -1)
        stored.append(len(cands))
        accepted, rejected = accepted + k, rejected + (k < K)
        spec.build()  # nothing to build: only the refit
        if i < 49:
            assert spec.fanout == start and spec.stats.fanout_power is None
        if i == 49:
            power = min(max(fit_power_law(*hit_rate_by_rank(ranks, 32, stored)).power, 0.05), 5.0)
            fitted = geometric_fanout(12, K, accepted / (accepted + rejected), power)
            assert spec.fanout == spec.fanout_miss == fitted != start
            assert spec.stats.fanout_power == pytest.approx(power) and spec.power == spec.stats.fanout_power
    assert spec.fanout == fitted  # refits every 50 lookups: none yet at 60


def test_config_accepts_auto_and_names_fanout_power_in_errors():
    spec = SpeculativeConfig.from_dict({"fanout_power": "auto", "fanout_strategy": "geometric", "fanout_budget": 12})
    assert spec.fanout_power == "auto" and sum(spec.resolved_fanout()) == 12
    assert SpeculativeConfig.from_dict({"fanout_power": 2}).fanout_power == 2.0
    for bad in ({"fanout_power": "fast"}, {"fanout_power": -1.0}, {"fanout_power": 0}, {"fanout_power": True},
                {"fanout_power": "auto"}):  # the last: auto with the manual strategy has nothing to re-fit
        with pytest.raises(ValueError, match="fanout_power"):
            SpeculativeConfig.from_dict(bad)


def test_ssd_with_auto_fanout_stays_lossless_and_reports_r(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=2,
                        fanout_strategy="geometric", fanout_budget=10, fanout_power="auto")
    prompts = random_prompts(8, seed=1)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 24)
    stats, _ = engine.drafter.speculator.stats()
    assert stats.lookups >= 50 and stats.fanout_power is not None and 0.05 <= stats.fanout_power <= 5.0
    assert sum(engine.drafter.speculator.speculator.fanout) == 10
    # per request: the r fitted when its lookups ran (the last request's is the speculator's), and the branches
    # the cache held per lookup (at most the budget B = 10: a branch enters the cache once drafted to its end)
    summaries = [out.stats.summary() for out in outs]
    assert summaries[-1]["fanout_power"] == pytest.approx(stats.fanout_power, abs=1e-4)
    assert all(0 < s["fanout_per_lookup"] <= 10 for s in summaries)
    assert summaries[0]["fanout_power"] is None  # its lookups all ran before the 50th


def test_spec_stats_average_the_built_fanout_and_keep_the_latest_r():
    a, b = SpecStats(), SpecStats()
    a.record_lookup(0, True, 2, fanout=10, fanout_power=None)  # before the first fit
    a.record_lookup(1, False, 1, fanout=4, fanout_power=0.3)
    b.record_lookup(0, False, 1, fanout=7, fanout_power=0.25)
    assert a.summary()["fanout_per_lookup"] == 7.0 and a.summary()["fanout_power"] == 0.3
    total = a.merge(b).summary()
    assert total["fanout_per_lookup"] == 7.0 and total["fanout_power"] == 0.25
    assert SpecStats().merge(SpecStats()).fanout_power is None and "fanout_power" not in SpecStats().summary()
