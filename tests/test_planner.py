"""The planner picks the draft length that maximises expected tokens per second (hand-computed tables)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_drafter, make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.planner import (MIN_ROUNDS, Acceptance, CostTable, OnlineLine, Planner, PlannerConfig,
                               expected_tokens, greedy_chain_record, measure_draft_costs, measure_verify_costs,
                               tree_record)


def planner_with(verify: list[float], rate: float, max_k: int = 5, rounds: int = 200, **kw) -> Planner:
    """A planner whose one request has accepted each position with probability ``rate`` (exact counts)."""
    planner = Planner(PlannerConfig(max_k=max_k, **kw), CostTable({1: verify}))
    learnt = planner.learnt(planner.shapes()[-1])  # (a tree's, for a tree planner)
    acc = Acceptance(decay=1.0)
    acc.tried = [float(rounds)] * max_k
    acc.accepted = [rate * rounds] * max_k
    learnt.acceptance["r"] = acc
    learnt.engine_wide = acc
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


def test_a_tree_is_planned_on_or_off_at_its_width():
    """A depth-3, 8-node tree whose accepted path reaches each depth with 0.8: E = 1 + 0.8 + 0.64 + 0.512 = 2.952
    tokens a round, verifying 9 tokens. Flat verification: the whole tree (not a shallower one, whatever choose_k
    says); V(9) = 3.5 V(1): 0.84 tokens per V(1), so plain decoding; a probe is a whole tree."""
    flat = planner_with([1.0] * 9, rate=0.8, max_k=3, tree_nodes=8)
    assert flat.config.choose_k and flat.choose(["r"]) == {"r": 3}
    assert flat.rate(3, ["r"], tree=8) == pytest.approx(2.952, rel=1e-3)
    steep = planner_with([1.0] * 8 + [3.5], rate=0.8, max_k=3, tree_nodes=8, probe_every=2, probe_overhead=10.0)
    assert steep.rate(3, ["r"], tree=8) == pytest.approx(2.952 / 3.5, rel=1e-3) and steep.probe_length(8) == 3
    assert [steep.decide(["r"])["r"] for _ in range(3)] == [(0, False), (3, True), (0, False)]


def measured_planner(chain_rate: float, tree_rate: float, **kw) -> Planner:
    """A depth-3, 6-node tree drafter whose chains compete (chains of 1..3), flat verification up to 7 tokens, free
    drafting; one request whose chains accept each position with ``chain_rate`` and whose tree reaches each depth
    with ``tree_rate`` (exact counts)."""
    planner = Planner(PlannerConfig(max_k=3, tree_nodes=6, chains=True, **kw), CostTable({1: [1.0] * 7}))
    for tree, rate in ((0, chain_rate), (6, tree_rate)):
        acc = Acceptance(tried=[200.0] * 3, accepted=[200.0 * rate] * 3, decay=1.0)
        planner.learnt(tree).acceptance["r"] = acc
        planner.learnt(tree).engine_wide = acc
    return planner


def test_an_sd_tree_drafter_drafts_the_shape_that_pays():
    """Greedy rows, where the tree reaches each depth with 0.8 (E = 1 + 0.8 + 0.64 + 0.512 = 2.952) and a chain
    accepts each position with 0.6 (E(3) = 1 + 0.6 + 0.36 + 0.216 = 2.176), at the same verify cost: the tree.
    Sampled rows, where the tree's deterministic children match less often than a chain sampled from q (0.5 against
    0.8: E = 1.875 against 2.952): a chain of 3. Verification that costs 1.5 s past 4 tokens makes a 7-token tree
    round dearer than a 3-chain's (2.952 / 1.5 < 2.176 / 1): the chain again."""
    greedy = measured_planner(chain_rate=0.6, tree_rate=0.8)
    assert greedy.choose(["r"]) == {"r": 3} and greedy.tree_round
    assert greedy.rate(3, ["r"], tree=6) == pytest.approx(2.952, rel=1e-3)
    assert greedy.rate(3, ["r"]) == pytest.approx(2.176, rel=1e-3)
    sampled = measured_planner(chain_rate=0.8, tree_rate=0.5)
    assert sampled.choose(["r"]) == {"r": 3} and not sampled.tree_round
    wide = measured_planner(chain_rate=0.6, tree_rate=0.8)
    wide.costs = CostTable({1: [1.0] * 4 + [1.5] * 3})
    assert wide.choose(["r"]) == {"r": 3} and not wide.tree_round
    assert greedy.summary()["tree_rounds"] == 1 and sampled.summary()["tree_rounds"] == 0


def test_chains_are_measured_on_exploring_rounds_and_take_over_where_they_pay():
    """A tree drafter starts with its tree (chains unmeasured); round 8 explores a chain of max_k, which accepts
    everything where the tree reached depth 1 only: chains become the plan, and the tree is explored in its turn
    (8 and 24 rounds after the switch: the interval doubles while the plan holds)."""
    planner = Planner(PlannerConfig(max_k=3, tree_nodes=6, chains=True, probe_overhead=1.0),
                      CostTable({1: [1.0] * 7}))
    shapes = []
    for _ in range(40):
        k = planner.choose(["r"])["r"]
        tree = planner.tree_round
        shapes.append("tree" if tree else f"chain{k}")
        planner.observe({"r": (k, 1 if tree else k)}, 0.0, 1.0, 7 if tree else k + 1)
    assert shapes[:7] == ["tree"] * 7 and shapes[7] == "chain3" and shapes[8:15] == ["chain3"] * 7
    assert [i for i, s in enumerate(shapes) if s == "tree" and i > 7] == [15, 31]
    assert planner.tree_rounds == 9 and planner.explored == 3


