"""Chunked prefill (a per-step token budget, vLLM's chunked prefill) on tiny float64 targets: the same greedy tokens
as the target's own decode for every chunk size and mode (AR, n-gram / draft-model / EAGLE-3 SD, SSD), running
requests keep their rounds while a long prompt is prefilled, and a drafter receives the whole prompt's aux states
once, when the prompt is cached."""

from __future__ import annotations

import pytest
import torch

from helpers import reference_greedy
from serving_helpers import KINDS, K, RecordingAuxDrafter, build_engine, long_prompts, make_target
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams


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


@pytest.mark.parametrize("kind", ["ar", "draft"])
def test_a_running_request_advances_while_a_long_prompt_is_prefilled(kind, byte_tokenizer):
    target = make_target()
    budget = 16
    engine = build_engine(kind, target, byte_tokenizer, max_num_batched_tokens=budget, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], params)
    engine.step()
    engine.step()
    long_prompt = long_prompts(seed=2, lengths=(300,))[0]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=8))
    short, long = engine.requests["short"], engine.requests["long"]
    steps = 0
    while long.num_output_tokens == 0:
        before_out, before_cached = short.num_output_tokens, long.num_cached
        engine.step()
        steps += 1
        assert short.num_output_tokens > before_out, "the running request lost its round"
        if long.prefilling:
            assert long.num_cached - before_cached <= budget - 1
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
