"""Chunked prefill (a per-step token budget, vLLM's chunked prefill) on tiny float64 targets: the same greedy tokens
as the target's own decode for every chunk size and mode (AR, n-gram / draft-model / EAGLE-3 SD, SSD), running
requests keep their rounds while a long prompt is prefilled, a drafter receives the whole prompt's aux states
once, when the prompt is cached, and the drafts (SD drafters, the SSD speculator through chunked ADD messages)
prefill chunk by chunk too, to the same draft cache and the same proposals."""

from __future__ import annotations

import pytest
import torch

from helpers import eagle3_head_for, noisy_copy, reference_greedy
from serving_helpers import KINDS, K, RecordingAuxDrafter, build_engine, long_prompts, make_target
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd import protocol as p

DRAFTED = ["draft", "eagle3", "ssd", "ssd_eagle3"]


class WireSpeculator:
    """An in-process speculator whose ADD messages go through the wire codec (what a remote speculator gets)."""

    def __init__(self, local):
        self.local, self.adds = local, []

    def add(self, seq: p.NewSequence) -> None:
        seq = p.decode_add(p.encode_add(seq))
        self.adds.append((seq.start, len(seq.token_ids), seq.done))
        self.local.add(seq)

    def __getattr__(self, name):
        return getattr(self.local, name)


def drafted_engine(kind: str, target, tokenizer, **engine_args) -> LLMEngine:
    """``build_engine``'s SD kinds, and SSD (draft model or EAGLE-3 head) with its ADDs on the wire codec."""
    if not kind.startswith("ssd"):
        return build_engine(kind, target, tokenizer, **engine_args)
    eagle = kind == "ssd_eagle3"
    spec = SpeculativeConfig(method="eagle3" if eagle else "draft_model", model="in-memory",
                             num_speculative_tokens=K, fanout=[2], speculator="local")
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=2, max_model_len=512, speculative_config=spec)
    draft = eagle3_head_for(target, draft_vocab=257) if eagle else noisy_copy(target, 0.02)
    drafter = build(cfg, target, tokenizer=tokenizer, draft=draft).drafter
    drafter.speculator = WireSpeculator(drafter.speculator)
    return LLMEngine(target, tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2, max_model_len=512,
                     **engine_args)


def draft_backend(engine: LLMEngine):
    drafter = engine.drafter
    return drafter.speculator.local.speculator.backend if hasattr(drafter, "speculator") else drafter.backend


def record_prefills(engine: LLMEngine) -> list[int]:
    """Positions each draft prefill call caches (the draft backend's, wherever it runs)."""
    backend, sizes = draft_backend(engine), []
    prefill = backend.prefill

    def recording(slot, token_ids, aux, start=0, end=None, pending=None):
        sizes.append((len(token_ids) - 1 if end is None else end) - start)
        return prefill(slot, token_ids, aux, start, end, pending)

    backend.prefill = recording
    return sizes


def record_proposals(engine: LLMEngine) -> dict[str, list[list[int]]]:
    drafter, proposals = engine.drafter, {}
    propose = drafter.propose

    def recording(seqs, num_tokens):
        out = propose(seqs, num_tokens)
        for seq, prop in zip(seqs, out):
            proposals.setdefault(seq.request_id, []).append(prop.tokens)
        return out

    drafter.propose = recording
    return proposals


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget,chunk", [(13, 512), (24, 5), (64, 64), (512, 512)],
                         ids=["tight", "chunk5", "64", "unchunked"])
def test_chunked_prefill_gives_the_targets_greedy_tokens(kind, budget, chunk, byte_tokenizer):
    target = make_target()
    engine = build_engine(kind, target, byte_tokenizer, max_num_batched_tokens=budget, prefill_chunk=chunk,
                          enable_prefix_caching=False)
    widths = []
    forward = engine.target.forward

    def recording(batch, **kwargs):
        widths.append(max(batch.num_tokens))
        return forward(batch, **kwargs)

    engine.target.forward = recording
    prompts = long_prompts(seed=1)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 12)
    assert max(widths) == min(budget, chunk, 150)  # the budget bounds every forward, and is used


@pytest.mark.parametrize("kind", ["ar", "draft", "eagle3", "ssd"])
def test_a_running_request_advances_while_a_long_prompt_is_prefilled(kind, byte_tokenizer):
    target = make_target()
    budget = 16
    engine = drafted_engine(kind, target, byte_tokenizer, max_num_batched_tokens=budget,
                            enable_prefix_caching=False)
    prefills = record_prefills(engine) if kind != "ar" else []
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.step()
    engine.step()
    long_prompt = long_prompts(seed=2, lengths=(300,))[0]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=8))
    short, long = engine.requests["short"], engine.requests["long"]
    steps = 0
    while long.num_output_tokens == 0:
        before_out, before_cached, before_prefills = short.num_output_tokens, long.num_cached, len(prefills)
        engine.step()
        steps += 1
        assert short.num_output_tokens > before_out, "the running request lost its round"
        if long.prefilling:
            assert long.num_cached - before_cached <= budget - 1
        # the draft prefills at most this step's chunk (the last one with the first token)
        assert sum(prefills[before_prefills:]) <= budget - 1
    assert kind == "ar" or sum(prefills) >= 300
    assert steps >= 300 // (budget - 1), "the long prompt was not chunked"
    while engine.has_unfinished():
        engine.step()
    assert long.output_token_ids == reference_greedy(target, long_prompt, 8)
    assert short.output_token_ids == reference_greedy(target, [5, 6, 7], 200, eos=set())