def test_rows_without_room_to_draft_spend_no_exploring_round():
    """A row at its max_tokens (budget 0) decodes plainly and is not planned: its rounds neither explore (the
    exploring round would draft nothing and still double the interval) nor count as decisions."""
    from types import SimpleNamespace

    from ssd_eagle.stats import SpecStats

    planner = planner_with([1.0] * 6, rate=0.8, max_k=5, explore_every=2, probe_overhead=1.0)
    done = SimpleNamespace(request_id="r", stats=SpecStats(), params=SimpleNamespace(greedy=True))
    for _ in range(6):
        assert planner.plan([done], [0]) == [0]
    assert planner.explored == 0 and planner.decisions == {} and done.stats.planned_k == {0: 6}
    assert planner.plan([done], [5]) == [5]


def test_a_requests_prior_is_the_acceptance_of_requests_of_its_kind():
    """Greedy rows accepted every draft, sampled rows none (20 rounds each, chains of 3): a new greedy request plans
    the longest chain from its first round, a new sampled one plain decoding (before, both started from the mix:
    a greedy request after T = 1 traffic drafted 1-token chains)."""
    from types import SimpleNamespace

    from ssd_eagle.stats import SpecStats

    def seq(r: str, greedy: bool):
        return SimpleNamespace(request_id=r, stats=SpecStats(), params=SimpleNamespace(greedy=greedy))

    planner = Planner(PlannerConfig(max_k=3, learn_costs=False, probe_every=64),
                      CostTable({1: [1.0, 1.25, 1.5, 1.75]}))
    for r, greedy, accepted in (("g", True, 3), ("s", False, 0)):
        for _ in range(20):
            planner.plan([seq(r, greedy)], [3])
            planner.observe({r: (3, accepted)}, 0.0, 1.0, 4)
        planner.forget(r)
    assert planner.plan([seq("g2", True)], [3]) == [3]
    assert planner.plan([seq("s2", False)], [3]) == [0]
    assert planner.chain.prior(None) is planner.chain.engine_wide  # (a request of unknown kind: all rows')


def test_not_adaptive_always_drafts_k():
    planner = planner_with([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], rate=0.0, adaptive=False)
    assert planner.choose(["r"]) == {"r": 5}


def test_draft_cost_counts():
    # flat verification but a draft step as expensive as a verification: K = 1 costs 2 s for 1.9 tokens
    planner = planner_with([1.0] * 6, rate=0.9)
    for k in range(1, 6):
        planner.chain.draft_cost.update(k, 1.0 * k)
    assert planner.choose(["r"]) == {"r": 0}


def test_speculation_is_switched_off_only_where_plain_decoding_wins_by_the_margin():
    """Nothing accepted (E = 1 at every K), flat verification: a draft of 0.5% of a round per token loses 0.5% at
    K = 1 (1 / 1.005), inside the 1% margin, so the planner keeps drafting one token; at 2% a token it decodes
    plainly."""
    for per_token, expected in ((0.005, 1), (0.02, 0)):
        planner = planner_with([1.0] * 6, rate=0.0)
        for k in range(1, 6):
            planner.chain.draft_cost.update(k, per_token * k)
        assert planner.choose(["r"]) == {"r": expected}


def test_the_drafters_first_round_and_probes_teach_acceptance_but_not_the_drafting_cost():
    """A drafter's first round pays one-off warm-up, and an SSD probe is drafted by the backup after idle rounds:
    neither is what a round of speculation costs (a 47 ms first tree round against ~15 ms later ones switched a
    tree off for a whole prompt)."""
    planner = Planner(PlannerConfig(max_k=4, min_cost_rounds=3.5), CostTable({1: [1.0] * 5}))
    planner.observe({"r": (4, 1)}, 0.047, 1.0, 5)  # warm-up: not learnt
    assert planner.chain.draft_cost.predict(4) == 0.0
    planner.observe({"r": (4, 1)}, 0.015, 1.0, 5)
    planner.observe({"r": (4, 4)}, 0.060, 1.0, 5, probe=True)
    assert planner.chain.draft_cost.predict(4) == pytest.approx(0.015) and planner.chain.draft_cost.n == 1
    assert planner.round_time(4, 1) == 1.0  # (drafting counts as free until min_cost_rounds rounds taught it)
    planner.config.min_cost_rounds = 0.0  # (SD's default: learnt from the first round after the warm-up)
    assert planner.round_time(4, 1) == pytest.approx(1.015)
    acceptance = planner.chain.acceptance["r"]
    assert acceptance.tried[0] == pytest.approx(1 + 0.9 * (1 + 0.9)) and acceptance.accepted[3] == 1


def test_an_ssd_speculators_cold_rounds_do_not_switch_a_paying_tree_off():
    """The verifier's waits of an SSD tree's first rounds on an AVX2 EPYC in float16 (36, 101 and 74 ms: the first
    request's prompt and cold builds; then ~1.3 ms on hits and ~30 ms on misses), with its accepted paths: learnt as
    drafting cost after one warm-up round, they switched the tree off after its fifth round, for good (a request that
    does not speculate teaches no new cost); SSD's three warm-up rounds (planner_for) keep it on."""
    waits = [0.0365, 0.1014, 0.0745] + [0.0013, 0.0013, 0.03] * 6
    paths = [1, 0, 1, 2, 0, 1] * 4
    table = CostTable({1: [0.050, 0.054, 0.059, 0.059, 0.061, 0.070, 0.080]})
    for warm_rounds, expected_off in ((1, True), (3, False)):
        planner = Planner(PlannerConfig(max_k=5, tree_nodes=6, warm_rounds=warm_rounds, min_cost_rounds=3.5,
                                        min_rounds=MIN_ROUNDS), table)
        ks = []
        for wait, accepted in zip(waits, paths):
            k = planner.choose(["r"])["r"]
            ks.append(k)
            planner.observe({"r": (k, accepted if k else 0)}, wait if k else 0.0, 0.080 if k else 0.050, 7 if k else 1)
        assert (0 in ks[5:]) == expected_off, ks
        if not expected_off:
            assert planner.tree.draft_cost.predict(5) == pytest.approx(0.011, abs=0.002)  # the mean wait past warm-up


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


