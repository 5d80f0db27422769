"""Rounds the planner runs without speculation cost no draft work: the neural drafters catch up lazily, in one
batched feed when a probe comes or speculation turns back on (ssd_eagle.drafters.neural). Greedy output equals the
target's greedy decode with speculation switching off and on mid-request; after the catch-up the draft proposes
what a draft prefilled from scratch with the committed text proposes; the catch-up is chunked by the token budget
and is not learnt as drafting cost. In SSD a planned-off round builds no speculation cache (ssd_eagle.ssd.speculator).
Tiny float64 targets."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import eagle3_head_for, make_tiny_llama, reference_greedy
from ssd_eagle.drafters import DraftModelDrafter
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.planner import CostTable, Planner, PlannerConfig
from ssd_eagle.sampling_params import SamplingParams

K = 3


class Scripted:
    """A planner stand-in: round r drafts ``pattern[r % len(pattern)]`` tokens per request (the engine's hooks)."""

    def __init__(self, pattern: list[int]):
        self.pattern, self.rounds, self.catch_ups = pattern, 0, []

    def plan(self, seqs, budgets, totals=None):
        k = self.pattern[self.rounds % len(self.pattern)]
        self.rounds += 1
        return [min(b, k) for b in budgets]

    def observe_round(self, seqs, proposals, paths, draft_seconds, verify_seconds, catch_up_seconds=0.0,
                      chances=None):
        self.catch_ups.append(catch_up_seconds)

    def forget(self, request_id):
        pass


def drafter_for(kind: str, target, max_len: int = 512):
    if kind == "eagle3":
        return Eagle3Drafter(eagle3_head_for(target, draft_vocab=257), num_slots=2, max_len=max_len)
    return DraftModelDrafter(copy.deepcopy(target), target.config.vocab_size, 2, max_len)


def count_writes(drafter) -> list[int]:
    """Tokens per :meth:`DraftBackend.write` call of ``drafter``'s backend (prefill and catch-up)."""
    sizes, write = [], drafter.backend.write

    def recording(slot, tokens, start, features):
        sizes.append(len(tokens))
        return write(slot, tokens, start, features)

    drafter.backend.write = recording
    return sizes


def fresh_proposal(kind: str, target, seq) -> list[int]:
    """What a draft with the same weights, prefilled from scratch with ``seq``'s committed text, proposes."""
    fresh = drafter_for(kind, target)  # (a copy of the target, or the same seeded head)
    aux = None
    if kind == "eagle3":
        runner = ModelRunner(target, 1, 512, aux_layer_ids=fresh.aux_layer_ids)
        aux = runner.forward(ForwardBatch.causal([seq.token_ids[:-1]], [0], [0], torch.float64, "cpu"),
                             capture_aux=True, compute_logits=False).aux_hidden[0]
    fresh.add_sequence(seq, aux)
    return fresh.propose([seq], [K])[0].tokens


def ssd_engine_for(kind: str, target, tokenizer, **spec) -> LLMEngine:
    """An SSD engine with an in-process speculator over the draft :func:`drafter_for` builds."""
    draft = eagle3_head_for(target, draft_vocab=257) if kind == "eagle3" else copy.deepcopy(target)
    spec = SpeculativeConfig(**{"method": kind, "model": "in-memory", "num_speculative_tokens": K, "fanout": [4],
                                "speculator": "local", **spec})
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=2, max_model_len=512, speculative_config=spec)
    return build(cfg, target, tokenizer=tokenizer, draft=draft)


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
@pytest.mark.parametrize("budget", [512, 6], ids=["one-feed", "chunked"])
def test_speculation_off_and_on_mid_request_keeps_greedy_output_and_costs_no_draft_work_while_off(
        kind, budget, byte_tokenizer):
    target = make_tiny_llama(seed=4, num_layers=8)
    drafter = drafter_for(kind, target)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2, max_model_len=512,
                       max_num_batched_tokens=budget, prefill_chunk=budget)
    engine.planner = Scripted([K, K, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, K, 1, 0])  # off for 7 rounds, a probe, ...
    sizes = count_writes(drafter)
    forwards = []
    fuse = drafter.backend.fuse if kind == "eagle3" else None
    fused_rows = []
    if fuse is not None:
        drafter.backend.fuse = lambda aux: fused_rows.append(aux.shape[0]) or fuse(aux)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(b"the cat sat on the mat")]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm = LLM(engine=engine)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 60, eos=set())

    # while off, no draft forward and no fuse; the first proposal after the off rounds feeds them in one write
    engine.planner = Scripted([0] * 7 + [K])
    engine.add_request("c", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()  # prefill and round 1 (off)
    before, sizes[:], fused_rows[:] = drafter.backend.forwards, [], []
    for _ in range(6):
        engine.step()
        forwards.append(drafter.backend.forwards - before)
    assert forwards == [0] * 6 and sizes == [] and fused_rows == []
    engine.step()  # the proposal: the first token and 7 skipped rounds' -> 7 fed by write, the last by the extend
    assert sum(sizes) == 7 and max(sizes) <= budget and len(sizes) == -(-7 // budget)
    assert kind == "draft_model" or fused_rows == [7]  # one batched fuse of the 7 rounds' aux rows
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_after_the_catch_up_the_draft_proposes_what_a_fresh_draft_of_the_committed_text_proposes(
        kind, byte_tokenizer):
    target = make_tiny_llama(seed=4, num_layers=8)
    drafter = drafter_for(kind, target)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2, max_model_len=512,
                       max_num_batched_tokens=5)
    engine.planner = Scripted([K, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=100,
                                                                    ignore_eos=True))
    for _ in range(10):  # one drafting round, then nine without
        engine.step()
    seq = engine.requests["a"]
    lazy = type(drafter).propose(drafter, [seq], [K])[0].tokens
    assert fresh_proposal(kind, target, seq) == lazy


def test_the_catch_up_is_not_learnt_as_drafting_cost_but_spaces_the_probes(byte_tokenizer):
    """The engine hands the planner the drafter's catch-up time (only on the first proposal after skipped rounds);
    the planner learns D(K) without it (a long catch-up after many idle rounds would make drafting look dear and
    keep a good drafter off) and counts it in the probes' spacing."""
    target = make_tiny_llama(seed=4)
    drafter = drafter_for("draft_model", target)
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=1, max_model_len=256)
    engine.planner = Scripted([0, 0, 0, K, K, 0])
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    c = engine.planner.catch_ups
    assert c[3] > 0 and c[0] == c[1] == c[2] == c[4] == c[5] == 0.0  # catch-up after the 3 skipped rounds only

    def planner():
        return Planner(PlannerConfig(max_k=K, probe_overhead=0.1), CostTable({1: [1.0, 1.0, 1.0, 1.0]}))

    plain, caught_up = planner(), planner()
    for _ in range(20):
        plain.observe({"r": (2, 0)}, 0.2, 1.0, 3)
        caught_up.observe({"r": (2, 0)}, 0.2 + 0.8, 1.0, 3, catch_up_seconds=0.8)
    assert caught_up.round_time(2, 1) == pytest.approx(plain.round_time(2, 1))  # D(2) = 0.2 s either way
    assert caught_up.catch_up_cost == pytest.approx(0.8)
    assert plain.probe_spacing(1) == 2 and caught_up.probe_spacing(1) == 10  # (0.2 [+ 0.8]) / (0.1 x 1 s)


