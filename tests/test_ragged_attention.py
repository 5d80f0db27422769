"""Ragged decode attention (ssd_eagle.model_runner.ragged_decode_attention): single-token rows attend over their
own cached prefix instead of the batch's padded length, with the same result as SDPA over the padded mask, and a
batched engine using it still decodes every row token for token as the target's greedy decode."""

from __future__ import annotations

import torch
from helpers import make_byte_tokenizer, make_tiny_llama, reference_greedy
from serving_helpers import long_prompts

import ssd_eagle.model_runner as model_runner
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.sampling_params import SamplingParams


def _padded_batch(lengths, heads=6, kv_heads=2, dim=8, capacity=512):
    g = torch.Generator().manual_seed(0)
    B = len(lengths)
    query = torch.randn(B, heads, 1, dim, generator=g, dtype=torch.float64)
    store = torch.randn(2, B, kv_heads, capacity, dim, generator=g, dtype=torch.float64)
    kv_len = max(lengths)
    visible = torch.arange(kv_len)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.zeros(B, 1, 1, kv_len, dtype=torch.float64).masked_fill_(~visible[:, None, None],
                                                                         torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    return module, query, store[0, :, :, :kv_len], store[1, :, :, :kv_len], mask


def test_rows_attend_over_their_own_prefix_as_the_padded_mask_does():
    module, query, key, value, mask = _padded_batch([3, 400, 170, 1])
    assert model_runner._prefix_lengths(mask, query, 0.0) == [3, 400, 170, 1]
    ragged, _ = model_runner.ragged_decode_attention(module, query, key, value, mask, scaling=0.3)
    padded, _ = model_runner.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ragged.shape == padded.shape == (4, 1, 6, 8)
    torch.testing.assert_close(ragged, padded, rtol=1e-12, atol=1e-12)


def test_batches_it_cannot_help_take_plain_sdpa():
    module, query, key, value, mask = _padded_batch([380, 400, 390, 400])
    assert model_runner._prefix_lengths(mask, query, 0.0) is None  # under a fifth of padding
    _, query, _, _, mask = _padded_batch([3, 40])
    assert model_runner._prefix_lengths(mask, query, 0.0) is None  # short contexts: padding is cheap
    _, query, _, _, mask = _padded_batch([3, 400])
    assert model_runner._prefix_lengths(None, query, 0.0) is None
    assert model_runner._prefix_lengths(mask, query, 0.1) is None  # dropout
    hole = mask.clone()
    hole[1, ..., 5] = torch.finfo(torch.float64).min  # not a prefix (a tree's sibling)
    assert model_runner._prefix_lengths(hole, query, 0.0) is None
    two = torch.cat([query, query], dim=2)
    assert model_runner._prefix_lengths(mask.expand(2, 1, 2, 400), two, 0.0) is None  # two tokens a row


def test_a_batch_of_mixed_contexts_decodes_each_row_as_greedy(monkeypatch):
    target = make_tiny_llama(seed=3)
    engine = LLMEngine(target, make_byte_tokenizer(), max_num_seqs=4, enable_prefix_caching=False)
    assert target.config._attn_implementation == model_runner.RAGGED_ATTENTION
    used = []
    prefix_lengths = model_runner._prefix_lengths
    monkeypatch.setattr(model_runner, "_prefix_lengths", lambda *a: used.append(prefix_lengths(*a)) or used[-1])
    prompts = long_prompts(seed=1, lengths=(300, 5, 120, 40))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert any(n is not None for n in used)  # the rounds attended row by row
    monkeypatch.undo()
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)] == reference_greedy(target, prompt, 20, eos=set())