def test_speculation_stays_on_through_min_rounds_of_thin_evidence_unless_the_prior_loses_too():
    """A 2-node tree (drafting 0.3 s, verifying 1.1 s) whose first rounds accepted nothing: with ``min_rounds`` = 4
    it drafts through 4 verified rounds and only then decodes plainly (without the rule: plain from the third round
    on, a_1 read 0.13 after two misses), as it pays at the prior a_i = 0.5 (1.75 tokens in 1.4 s). Verification
    that grows linearly loses even at the prior (1.75 tokens in 3.3 s): plain at once."""
    def run(min_rounds: int, verify: list[float]) -> list[int]:
        planner = Planner(PlannerConfig(max_k=2, tree_nodes=2, min_rounds=min_rounds, probe_every=64),
                          CostTable({1: verify}))
        ks = []
        for _ in range(6):
            k = planner.choose(["r"])["r"]
            ks.append(k)
            planner.observe({"r": (k, 0)}, 0.3 if k else 0.0, 1.0, 3 if k else 1)
        return ks

    flat = [1.0, 1.05, 1.1]
    assert run(0, flat) == [2, 2, 0, 0, 0, 0]
    assert run(4, flat) == [2, 2, 2, 2, 0, 0]
    assert run(4, [1.0, 2.0, 3.0]) == [0] * 6


def test_failed_probes_back_off_and_speculating_resets_the_interval():
    # probes nearly free (spaced by the backoff alone)
    planner = planner_with([1.0, 1.001, 1.002, 1.003, 1.004], rate=0.0, max_k=4, probe_every=2, max_probe_every=8,
                           off_margin=0.0)  # (a useless draft 0.1% dearer than plain decoding: off without margin)
    assert planner.probe_spacing(1) == 1
    probes = [i for i in range(40) if planner.decide(["r"])["r"][1]]
    assert probes == [1, 5, 13, 21, 29, 37]  # after 2, 4, 8, 8 ... idle rounds
    planner.probe_interval["r"], planner.idle_rounds["r"] = 8, 3
    planner.config.adaptive = False  # the request speculates for a round: the next stretch off probes early again
    assert planner.decide(["r"])["r"] == (4, False)
    planner.config.adaptive = True
    assert [planner.decide(["r"])["r"][1] for _ in range(2)] == [False, True]
    planner.forget("r")
    assert "r" not in planner.probe_interval and "r" not in planner.idle_rounds


def test_a_middle_plan_explores_the_longest_draft_less_often_while_the_plan_holds():
    """K = 2 planned (test_middle_k's table): rounds 8, 24 and 56 draft max_k (intervals 8, 16, 32) when exploring
    is nearly free; at 2% of the plan's time an exploring round (0.75 s more than a 1.5 s round) comes every 25
    rounds at the most; and what they measure can change the plan: positions past 2 accepted every time make K = 5
    the plan, which explores nothing."""
    planner = planner_with([1.0, 1.25, 1.5, 1.75, 2.0, 2.25], rate=0.6, probe_overhead=1.0)
    ks = [planner.choose(["r"])["r"] for _ in range(60)]
    assert [i for i, k in enumerate(ks) if k == 5] == [7, 23, 55] and set(ks) == {2, 5}
    assert planner.explored == 3 and planner.summary()["explored"] == 3
    spaced = planner_with([1.0, 1.25, 1.5, 1.75, 2.0, 2.25], rate=0.6)  # probe_overhead 0.02
    ks = [spaced.choose(["r"])["r"] for _ in range(60)]
    assert [i for i, k in enumerate(ks) if k == 5] == [24, 49]
    never = planner_with([1.0, 1.25, 1.5, 1.75, 2.0, 2.25], rate=0.6, explore_every=0)
    assert {never.choose(["r"])["r"] for _ in range(60)} == {2}
    # the trace's case: position 2 rejected in the first 3 rounds, so K = 1; every later draft would be accepted
    learns = Planner(PlannerConfig(max_k=5), CostTable({1: [1.0, 1.0, 1.1, 1.2, 1.3, 1.4]}))
    for _ in range(3):
        learns.observe({"r": (5, 1)}, 0.0, 1.0, 6)
    ks = []
    for _ in range(40):
        k = learns.choose(["r"])["r"]
        ks.append(k)
        learns.observe({"r": (k, k)}, 0.0, 1.0, k + 1)
    # one exploring round (after 20 rounds: 0.4 s more than a 1 s round, at 2%) brought K = 5 back
    assert ks[:19] == [1] * 19 and ks[19] == 5 and ks[-5:] == [5] * 5


def test_probes_are_spaced_to_cost_at_most_probe_overhead():
    # a 2-token probe verifies 3 tokens: 0.6 s more than a plain round of 1 s; at 2% that is one probe in 30 rounds
    planner = planner_with([1.0, 1.3, 1.6, 1.9, 2.2], rate=0.0, max_k=4, probe_every=4)
    assert planner.probe_spacing(1) == 30
    probes = [i for i in range(100) if planner.decide(["r"])["r"][1]]
    assert probes == [29, 59, 89]
    planner.chain.draft_cost.update(2, 0.4)  # drafting the probe costs 0.4 s more
    assert planner.probe_spacing(1) == 50
    planner.config.probe_overhead = 1.0
    assert planner.probe_spacing(1) == 1


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


def test_a_cost_table_never_lets_a_longer_forward_cost_less():
    """Interference only adds time: V(4) = 60.5 ms between 48.2 and 47.9 (measured on a shared Xeon) is a slowed
    measurement, and each entry becomes the least of itself and the later ones (also for a table read back)."""
    measured = [0.0448, 0.0486, 0.0482, 0.0605, 0.0479, 0.0490]
    table = CostTable({1: measured})
    assert table.verify[1] == pytest.approx([0.0448, 0.0479, 0.0479, 0.0479, 0.0479, 0.0490])
    assert CostTable.from_json(CostTable({1: measured}).to_json()).verify == table.verify


