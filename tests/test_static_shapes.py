"""Fixed-shape forwards (what CUDA graphs replay) equal the dynamic ones; on CPU they run eagerly."""

from __future__ import annotations

import torch

from helpers import make_drafter, make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.cuda_graphs import StaticForward, runner_forward_fn
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams


def test_fixed_shape_forward_equals_dynamic_forward():
    target = make_tiny_llama(seed=7, num_layers=8)
    dynamic = ModelRunner(target, 4, 256, aux_layer_ids=(2, 4, 5))
    static_runner = ModelRunner(target, 4, 256, aux_layer_ids=(2, 4, 5))
    static = StaticForward(runner_forward_fn(static_runner, True), static_runner.kv, scratch_slot=3,
                           dtype=torch.float64, device="cpu", buckets=(1, 4), widths=(1, 6), enabled=False)
    prompts = {0: list(range(10, 40)), 1: list(range(50, 57)), 2: list(range(70, 71 + 18))}
    for runner in (dynamic, static_runner):
        for slot, p in prompts.items():
            runner.forward(ForwardBatch.causal([p], [slot], [0], torch.float64, "cpu"))
    # a ragged round over 3 of the slots (padded to bucket 4, width 6)
    tokens = [[1, 2, 3, 4, 5], [6], [7, 8]]
    slots = [2, 0, 1]
    starts = [len(prompts[s]) for s in slots]
    batch = ForwardBatch.causal(tokens, slots, starts, torch.float64, "cpu")
    expected = dynamic.forward(batch, capture_aux=True)
    got = static(batch)
    assert got is not None
    for row, t in enumerate(tokens):
        n = len(t)
        torch.testing.assert_close(got["logits"][row, :n], expected.logits[row, :n], rtol=0, atol=1e-10)
        torch.testing.assert_close(got["aux_hidden"][row, :n], expected.aux_hidden[row, :n], rtol=0, atol=1e-10)
    for layer in range(target.config.num_hidden_layers):
        for slot, start in zip(slots, starts):
            end = start + len(tokens[slots.index(slot)])
            torch.testing.assert_close(static_runner.kv.keys[layer][slot, :, :end],
                                       dynamic.kv.keys[layer][slot, :, :end], rtol=0, atol=1e-10)
    assert static(ForwardBatch.causal([[1]] * 5, [0, 1, 2, 0, 1], [40, 40, 40, 40, 40], torch.float64,
                                      "cpu")) is None  # no bucket of 5: the caller runs its dynamic path


def test_engine_with_fixed_shape_verification_is_lossless(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = LLMEngine(target, byte_tokenizer, make_drafter("noisy", target), num_speculative_tokens=4,
                       max_num_seqs=3, max_model_len=512)
    engine.static = StaticForward(runner_forward_fn(engine.target, False), engine.target.kv, scratch_slot=3,
                                  dtype=torch.float64, device="cpu", buckets=(1, 2, 3), widths=(1, 5),
                                  enabled=False)
    calls = []
    run = engine.static._run
    engine.static._run = lambda buf, *a: calls.append(1) or run(buf, *a)
    prompts = random_prompts(4, seed=9)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 16)
    assert calls, "the fixed-shape path was never used"