def test_the_drafter_gets_the_whole_prompt_aux_once_the_prompt_is_cached(byte_tokenizer):
    target = make_target()
    prompts = long_prompts(seed=3, lengths=(130, 20))
    added = {}
    for budget in (512, 17):
        drafter = RecordingAuxDrafter((2, 4, 5))
        engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_num_seqs=2,
                           max_model_len=512, max_num_batched_tokens=budget, enable_prefix_caching=False)
        LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        added[budget] = {rid: (ids, aux) for rid, ids, aux, _ in drafter.added}
        assert len(drafter.added) == len(prompts)
    for rid, (ids, aux) in added[17].items():
        ref_ids, ref_aux = added[512][rid]
        assert ids == ref_ids and aux.shape == (len(ids) - 1, 3 * target.config.hidden_size)
        torch.testing.assert_close(aux, ref_aux, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", DRAFTED)
def test_drafts_prefill_chunk_by_chunk_to_the_same_proposals(kind, byte_tokenizer):
    target = make_target()
    prompts = long_prompts(seed=4, lengths=(230, 20))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = {}
    for budget in (512, 24):
        engine = drafted_engine(kind, target, byte_tokenizer, max_num_batched_tokens=budget,
                                enable_prefix_caching=False)
        sizes, proposals = record_prefills(engine), record_proposals(engine)
        outs = LLM(engine=engine).generate(prompts, params)
        runs[budget] = proposals
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(target, prompt, 10, eos=set())
        if budget == 512:  # one prefill per prompt, its whole length but the sampled token
            assert sorted(sizes) == [20, 230]
        else:  # in chunks within the budget, covering each prompt exactly once
            assert max(sizes) <= budget and sum(sizes) == 250 and len(sizes) >= 230 // budget
        if kind.startswith("ssd"):  # one ADD per chunk, in order, the last one done
            adds = engine.drafter.speculator.adds
            assert sum(n - done for _, n, done in adds) == 250 and sum(done for *_, done in adds) == 2
            assert len(adds) == (2 if budget == 512 else len(sizes))
    assert runs[24] == runs[512] and any(any(p) for p in runs[24].values())


@pytest.mark.parametrize("kind", DRAFTED)
def test_a_drafter_catches_up_on_a_reused_prefix_within_the_token_budget(kind, byte_tokenizer):
    target = make_target()
    first, tail = long_prompts(seed=6, lengths=(330, 20))
    second = first[:320] + tail  # its first 320 positions (5 blocks) come from the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    runs = {}
    for budget in (512, 16):
        engine = drafted_engine(kind, target, byte_tokenizer, max_num_batched_tokens=budget)
        LLM(engine=engine).generate([first], params)
        engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        engine.step()
        engine.step()
        sizes, proposals = record_prefills(engine), record_proposals(engine)
        engine.add_request("second", second, params)
        seq, short = engine.requests["second"], engine.requests["short"]
        while seq.num_output_tokens == 0:
            before_out, before = short.num_output_tokens, len(sizes)
            engine.step()
            assert short.num_output_tokens > before_out, "the running request lost its round"
            if budget == 16:  # the draft prefills at most what the step's budget leaves after the round
                assert sum(sizes[before:]) <= budget - (1 + K)
        assert seq.num_reused == 320 and sum(sizes) == len(second)  # every position drafted once
        assert budget == 16 or sorted(sizes) == [20, 320]  # the reused prefix, then the rest
        while engine.has_unfinished():
            engine.step()
        assert seq.output_token_ids == reference_greedy(target, second, 10, eos=set())
        assert short.output_token_ids == reference_greedy(target, [5, 6, 7], 200, eos=set())
        runs[budget] = proposals["second"]
    assert runs[16] == runs[512] and any(runs[16])


def test_two_long_prompts_share_one_step_token_budget(byte_tokenizer):
    target = make_target()
    budget = 40
    engine = build_engine("ngram", target, byte_tokenizer, max_num_seqs=4, max_num_batched_tokens=budget,
                          enable_prefix_caching=False)
    forwarded = []
    forward = engine.target.forward

    def recording(batch, **kwargs):
        forwarded[-1] += sum(batch.num_tokens)
        return forward(batch, **kwargs)

    engine.target.forward = recording
    for rid, prompt in (("a", [5, 6, 7]), ("b", [9, 8, 7, 6])):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    forwarded.append(0)
    engine.step()
    prompts = long_prompts(seed=7, lengths=(200, 210))
    for rid, prompt in zip(("long0", "long1"), prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4))
    while "long1" in engine.requests:
        forwarded.append(0)
        engine.step()
        # every round and every prompt chunk of the step within the budget, but the round of a prompt completed in
        # the step (it joins that step's round)
        assert forwarded[-1] <= budget + (1 + K)
    assert len(forwarded) > (200 + 210) // budget


def test_the_store_grows_once_for_a_long_prompt_not_per_chunk(byte_tokenizer):
    target = make_target()
    engine = LLMEngine(target, byte_tokenizer, max_num_seqs=2, max_model_len=2048, max_num_batched_tokens=64,
                       enable_prefix_caching=False)
    kv, capacities = engine.target.kv, []
    resize = kv.resize

    def recording(num_rows, capacity):
        if capacity > kv.capacity:
            capacities.append(capacity)
        return resize(num_rows, capacity)

    kv.resize = recording
    prompt = long_prompts(seed=8, lengths=(1400,))[0]
    out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert out.token_ids == reference_greedy(target, prompt, 4)
    assert len(capacities) == 1 and capacities[0] >= 1400  # one growth (a copy of the whole store), not one per chunk