def test_a_cost_table_never_lets_a_larger_batch_cost_less():
    """The table a server measured while another process held the second core (ms): bucket 1 slowed 14x, bucket 2
    4x, 4 and 8 as usual. Each entry becomes the least of the larger buckets' at that n (and of its later n), so
    one request's round is planned at bucket 4's costs: drafting pays again."""
    ms = {1: [679.8, 1126.9, 1255.6, 1255.6, 1255.6, 1255.6, 1601.5], 2: [175.0] * 7,
          4: [47.1, 52.0, 54.0, 59.1, 59.1, 61.5, 61.5], 8: [52.6, 65.5, 69.8, 73.3, 81.2, 86.7, 98.4]}
    table = CostTable({b: [t / 1e3 for t in row] for b, row in ms.items()})
    assert [round(t * 1e3, 1) for t in table.verify[1]] == ms[4] == [round(t * 1e3, 1) for t in table.verify[2]]
    assert [round(t * 1e3, 1) for t in table.verify[8]] == ms[8]
    short = CostTable({1: [0.05, 0.06, 0.07], 2: [0.04, 0.045]})  # (a larger bucket measured over fewer n)
    assert short.verify[1] == [0.04, 0.045, 0.07]


def test_measure_verify_costs_on_a_tiny_model_is_cached(tmp_path, monkeypatch):
    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=3, max_len=256)
    table = measure_verify_costs(runner, max_new=3, max_batch=2, context=16, repeats=1)
    assert sorted(table.verify) == [1, 2] and all(len(v) == 3 and min(v) > 0 for v in table.verify.values())
    files = list((tmp_path / "ssd_eagle" / "costs").glob("*.json"))
    assert len(files) == 1 and table.key in files[0].name
    assert measure_verify_costs(runner, max_new=3, max_batch=2, context=16) == table  # read back, not re-timed


def test_verify_costs_are_timed_through_the_forward_a_round_runs(tmp_path, monkeypatch):
    """An engine replaying CUDA graphs pads a round's width to a captured one (here 1 and 4): its table is timed
    through that forward, so widths 2..4 cost what width 4 does (an eager table read them cheaper), and is cached
    apart from the eager one. (Also: on a CUDA device every timed call is synchronised, least_of_passes.)"""
    import time as clock

    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=2, max_len=256)
    widths = []

    def padded(batch):
        width = 1 if batch.input_ids.shape[1] == 1 else 4
        widths.append(batch.input_ids.shape[1])
        clock.sleep(0.01 * width)

    table = measure_verify_costs(runner, max_new=4, context=16, repeats=1, forward=padded)
    assert sorted(set(widths)) == [1, 2, 3, 4] and table.verify[1][0] < 0.02 < 0.04 <= min(table.verify[1][1:])
    assert measure_verify_costs(runner, max_new=4, context=16, repeats=1).key != table.key


def test_a_disturbed_verify_table_is_used_but_not_cached(tmp_path, monkeypatch):
    """One row timed 4x slower than two (another process held the core while bucket 1 was timed): the table is
    made consistent (bucket 1 at most bucket 2's) and used, but not written to the cache, so the next start times
    it again (a server cached such a table and never drafted)."""
    import time as clock

    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=3, max_len=256)

    def disturbed(batch):
        clock.sleep(0.04 if batch.input_ids.shape[0] == 1 else 0.01)

    table = measure_verify_costs(runner, max_new=2, max_batch=2, context=16, repeats=1, forward=disturbed)
    assert table.corrected > 3 and max(table.verify[1]) < 0.02
    assert not list((tmp_path / "ssd_eagle" / "costs").glob("*.json"))


@pytest.mark.parametrize("kind", ["draft_model", "eagle3", "eagle3_tree"])
def test_measure_draft_costs_times_each_draft_length_once_and_is_cached(kind, tmp_path, monkeypatch):
    """Chains: D(k) for k = 1..K, each > 0; a tree: its whole depth. Read back from the cache, not re-timed."""
    from helpers import eagle3_head_for
    from ssd_eagle.drafters import DraftModelDrafter
    from ssd_eagle.drafters.eagle3 import Eagle3Drafter
    from ssd_eagle.drafters.tree import TreeSettings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_tiny_llama(seed=5)
    tree = TreeSettings(budget=6, depth=3, topk=2) if kind == "eagle3_tree" else None
    drafter = DraftModelDrafter(make_tiny_llama(seed=6), 257, 2, 256) if kind == "draft_model" else \
        Eagle3Drafter(eagle3_head_for(target.double()).float(), 2, 256, tree=tree)
    costs = measure_draft_costs(drafter.backend, 3, tree, context=16, repeats=1)
    assert sorted(costs) == ([3] if tree else [1, 2, 3]) and min(costs.values()) > 0
    assert len(list((tmp_path / "ssd_eagle" / "costs").glob("*.json"))) == 1
    calls = drafter.backend.forwards
    assert measure_draft_costs(drafter.backend, 3, tree, context=16) == costs and drafter.backend.forwards == calls



def test_a_tree_with_a_short_cache_builds_its_engine():
    """A tree's levels write topk positions each (5 levels of top-4: 20 past the prefix): with max_model_len 16 the
    measure sized its prefix for a chain, wrote the tree past the draft's cache and start-up failed. Now the prefix
    leaves the tree its room, and both measure at a shorter prefix."""
    from ssd_eagle.config import EngineConfig, SpeculativeConfig
    from ssd_eagle.engine.factory import build
    from helpers import make_byte_tokenizer, noisy_copy

    target = make_tiny_llama(seed=3).double()
    chains = {1, 2, 3, 4, 5}
    for tree, expected in ({"tree_budget": 16, "tree_depth": 5, "tree_topk": 4}, (chains, {5})), ({}, (chains, set())):
        spec = SpeculativeConfig(method="draft_model", model="d", **tree)
        config = EngineConfig(model="in-memory", mode="sd", max_num_seqs=2, max_model_len=16, dtype="float64",
                              speculative_config=spec)
        engine = build(config, target=target, tokenizer=make_byte_tokenizer(), draft=noisy_copy(target, 0.05))
        assert (set(engine.planner.draft_costs[False]), set(engine.planner.draft_costs[True])) == expected

