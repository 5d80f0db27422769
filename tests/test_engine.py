"""The engine on tiny random float64 Llama targets: greedy losslessness with every drafter, cache rollback,
stopping rules, batching, abort and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from helpers import make_drafter, make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.drafters import NgramDrafter
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams

K = 4


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["ar", "ngram", "exact", "noisy"])
def test_greedy_output_equals_target_greedy(kind, tie, byte_tokenizer):
    target = make_tiny_llama(tie=tie, seed=3)
    engine = LLMEngine(target, byte_tokenizer, make_drafter(kind, target), num_speculative_tokens=K,
                       max_num_seqs=4, max_model_len=512)
    llm = LLM(engine=engine)
    prompts = random_prompts(10, seed=11)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 20)
    if kind in ("exact", "noisy"):
        assert max(max(o.stats.accepted_lengths) for o in outs) >= 2, "no multi-token acceptance happened"
    if kind == "exact":
        assert engine.stats.acceptance_rate > 0.95


def test_kv_cache_after_rejection_equals_fresh_prefill(byte_tokenizer):
    target = make_tiny_llama(seed=5)
    engine = LLMEngine(target, byte_tokenizer, make_drafter("noisy", target), num_speculative_tokens=K,
                       max_num_seqs=2, max_model_len=512)
    engine.add_request("a", list(range(40, 60)), SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    rejected = 0
    for _ in range(12):
        engine.step()
        seq = engine.requests["a"]
        rejected += seq.stats.accepted_lengths[-1] < K if seq.stats.accepted_lengths else 0
    assert rejected > 0, "the noisy drafter never got rejected; the test would prove nothing"
    fresh = ModelRunner(target, 1, 512)
    n = seq.num_cached
    assert n == len(seq.token_ids) - 1
    fresh.forward(ForwardBatch.causal([seq.token_ids[:n]], [0], [0], torch.float64, "cpu"))
    for layer in range(target.config.num_hidden_layers):
        for ours, theirs in ((engine.target.kv.keys, fresh.kv.keys), (engine.target.kv.values, fresh.kv.values)):
            torch.testing.assert_close(ours[layer][seq.slot, :, :n], theirs[layer][0, :, :n], rtol=0, atol=1e-12)


@pytest.mark.parametrize("max_tokens", [1, K, K + 1])
def test_max_tokens_is_a_hard_cap_even_when_a_block_is_accepted(max_tokens, byte_tokenizer):
    target = make_tiny_llama(seed=3)
    llm = LLM(engine=LLMEngine(target, byte_tokenizer, make_drafter("exact", target), num_speculative_tokens=K,
                               max_model_len=512, eos_token_ids=set()))
    prompt = list(range(60, 75))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
    assert out.token_ids == reference_greedy(target, prompt, max_tokens, eos=set())
    assert out.finish_reason == "length"


def test_eos_in_the_middle_of_an_accepted_block(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    prompt = list(range(60, 75))
    ref = reference_greedy(target, prompt, 12, eos=set())
    stop_at = next(i for i in range(2, 12) if i % (K + 1) not in (0, K) and ref[i] not in ref[:i])
    engine = LLMEngine(target, byte_tokenizer, make_drafter("exact", target), num_speculative_tokens=K,
                       max_model_len=512, eos_token_ids={ref[stop_at]})
    out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.token_ids == ref[: stop_at + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == ref[stop_at]
    assert out.stats.num_emitted == stop_at  # the prefill token is not a round's


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_tokens(include, byte_tokenizer):
    target = make_tiny_llama(seed=8)
    prompt = [ord(c) for c in "stop strings: "]
    engine = LLMEngine(target, byte_tokenizer, make_drafter("exact", target), num_speculative_tokens=K,
                       max_model_len=512, eos_token_ids=set())
    ref = reference_greedy(target, prompt, 30, eos=set())
    text = byte_tokenizer.decode(ref)
    stop = text[10:13]
    first = text.find(stop)
    out = LLM(engine=engine).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], include_stop_str_in_output=include))[0]
    assert out.text == text[: first + (len(stop) if include else 0)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    # no token after the one that completed the stop string
    assert out.token_ids == ref[: len(out.token_ids)]
    assert stop in byte_tokenizer.decode(out.token_ids) and stop not in byte_tokenizer.decode(out.token_ids[:-1])


def test_bad_requests_raise_clear_errors(byte_tokenizer):
    engine = LLMEngine(make_tiny_llama(), byte_tokenizer, None, max_model_len=64)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("b", "", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("c", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("d", [1, 100000], SamplingParams())
    engine.add_request("e", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("e", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_abort_frees_the_slot_and_stops_reporting(byte_tokenizer):
    target = make_tiny_llama()
    engine = LLMEngine(target, byte_tokenizer, NgramDrafter(), num_speculative_tokens=K, max_num_seqs=1,
                       max_model_len=512)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.request_id for o in engine.step()] == ["a"]  # b waits: one slot
    engine.abort("a")
    reported = [o.request_id for _ in range(5) for o in engine.step()]
    assert "a" not in reported and "b" in reported
    assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_across_batches(byte_tokenizer):
    target = make_tiny_llama(seed=2, init_std=0.1)
    params = SamplingParams(temperature=1.0, max_tokens=15, seed=42, ignore_eos=True)
    outs = []
    for others in (0, 3):
        engine = LLMEngine(target, byte_tokenizer, make_drafter("noisy", target), num_speculative_tokens=K,
                           max_num_seqs=4, max_model_len=512)
        prompts = [[1, 2, 3]] + [[9, 9, i] for i in range(others)]
        sp = [params] + [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * others
        outs.append(LLM(engine=engine).generate(prompts, sp)[0].token_ids)
    assert outs[0] == outs[1]


def test_greedy_and_sampled_rows_share_a_batch(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = LLMEngine(target, byte_tokenizer, make_drafter("noisy", target), num_speculative_tokens=K,
                       max_num_seqs=4, max_model_len=512)
    prompts = random_prompts(4, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=1.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.5, top_k=5,
                                                                              max_tokens=16)]
    outs = LLM(engine=engine).generate(prompts, params)
    for i in (0, 2):
        assert outs[i].token_ids == reference_greedy(target, prompts[i], 16)


class FailingDrafter(NgramDrafter):
    """Proposes like the n-gram drafter, then raises from the third round on."""

    def __init__(self):
        super().__init__(1, 3)
        self.calls = 0

    def propose(self, seqs, num_tokens):
        self.calls += 1
        if self.calls >= 3:
            raise RuntimeError("draft device lost")
        return super().propose(seqs, num_tokens)


def test_a_failing_drafter_degrades_to_ordinary_decoding(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    drafter = FailingDrafter()
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=K, max_model_len=512)
    prompt = (list(range(30, 36)) * 4)[:20]
    out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert out.token_ids == reference_greedy(target, prompt, 20)
    assert not drafter.healthy and "draft device lost" in drafter.error
    assert drafter.calls == 3  # never called again after the failure