def test_a_real_planner_switching_a_draft_off_and_back_on_stays_exact(byte_tokenizer):
    """The planner itself (cheap verification: speculation pays once drafts are accepted) over a draft equal to
    the target, sabotaged for the first request: it goes off, probes, and comes back with the lazy catch-up."""
    target = make_tiny_llama(seed=4, num_layers=8)
    drafter = drafter_for("draft_model", target)
    propose = drafter.propose
    state = {"bad": True}

    def sabotaged(seqs, num_tokens):
        out = propose(seqs, num_tokens)
        if state["bad"]:
            for p in out:
                p.tokens = [(t + 1) % 256 for t in p.tokens]
        return out

    drafter.propose = sabotaged
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=1, max_model_len=512)
    engine.planner = Planner(PlannerConfig(max_k=K, probe_every=4, learn_costs=False, probe_overhead=1.0),
                             CostTable({1: [1.0, 1.05, 1.1, 1.15]}))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    out = LLM(engine=engine).generate([prompt], params)[0]
    s = out.stats.summary()
    assert s["rounds_without_speculation"] >= 30 and s["probes"] >= 2
    state["bad"] = False
    back = LLM(engine=engine).generate([prompt], params)[0]
    reference = reference_greedy(target, prompt, 80, eos=set())
    assert out.token_ids == reference and back.token_ids == reference
    assert back.stats.num_accepted >= 40


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_ssd_rounds_planned_off_send_nothing_build_nothing_and_speculation_comes_back_exact(kind, byte_tokenizer):
    """SSD (in-process speculator): rounds the planner runs without speculation send the speculator nothing (the
    verifier never waits for it) but one budget-0 request once FLUSH_ROWS tokens have gathered; it builds
    nothing for them; the first round back brings the merged outcomes (no lookup) and drafts from the committed
    text, and the output stays the target's greedy decode."""
    target = make_tiny_llama(seed=4, num_layers=8)
    engine = ssd_engine_for(kind, target, byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    engine.planner = Scripted([K, K] + [0] * 70 + [K] * 40)
    requests = []
    propose = speculator.propose
    speculator.propose = lambda rows: requests.extend(rows) or propose(rows)
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=110,
                                                                    ignore_eos=True))
    forwards, lookups, sent, out = [], [], [], []
    while engine.has_unfinished():
        before, n, m = speculator.backend.forwards, speculator.stats.lookups, len(requests)
        out += engine.step()
        forwards.append(speculator.backend.forwards - before)
        lookups.append(speculator.stats.lookups - n)
        sent.append([(r.budget, r.rounds) for r in requests[m:]])
    flushes = [r for r in range(2, 72) if sent[r]]
    assert len(flushes) == 1 and sent[flushes[0]][0][0] == 0 and sent[flushes[0]][0][1] > 50
    assert sent[72] == [(K, 72 - flushes[0])]  # the outcomes of rounds flush .. 71, merged
    assert forwards[1] > 0 and forwards[2:72] == [0] * 70 and forwards[72] > 0
    assert lookups[2:73] == [0] * 71 and lookups[73] == 1  # round 73 looks up what round 72's reply built
    assert out[-1].outputs[0].token_ids == reference_greedy(target, [3, 1, 4, 1, 5, 9, 2, 6], 110, eos=set())