def test_a_measured_drafting_cost_plans_the_first_round():
    """Flat verification (1 s), drafting 0.3 s a token, no acceptance seen yet (every a_i at the prior 0.5):
    E(k) = 2 - 0.5^k tokens in 1 + 0.3 k seconds: 1.0, 1.154, 1.094, 0.987 tokens/s for k = 0..3, so K = 1. Without
    the start-up measure drafting counted as free until the first rounds taught it, and K = 5 (1.969 tokens/s)."""
    measured = Planner(PlannerConfig(max_k=5), CostTable({1: [1.0] * 6}), {k: 0.3 * k for k in range(1, 6)})
    assert measured.choose(["r"]) == {"r": 1}
    assert measured.round_time(3, 1) == pytest.approx(1.9)
    assert Planner(PlannerConfig(max_k=5), CostTable({1: [1.0] * 6})).choose(["r"]) == {"r": 5}
    measured.chain.draft_cost.update(1, 5.0)  # a respawned drafter starts again from the measure, not from nothing
    measured.new_drafter()
    assert measured.round_time(1, 1) == pytest.approx(1.3)


def test_a_disturbance_spanning_a_whole_n_does_not_reach_the_table(monkeypatch):
    """A runner slowed by 50 ms a forward for eight forwards in a row (other work on the machine), on a clock the
    forwards advance (2 ms a new token): timed n after n, those eight are every timing of n = 6 and 7; timed in
    passes over every n, the least of three passes drops them."""
    from types import SimpleNamespace

    import ssd_eagle.planner as planner_module

    clock = SimpleNamespace(now=0.0, calls=0)
    monkeypatch.setattr(planner_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    def forward(batch, **_):
        clock.calls += 1
        clock.now += 0.002 * batch.input_ids.shape[1] + (0.05 if 22 <= clock.calls <= 29 else 0.0)

    runner = SimpleNamespace(forward=forward, model=make_tiny_llama(), kv=SimpleNamespace(max_len=256),
                             dtype=torch.float32, device=torch.device("cpu"))
    table = measure_verify_costs(runner, max_new=7, max_batch=1, context=16, repeats=3, cache=False)
    assert clock.calls == 1 + 4 * 7  # (the prefix, then a warm-up pass and three timed passes)
    assert table.verify[1] == pytest.approx([0.002 * n for n in range(1, 8)])


class WrongDrafter(Drafter):
    """Cheap proposals the target never emits next (its greedy tokens plus one), until ``good`` is set: then the
    target's own greedy continuation (an oracle, precomputed per request)."""

    needs_aux_hidden, name, healthy, error = False, "wrong", True, None

    def __init__(self, target):
        self.target, self.good, self.greedy = target, False, {}

    def add_sequence(self, seq, aux):
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        self.greedy[seq.request_id] = (len(prompt), reference_greedy(self.target, prompt, 80))

    def propose(self, seqs, num_tokens):
        out = []
        for seq, n in zip(seqs, num_tokens):
            start, greedy = self.greedy[seq.request_id]
            tokens = greedy[len(seq.token_ids) - start: len(seq.token_ids) - start + n]
            out.append(Proposal(tokens if self.good else [(t + 1) % 256 for t in tokens]))
        return out

    def on_verified(self, seq, k, aux):
        pass

    def remove_sequence(self, seq):
        pass

    def close(self):
        pass


def test_engine_with_planner_stops_drafting_a_useless_drafter_probes_and_comes_back(byte_tokenizer, tmp_path,
                                                                                    monkeypatch):
    """Greedy output stays the target's while the planner turns a useless drafter off; probes bring back a good
    one. Costs: a flat verification (drafting pays as soon as anything is accepted)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_tiny_llama(seed=3)
    drafter = WrongDrafter(target)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=4, max_num_seqs=1, max_model_len=512)
    engine.planner = Planner(PlannerConfig(max_k=4, probe_every=4, probe_overhead=1.0),  # probes as the backoff allows
                             CostTable({1: [1.0, 1.3, 1.6, 1.9, 2.2]}))
    llm = LLM(engine=engine)
    prompt = random_prompts(3, seed=5)[2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert out.token_ids == reference_greedy(target, prompt, 60)
    assert engine.planner.decisions.get(0, 0) >= 30  # mostly plain decoding
    drafter.good = True
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert out.token_ids == reference_greedy(target, prompt, 60)
    assert out.stats.num_accepted >= 30  # the probes found the drafter good again


def test_planner_for_measures_costs_for_sd_chains_and_trees(byte_tokenizer, tmp_path, monkeypatch):
    from ssd_eagle.config import SpeculativeConfig
    from ssd_eagle.planner import planner_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_tiny_llama(seed=3)
    engine = LLMEngine(target, byte_tokenizer, NgramDrafter(1, 3), num_speculative_tokens=3, max_num_seqs=2,
                       max_model_len=256)
    planner = planner_for(engine, SpeculativeConfig(method="ngram"))
    assert planner.config.choose_k and planner.config.max_k == 5 and sorted(planner.costs.verify) == [1, 2]
    assert planner.config.min_cost_rounds == 0.0
    assert not planner_for(engine, SpeculativeConfig(method="ngram", num_speculative_tokens=3)).config.choose_k
    assert planner_for(engine, SpeculativeConfig(method="ngram", adaptive=False)) is None
    tree = planner_for(engine, SpeculativeConfig(method="draft_model", model="d", tree_budget=8, tree_depth=4))
    assert tree.config.tree_nodes == 8 and tree.config.tree_depth == 4 and len(tree.costs.verify[1]) == 9
    assert tree.config.chains and tree.config.max_k == 5  # (SD: chains of up to K compete with the tree)
    assert tree.config.tree_sizes == (2, 4, 8)  # (and the tree's best 4 and 2 nodes)
    timed = []
    engine.static = lambda batch: timed.append(batch.input_ids.shape[1])  # (CUDA graphs: None = not covered)
    planner_for(engine, SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    engine.static = None
    assert sorted(set(timed)) == [1, 2, 3]  # timed through the engine's own verify forward
    assert planner.draft_costs == {False: {}, True: {}}  # (an n-gram lookup has no draft model to time: learnt online)
    neural = LLMEngine(target, byte_tokenizer, make_drafter("noisy", target, 2), num_speculative_tokens=3,
                       max_num_seqs=2, max_model_len=256)
    assert sorted(planner_for(neural, SpeculativeConfig(method="draft_model", model="d")).draft_costs[False]) == \
        [1, 2, 3, 4, 5]


def test_ssd_is_planned_by_sds_rule_on_its_wait_and_drafts_longer_than_sd_when_hits_save_drafting():
    """Hand-computed: flat 30 ms verification, every position accepted at 0.6 (E(k) = 1, 1.6, 1.96, 2.176, 2.3056,
    2.38336). SD drafts 8 ms a token: E/T peaks at k = 2 (1.96 / 46 ms). SSD waits only on misses (hit rate 0.8):
    1.6 ms a token, E/T peaks at k = 4 (2.3056 / 36.4 ms), above SD's best and AR's 1 / 30 ms."""
    best = {}
    for name, per_token in (("sd", 8e-3), ("ssd", 0.2 * 8e-3)):
        planner = planner_with([0.03] * 6, rate=0.6, learn_costs=False)
        for _ in range(20):  # the learnt line: what the engine's rounds teach it (draft time or wait vs k)
            for k in (1, 3, 5):
                planner.chain.draft_cost.update(k, per_token * k)
        best[name] = planner.choose(["r"])["r"], planner.rate(planner.choose(["r"])["r"], ["r"])
    assert best["sd"][0] == 2 and best["ssd"][0] == 4
    assert best["sd"][1] == pytest.approx(1.96 / 0.046, rel=1e-3)
    assert best["ssd"][1] == pytest.approx(2.3056 / 0.0364, rel=1e-3)


def test_measure_verify_costs_fits_a_short_cache(tmp_path, monkeypatch):
    """Bug fix: a 128-token probe context raised in an engine whose max_model_len was shorter."""
    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=2, max_len=40)
    table = measure_verify_costs(runner, max_new=6, max_batch=1, repeats=1)
    assert len(table.verify[1]) == 6 and min(table.verify[1]) > 0


# ---------------------------------------------------------------------------------- decisions in the statistics
def test_spec_stats_record_the_plan_per_k_with_probes_and_merge():
    from ssd_eagle.stats import SpecStats

    a, b = SpecStats(), SpecStats()
    for k, probe in ((0, False), (0, False), (2, True), (5, False)):
        a.record_plan(k, probe)
    b.record_plan(0, False)
    summary = a.merge(b).summary()
    assert summary["planned_rounds_per_k"] == {0: 3, 2: 1, 5: 1}
    assert summary["rounds_without_speculation"] == 3 and summary["probes"] == 1
    assert "planned_rounds_per_k" not in SpecStats().summary()  # no planner, no planner fields


CYCLE_K = 4
SLOW_VERIFY = CostTable({1: [1.0, 3.0, 5.0, 7.0, 9.0]})  # drafting never pays
CHEAP_VERIFY = CostTable({1: [1.0, 1.3, 1.6, 1.9, 2.2]})  # drafting pays as soon as anything is accepted


def cycle_target():
    """The server tests' target (greedy decoding cycles through a fixed byte string; token 0 never comes next),
    in float64."""
    from _server_helpers import make_model

    return make_model().double()


class Saboteur:
    """A real drafter whose proposals (chains or trees) are replaced by token 0, which the cycle target never emits,
    while ``bad``: nothing it proposes is accepted at T = 0. Everything else goes to the real drafter."""

    def __init__(self, inner):
        self.inner, self.bad = inner, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, seqs, num_tokens):
        out = self.inner.propose(seqs, num_tokens)
        return [Proposal([0] * len(p.tokens), None, p.cache_hit, p.lookup_k, p.parents) for p in out] if self.bad \
            else out


def real_drafter(kind: str, target, tokenizer):
    """ngram, draft_model (the target's copy: always right), draft_model_tree (the same, proposing 6-node trees),
    eagle3 (a random head: almost never right) or ssd (the draft model through the SSD factory, speculator in this
    process)."""
    import copy

    from ssd_eagle.drafters import DraftModelDrafter
    from ssd_eagle.drafters.eagle3 import Eagle3Drafter
    from ssd_eagle.drafters.tree import TreeSettings

    from helpers import eagle3_head_for

    if kind == "ssd":
        from ssd_eagle.config import EngineConfig, SpeculativeConfig
        from ssd_eagle.engine.factory import build

        spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=CYCLE_K,
                                 fanout=[2], speculator="local")
        cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=1, max_model_len=256, speculative_config=spec)
        return build(cfg, target, tokenizer=tokenizer, draft=copy.deepcopy(target)).drafter
    return {"ngram": lambda: NgramDrafter(1, 3),
            "draft_model": lambda: DraftModelDrafter(copy.deepcopy(target), target.config.vocab_size, 1, 256),
            "draft_model_tree": lambda: DraftModelDrafter(copy.deepcopy(target), target.config.vocab_size, 1, 256,
                                                          tree=TreeSettings(6, CYCLE_K, 2)),
            "eagle3": lambda: Eagle3Drafter(eagle3_head_for(target, draft_vocab=257), num_slots=1, max_len=256),
            }[kind]()


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "draft_model_tree", "eagle3", "ssd"])
def test_with_each_drafter_a_useless_one_ends_in_plain_decoding_and_a_good_one_comes_back(kind, byte_tokenizer):
    """Every drafter kind under the planner: sabotaged (never accepted) it ends in plain decoding with probes;
    left alone, n-gram, the draft model and SSD (right about the cycle) speculate again, the random EAGLE-3 head
    (never right) stays off. Output equals the target's greedy decode throughout; the decisions are in the
    request's ``spec_stats`` and the engine's totals."""
    target = cycle_target()
    drafter = Saboteur(real_drafter(kind, target, byte_tokenizer))
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=CYCLE_K, max_num_seqs=1,
                       max_model_len=256, max_draft_tokens=6 if "tree" in kind else 0)
    engine.planner = Planner(PlannerConfig(max_k=CYCLE_K, choose_k=True, probe_every=4, learn_costs=False,
                                           probe_overhead=1.0, tree_nodes=6 if "tree" in kind else 0),
                             CHEAP_VERIFY)  # probes as often as the backoff allows
    llm = LLM(engine=engine)
    prompt = list(b"Hey \xc3\xa9")
    params = SamplingParams(temperature=0.0, max_tokens=60)
    try:
        bad = llm.generate([prompt], params)[0]
        drafter.bad = False
        good = llm.generate([prompt], params)[0]
    finally:
        engine.close()
    reference = reference_greedy(target, prompt, 60)
    assert bad.token_ids == reference and good.token_ids == reference
    s = bad.stats.summary()
    assert bad.stats.num_accepted == 0 and s["rounds_without_speculation"] >= 30 and s["probes"] >= 3
    assert sum(s["planned_rounds_per_k"].values()) == s["rounds"]
    if kind == "eagle3":
        assert good.stats.num_accepted <= 5 and good.stats.summary()["rounds_without_speculation"] >= 30
    else:
        g = good.stats.summary()
        assert good.stats.num_accepted >= 30 and g["planned_rounds_per_k"].get(CYCLE_K, 0) >= 5
        assert g["rounds"] < 30  # speculation back: fewer rounds than tokens
    if kind == "ssd":
        assert good.stats.cache_hits > 0  # the speculator kept its cache through the idle rounds
        # only rounds that speculate count as lookups (a planned-off round's cache answer was never used: counted,
        # a server reported hit rate 0.35 with 7 tokens drafted in 38 rounds), and a probe after planned-off rounds
        # is no miss: the speculator built nothing for it (it idled), the backup drafted it
        assert bad.stats.cache_lookups <= s["rounds"] - s["rounds_without_speculation"] - s["probes"]
    assert engine.stats.planned_k == {k: bad.stats.planned_k.get(k, 0) + good.stats.planned_k.get(k, 0)
                                      for k in set(bad.stats.planned_k) | set(good.stats.planned_k)}
    assert engine.stats.num_probes == bad.stats.num_probes + good.stats.num_probes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_drafter_under_the_planner_drafts_trees_and_chains_and_stays_exact(temperature, byte_tokenizer):
    """The draft model's tree drafter (the target's copy: always right) with chains competing, verification
    cheaper for a chain of 4 (5 tokens) than for the 6-node tree (7): its first round is a tree. Greedy rows teach
    chains' acceptance from every tree round (:func:`greedy_chain_record`), so the second drafted round is already a
    chain; sampled rows learn it on an exploring round (after a probe and seven trees). The drafter is told the shape;
    greedy output equals the target's greedy decode; ``spec_stats`` counts the tree rounds."""
    target = cycle_target()
    drafter = real_drafter("draft_model_tree", target, byte_tokenizer)
    shapes = []
    propose = drafter.propose

    def recording(seqs, num_tokens):
        out = propose(seqs, num_tokens)
        shapes.extend("tree" if p.parents is not None else "chain" for p in out if p.tokens)
        return out

    drafter.propose = recording
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=CYCLE_K, max_num_seqs=1,
                       max_model_len=256, max_draft_tokens=6)
    engine.planner = Planner(PlannerConfig(max_k=CYCLE_K, tree_nodes=6, chains=True, learn_costs=False,
                                           probe_overhead=1.0), CHEAP_VERIFY)
    prompt = list(b"Hey \xc3\xa9")
    try:
        out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=temperature, max_tokens=60,
                                                                   seed=3))[0]
    finally:
        engine.close()
    if temperature == 0:
        assert out.token_ids == reference_greedy(target, prompt, 60)
        assert shapes[:2] == ["tree", "chain"]
    else:
        assert len(out.token_ids) == 60 and shapes[:9] == ["tree"] * 8 + ["chain"]
    s = out.stats.summary()
    assert s["planned_tree_rounds"] == shapes.count("tree") and engine.stats.planned_trees == shapes.count("tree")


