"""Automatic prefix caching: a later request sharing a prompt prefix (a conversation's earlier turn, a shared system
prompt) reuses its cached blocks and gets the same tokens as without the cache (greedy and seeded sampling,
float64; AR, SD with and without aux states, SSD); the cache stays within its bound, evicting least recently
used chains from the tail."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama, reference_greedy
from ssd_eagle.engine.llm import LLM
from ssd_eagle.kv_cache import KVCache
from ssd_eagle.prefix_cache import PrefixCache
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.engine.llm_engine import LLMEngine
from serving_helpers import KINDS, RecordingAuxDrafter, build_engine, long_prompts, make_target

BLOCK = 64


def conversation(engine, system: list[int], turns: list[list[int]], params: SamplingParams):
    """Each turn's prompt is the previous prompt + its answer + the new user tokens. Returns (outputs, reused)."""
    prompt, outs, reused = list(system), [], []
    for user in turns:
        prompt = prompt + user
        rid = f"turn{len(outs)}"
        engine.add_request(rid, prompt, params)
        seq = engine.requests[rid]
        out = None
        while engine.has_unfinished():
            for o in engine.step():
                out = o if o.finished else out
        reused.append(seq.num_reused)
        outs.append(out.token_ids)
        prompt = prompt + out.token_ids
    return outs, reused