@pytest.mark.parametrize("kind", ["draft_model", "eagle3"])
def test_ssd_after_planned_off_rounds_the_backup_drafts_what_a_fresh_draft_of_the_committed_text_drafts(
        kind, byte_tokenizer):
    target = make_tiny_llama(seed=4, num_layers=8)
    engine = ssd_engine_for(kind, target, byte_tokenizer)
    engine.planner = Scripted([K, K, K] + [0] * 9)
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=100,
                                                                    ignore_eos=True))
    for _ in range(12):  # three drafting rounds, then nine without
        engine.step()
    seq = engine.requests["a"]
    assert fresh_proposal(kind, target, seq) == engine.drafter.propose([seq], [K])[0].tokens


def test_ssd_auto_backup_drafts_a_probe_after_planned_off_rounds_with_the_draft(byte_tokenizer):
    """Under ``backup: auto`` a miss may be answered by the n-gram lookup, but a probe after planned-off rounds
    (nothing was built, nothing looked up) is drafted by the neural draft: the planner judges the draft by it."""
    target = make_tiny_llama(seed=4, num_layers=8)
    engine = ssd_engine_for("eagle3", target, byte_tokenizer, fanout=[1], backup="auto")
    speculator = engine.drafter.speculator.speculator
    speculator.choice.choose = lambda *args: "fast"  # the measured choice, pinned to the lookup
    engine.planner = Scripted([K, K, K] + [0] * 6 + [K] * 40)
    backups = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda seqs, budgets: [backups.append((p.cache_hit, p.backup)) or p
                                                    for p in propose(seqs, budgets)]
    engine.add_request("a", list(b"abcabcabc"), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert backups[9] == (None, "neural")  # the probe after the off rounds
    assert (False, "fast") in backups[1:3] + backups[10:]  # real misses go to the chosen backup