def test_greedy_chain_record_follows_best_children_and_stops_where_the_tree_says_nothing():
    """Tree: 1, 2 children of the root (1 its best), 3, 4 of node 1 (3 its best), 5 of node 2, 6 of node 3. A greedy
    chain drafts 1, 3, 6: accepted path [1, 3, 6] -> 3 accepted, the chain's 4th position untried (node 6 has no
    children); [1, 4] -> rejected at 2; [2, 5] -> rejected at 1; [] -> rejected at 1. A best child cut by the tree's
    budget (node 1 of a real selection, a leaf at depth 1 of a depth-2 tree): its next position is untried, not
    rejected (the chain would have drafted the cut child)."""
    import math

    from ssd_eagle.drafters.tree import _select

    parents = [0, 0, 1, 1, 2, 3]
    assert [greedy_chain_record(parents, path) for path in ([1, 3, 6], [1, 4], [2, 5], [])] == \
        [(3, 3), (2, 1), (1, 0), (1, 0)]
    log = math.log
    pool = [(log(.5), 10, 0, 1, None), (log(.45), 11, 0, 1, None),  # (score, token, parent, depth, hidden)
            (log(.5) + log(.1), 12, 1, 2, None),  # node 1's best child, cut by a budget of 3
            (log(.45) + log(.9), 13, 2, 2, None)]
    cut = _select(pool, budget=3)
    assert cut.parents == [0, 0, 2] and greedy_chain_record(cut.parents, [1]) == (1, 1)