@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_reuses_its_earlier_turns_and_keeps_its_tokens(kind, byte_tokenizer):
    target = make_target()
    system, *turns = long_prompts(seed=5, lengths=(140, 9, 30, 70))
    params = SamplingParams(temperature=0.0, max_tokens=40)
    cached_outs, reused = conversation(build_engine(kind, target, byte_tokenizer, max_num_batched_tokens=48),
                                       system, turns, params)
    plain_outs, none = conversation(build_engine(kind, target, byte_tokenizer, enable_prefix_caching=False),
                                    system, turns, params)
    assert cached_outs == plain_outs
    prompt = list(system)
    for user, out in zip(turns, cached_outs):
        prompt = prompt + user
        assert out == reference_greedy(target, prompt, 40)
        prompt = prompt + out
    assert none == [0, 0, 0]
    # turn 0 finds nothing; a later turn reuses the full blocks of the previous turn's committed tokens (its prompt
    # only, with EAGLE-3: the aux states of an answer are not kept), up to the block of its last prompt token
    assert reused[0] == 0
    prompt = list(system)
    for i, (user, out) in enumerate(zip(turns, cached_outs)):
        prompt = prompt + user
        if i + 1 < len(turns):
            saved = len(prompt) if kind == "eagle3" else len(prompt) + len(out) - 1
            new_prompt = len(prompt) + len(out) + len(turns[i + 1])
            assert reused[i + 1] >= min(saved // BLOCK, (new_prompt - 1) // BLOCK) * BLOCK > 0
        prompt = prompt + out


def test_a_drafter_gets_the_same_prompt_aux_from_a_reused_prefix(byte_tokenizer):
    target = make_target()
    shared = long_prompts(seed=9, lengths=(150,))[0]
    added = {}
    for cache in (True, False):
        drafter = RecordingAuxDrafter((2, 4, 5))
        engine = LLMEngine(target, byte_tokenizer, drafter, max_num_seqs=2, max_model_len=512,
                           enable_prefix_caching=cache)
        llm = LLM(engine=engine)
        llm.generate([shared + [9]], SamplingParams(temperature=0.0, max_tokens=3))
        llm.generate([shared + [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
        added[cache] = drafter.added[-1][2]
        assert drafter.added[-1][3] == (2 * BLOCK if cache else 0)
    assert added[True].shape == (153, 3 * target.config.hidden_size)
    torch.testing.assert_close(added[True], added[False], rtol=0, atol=1e-10)


def test_seeded_sampling_is_the_same_with_a_reused_prefix(byte_tokenizer):
    target = make_target()
    shared = long_prompts(seed=6, lengths=(200,))[0]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30)
    results = {}
    for cache in (True, False):
        engine = build_engine("draft", target, byte_tokenizer, enable_prefix_caching=cache)
        llm = LLM(engine=engine)
        llm.generate([shared + [1, 2]], params)  # fills the cache
        results[cache] = [o.token_ids for o in llm.generate([shared + [3, 4, 5], shared], params)]
    assert results[True] == results[False]


def test_a_prompt_that_is_entirely_cached_still_prefills_its_last_token(byte_tokenizer):
    target = make_target()
    prompt = long_prompts(seed=7, lengths=(2 * BLOCK,))[0]
    engine = build_engine("ar", target, byte_tokenizer)
    llm = LLM(engine=engine)
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0].token_ids
    engine.add_request("again", prompt, SamplingParams(temperature=0.0, max_tokens=5))
    seq = engine.requests["again"]
    while engine.has_unfinished():
        engine.step()
    assert seq.num_reused == BLOCK  # the second block holds the last prompt token: recomputed for its logits
    assert seq.output_token_ids == first == reference_greedy(target, prompt, 5)


def filled_cache(num_tokens: int, seed: int = 0) -> tuple[KVCache, list[int]]:
    kv = KVCache(2, 1, 2, 4, 1024, torch.float64, "cpu")
    kv.reserve(num_tokens)
    g = torch.Generator().manual_seed(seed)
    for store in (*kv.keys, *kv.values):
        store.copy_(torch.randn(store.shape, generator=g, dtype=store.dtype))
    return kv, torch.randint(0, 256, (num_tokens,), generator=g).tolist()


def test_blocks_round_trip_and_are_keyed_by_the_whole_prefix():
    kv, tokens = filled_cache(3 * BLOCK + 10)
    cache = PrefixCache(max_bytes=2**30)
    cache.save(tokens, kv, 0, None)
    assert len(cache) == 3  # full blocks only
    other = KVCache(2, 2, 2, 4, 1024, torch.float64, "cpu")
    n, aux = cache.load(tokens[: 2 * BLOCK + 5], other, 1)
    assert n == 2 * BLOCK and aux is None
    torch.testing.assert_close(other.read(1, 0, n), kv.read(0, 0, n), rtol=0, atol=0)
    changed = [tokens[0] + 1] + tokens[1:]  # same later blocks, different first token: nothing matches
    assert cache.load(changed, other, 1)[0] == 0


def test_the_cache_evicts_least_recently_used_chains_tail_first_within_its_bound():
    kv, tokens = filled_cache(4 * BLOCK)
    block_bytes = kv.bytes_per_position * BLOCK
    cache = PrefixCache(max_bytes=5 * block_bytes)
    a, b = tokens[: 3 * BLOCK], tokens[BLOCK:]  # two chains of 3 blocks each (b starts elsewhere)
    cache.save(a, kv, 0, None)
    cache.save(b, kv, 0, None)  # 6 blocks: a's tail goes
    assert len(cache) == 5 and cache.nbytes == 5 * block_bytes <= cache.max_bytes
    scratch = KVCache(2, 1, 2, 4, 1024, torch.float64, "cpu")
    assert cache.load(a, scratch, 0)[0] == 2 * BLOCK  # a's head survives; touching it makes b the oldest
    cache.save(tokens[2 * BLOCK:] + tokens[: BLOCK], kv, 0, None)  # a third chain of 3 blocks
    assert cache.nbytes <= cache.max_bytes
    assert cache.load(a, scratch, 0)[0] == 2 * BLOCK
    assert cache.load(b, scratch, 0)[0] == 0  # b lost its tail first, then its head


def test_the_engine_keeps_its_prefix_cache_within_prefix_cache_memory(byte_tokenizer):
    target = make_tiny_llama(seed=4)
    bytes_per_block = 2 * 4 * 2 * 16 * 8 * BLOCK  # layers x (k, v) x kv heads x head dim x float64 x tokens
    engine = build_engine("ar", target, byte_tokenizer, prefix_cache_memory=3 * bytes_per_block / 2**30)
    prompts = long_prompts(seed=8, lengths=(200, 200, 200))
    LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    assert 0 < engine.prefix_cache.nbytes <= 3 * bytes_per_block and len(engine.prefix_cache) == 3
