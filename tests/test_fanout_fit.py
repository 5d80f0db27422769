"""The power-law fit of the cache hit rate: censored at the stored candidates, it recovers a known r."""

from __future__ import annotations

import random

import pytest

from ssd_eagle.ssd.fanout import OnlinePowerFit, fit_power_law, hit_rate_by_rank


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