def test_tree_chances_count_a_shallow_leaf_as_a_tried_depth():
    """A depth-2 tree whose accepted path ends on a depth-1 leaf: depth 2 was tried with chance 0, as the draw-based
    record counts it (its a_2 otherwise read 0.6 where the truth and the draws read 0.33)."""
    from ssd_eagle.verify import tree_child_probs

    probs = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.6, 0.1, 0.1, 0.2], [0.25] * 4, [0.25] * 4])
    nodes, parents = [1, 2, 0], [0, 0, 1]
    draws, chances = Acceptance(decay=1.0), Acceptance(decay=1.0)
    draws.record(2, 1)
    chances.record_chances(tree_record(Proposal(nodes, parents=parents), [2], 3, 2,
                                       tree_child_probs(probs, nodes, parents, [2])))
    assert chances.tried == draws.tried == [1.0, 1.0] and chances.accepted == [pytest.approx(0.7), 0.0]


def test_a_tree_that_does_not_pay_at_the_prior_starts_with_a_chain_that_does():
    """Sampled rows, verification steep past a chain's width (a 6-node tree verifies 7 tokens at 3x): the tree does
    not pay even at the prior, a chain does, so the first round drafts a chain (nothing measured yet: the best shape
    paying at the prior), which accepts 0.8 a position: chains stay the plan and the tree is explored now and then.
    (Before, speculation went off at once and waited for probes: in float32 a tree planner's probes, spaced by their
    cost, never came within a 64-token request and it decoded plainly where a chain ran 1.1x AR; earlier still,
    probes were all trees and chains were never drafted.)"""
    planner = Planner(PlannerConfig(max_k=5, tree_nodes=6, chains=True, tree_depth=5, learn_costs=False,
                                    explore_every=4, min_rounds=6, probe_overhead=1.0),
                      CostTable({1: [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 3.0]}))
    shapes = []
    for _ in range(60):
        k = planner.choose(["r"])["r"]
        tree = planner.tree_round
        shapes.append("off" if not k else "tree" if tree else "chain")
        if k:
            planner.observe({"r": (k, 0)}, 0.0, 1.0, 7 if tree else k + 1, probe=planner.probing,
                            chances={"r": [0.5, 0.0] if tree else [0.8] * k})
    assert shapes[0] == "chain" and "off" not in shapes
    assert [i for i, s in enumerate(shapes) if s == "tree"] == [4, 12, 28]  # (explored, the interval doubling)


