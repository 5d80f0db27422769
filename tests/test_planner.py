"""The planner picks the draft length that maximises expected tokens per second (hand-computed tables)."""

from __future__ import annotations

import pytest

from helpers import make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams
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


class WrongDrafter:
    """Cheap proposals the target never emits next (its greedy tokens plus one), until ``good`` is set: then the
    target's own greedy continuation (an oracle, precomputed per request)."""

    needs_aux_hidden, name, healthy, error = False, "wrong", True, None

    def __init__(self, target):
        self.target, self.good, self.greedy = target, False, {}

    def add_sequence(self, seq, aux):
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        self.greedy[seq.request_id] = (len(prompt), reference_greedy(self.target, prompt, 80))

    def propose(self, seqs, num_tokens):
        from ssd_eagle.drafters.base import Proposal

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
    engine.planner = Planner(PlannerConfig(max_k=4, probe_every=4), CostTable({1: [1.0, 1.3, 1.6, 1.9, 2.2]}))
    llm = LLM(engine=engine)
    prompt = random_prompts(3, seed=5)[2]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert out.token_ids == reference_greedy(target, prompt, 60)
    assert engine.planner.decisions.get(0, 0) >= 30  # mostly plain decoding
    drafter.good = True
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert out.token_ids == reference_greedy(target, prompt, 60)
    assert out.stats.num_accepted >= 30  # the probes found the drafter good again


def test_planner_for_measures_costs_for_sd_chains_only(byte_tokenizer, tmp_path, monkeypatch):
    from ssd_eagle.config import SpeculativeConfig
    from ssd_eagle.planner import planner_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_tiny_llama(seed=3)
    engine = LLMEngine(target, byte_tokenizer, NgramDrafter(1, 3), num_speculative_tokens=3, max_num_seqs=2,
                       max_model_len=256)
    planner = planner_for(engine, SpeculativeConfig(method="ngram"))
    assert planner.config.choose_k and planner.config.max_k == 5 and sorted(planner.costs.verify) == [1, 2]
    assert not planner_for(engine, SpeculativeConfig(method="ngram", num_speculative_tokens=3)).config.choose_k
    assert planner_for(engine, SpeculativeConfig(method="ngram", adaptive=False)) is None
    assert planner_for(engine, SpeculativeConfig(method="draft_model", model="d", tree_budget=8)) is None


def test_measure_verify_costs_fits_a_short_cache(tmp_path, monkeypatch):
    """Bug fix: a 128-token probe context raised in an engine whose max_model_len was shorter."""
    from ssd_eagle.model_runner import ModelRunner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    runner = ModelRunner(make_tiny_llama(), num_slots=2, max_len=40)
    table = measure_verify_costs(runner, max_new=6, max_batch=1, repeats=1)
    assert len(table.verify[1]) == 6 and min(table.verify[1]) > 0
