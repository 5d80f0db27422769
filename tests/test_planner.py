"""The planner picks the draft length that maximises expected tokens per second (hand-computed tables)."""

from __future__ import annotations

import pytest

from conftest import make_tiny_llama
from ssd_eagle.planner import (Acceptance, CostTable, OnlineLine, Planner, PlannerConfig, expected_tokens,
                               measure_verify_costs)


def planner_with(verify: list[float], rate: float, max_k: int = 5, rounds: int = 200, **kw) -> Planner:
    """A planner whose one request has accepted each position with probability ``rate`` (exact counts)."""
    planner = Planner(PlannerConfig(max_k=max_k, **kw), CostTable({1: verify}))
    acc = Acceptance(decay=1.0)
    acc.tried = [float(rounds)] * max_k
    acc.accepted = [rate * rounds] * max_k
    planner.acceptance["r"] = acc
    planner.engine_wide = acc
    return planner


def test_expected_tokens():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_no_speculation_when_verification_costs_grow_linearly():
    # V(n) = n: K=1 gives 1.3 tokens / 2 s < 1 token / s
    planner = planner_with([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], rate=0.3)
    assert planner.choose(["r"]) == {"r": 0}


def test_middle_k():
    # V(n) = 1 + 0.25 (n - 1), a = 0.6: rates 1, 1.28, 1.307, 1.243, 1.136, 1.016 (K = 0..5) -> K = 2
    planner = planner_with([1.0, 1.25, 1.5, 1.75, 2.0, 2.25], rate=0.6)
    assert planner.rate(2, ["r"]) == pytest.approx(1.96 / 1.5, rel=1e-2)
    assert planner.choose(["r"]) == {"r": 2}


def test_largest_k_when_verification_is_flat():
    planner = planner_with([1.0] * 6, rate=0.9)
    assert planner.choose(["r"]) == {"r": 5}


def test_explicit_k_chooses_only_between_off_and_k():
    planner = planner_with([1.0, 1.25, 1.5, 1.75, 2.0, 2.25], rate=0.6, choose_k=False)
    assert planner.choose(["r"]) == {"r": 5}  # 1.136 tokens/s beats plain decoding's 1.0
    planner = planner_with([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], rate=0.6, choose_k=False)
    assert planner.choose(["r"]) == {"r": 0}


def test_not_adaptive_always_drafts_k():
    planner = planner_with([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], rate=0.0, adaptive=False)
    assert planner.choose(["r"]) == {"r": 5}


def test_draft_cost_counts():
    # flat verification but a draft step as expensive as a verification: K = 1 costs 2 s for 1.9 tokens
    planner = planner_with([1.0] * 6, rate=0.9)
    for k in range(1, 6):
        planner.draft_cost.update(k, 1.0 * k)
    assert planner.choose(["r"]) == {"r": 0}


def test_a_drafter_that_never_matches_ends_in_plain_decoding_and_a_probe_brings_a_good_one_back():
    planner = Planner(PlannerConfig(max_k=4, probe_every=4, probe_k=2), CostTable({1: [1.0, 1.05, 1.1, 1.15, 1.2]}))
    ks = []
    for _ in range(40):  # a useless drafter: nothing accepted
        k = planner.choose(["r"])["r"]
        ks.append(k)
        planner.observe({"r": (k, 0)}, 0.0, 1.0, k + 1)
    assert ks[-8:].count(0) >= 6 and max(ks[-8:]) <= 2  # plain decoding, with short probes
    for _ in range(40):  # the drafter starts matching everything
        k = planner.choose(["r"])["r"]
        planner.observe({"r": (k, k)}, 0.0, 1.0, k + 1)
    assert planner.choose(["r"])["r"] == 4
    assert sum(planner.decisions.values()) == 81 and planner.decisions.get(0, 0) > 0


def test_online_line_recovers_a_line_and_handles_one_point():
    line = OnlineLine(decay=1.0)
    assert line.predict(3, default=7.0) == 7.0
    line.update(2, 4.0)
    assert line.predict(4) == pytest.approx(8.0)  # proportional through the one point
    for x in range(1, 6):
        line.update(x, 0.5 + 0.25 * x)
    line2 = OnlineLine(decay=1.0)
    for x in range(1, 6):
        line2.update(x, 0.5 + 0.25 * x)
    assert line2.predict(8) == pytest.approx(2.5)


def test_cost_table_buckets_extrapolation_and_json():
    table = CostTable({1: [1.0, 1.5], 4: [2.0, 3.0]}, key="k")
    assert table.verify_time(1, 1) == 1.0
    assert table.verify_time(4, 1) == pytest.approx(2.5)  # last slope 0.5 per token
    assert table.verify_time(2, 3) == 3.0  # bucket 4
    assert table.verify_time(1, 8) == pytest.approx(4.0)  # beyond the largest bucket: linear in B
    assert CostTable.from_json(table.to_json()) == table


def test_measure_verify_costs_on_a_tiny_model_is_cached(tmp_path, monkeypatch):
    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=3, max_len=256)
    table = measure_verify_costs(runner, max_new=3, max_batch=2, context=16, repeats=1)
    assert sorted(table.verify) == [1, 2] and all(len(v) == 3 and min(v) > 0 for v in table.verify.values())
    files = list((tmp_path / "ssd_eagle" / "costs").glob("*.json"))
    assert len(files) == 1 and table.key in files[0].name
    assert measure_verify_costs(runner, max_new=3, max_batch=2, context=16) == table  # read back, not re-timed