@pytest.mark.parametrize("draft", ["copy", "noisy"])
def test_sampled_rows_teach_the_chance_of_acceptance_not_the_draw(draft, byte_tokenizer):
    """At T = 1 the engine hands the planner, per sampled row, the chance each tried position of the chain (the first
    min(k + 1, n)) had to be accepted, learnt in place of the draws: 1 everywhere for the target's own copy (q = p),
    probabilities with rejections for a noisy copy (tokens of a random target); greedy rows teach the draws. By hand:
    chances (0.5, 0.25, 0.75) after a round with prior counts."""
    acc = Acceptance(tried=[1.0, 0.0], accepted=[1.0, 0.0], decay=0.5)
    acc.record_chances([0.5, 0.25, 0.75])
    assert acc.tried == [1.5, 1.0, 1.0] and acc.accepted == [1.0, 0.25, 0.75]

    class Recording(Planner):
        def observe_round(self, seqs, proposals, paths, *args, chances=None, **kwargs):
            seen.append((len(proposals[0].tokens), len(paths[0]), chances))
            super().observe_round(seqs, proposals, paths, *args, chances=chances, **kwargs)

    if draft == "copy":
        target = cycle_target()
        drafter = real_drafter("draft_model", target, byte_tokenizer)
    else:
        target = make_tiny_llama(seed=3).double()
        drafter = make_drafter("noisy", target, 1)
    for temperature in (1.0, 0.0):
        seen = []
        engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=CYCLE_K, max_num_seqs=1,
                           max_model_len=256)
        engine.planner = Recording(PlannerConfig(max_k=CYCLE_K, choose_k=False, adaptive=False), CHEAP_VERIFY)
        LLM(engine=engine).generate([list(b"Hey")], SamplingParams(temperature=temperature, max_tokens=40, seed=5))
        drafted = [(n, k, c) for n, k, c in seen if n]
        assert drafted
        for n, k, chances in drafted:
            if not temperature:
                assert chances == {}
                continue
            (chance,) = chances.values()
            assert len(chance) == min(k + 1, n) and all(0.0 <= c <= 1.0 + 1e-9 for c in chance)
            if draft == "copy":
                assert chance == pytest.approx([1.0] * len(chance), abs=1e-6)
        if temperature and draft == "noisy":
            assert any(k + 1 < n for n, k, _ in drafted)  # rejections: positions past k + 1 are not tried
    engine.close()


def test_planner_for_plans_ssd_chains_as_sd_and_not_an_in_line_speculator(byte_tokenizer, tmp_path, monkeypatch):
    """SSD is planned as SD is (issue 13): K in 0..K from the measured costs (its draft time being the verifier's
    wait), only on/off with an explicit K; an in-line speculator is not planned."""
    from types import SimpleNamespace

    from ssd_eagle.config import SpeculativeConfig
    from ssd_eagle.planner import planner_for
    from ssd_eagle.ssd.client import LocalSpeculator

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = LLMEngine(make_tiny_llama(seed=3), byte_tokenizer, NgramDrafter(1, 3), num_speculative_tokens=3,
                       max_num_seqs=1, max_model_len=256)
    spec = SpeculativeConfig(method="draft_model", model="d")
    engine.drafter = SimpleNamespace(mode="ssd", speculator=object())  # a speculator process's link
    planner = planner_for(engine, spec)
    assert planner is not None and planner.config.choose_k and planner.config.max_k == 5
    assert planner.config.min_cost_rounds == 3.5  # (an SSD wait is learnt from four rounds: PlannerConfig)
    assert planner.config.warm_rounds == 3  # (after three warm-up rounds)
    explicit = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=5)
    assert not planner_for(engine, explicit).config.choose_k
    engine.drafter = SimpleNamespace(mode="ssd", speculator=LocalSpeculator.__new__(LocalSpeculator))
    assert planner_for(engine, spec) is None
