"""Tree speculation: tree attention equals path attention, greedy trees are lossless, the cache keeps exactly the
accepted branch, and at T > 0 the output law is the target's with several siblings per node."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import LAW_VOCAB as V, exact_law, make_tiny_llama, pooled_chisquare, random_prompts, reference_greedy
from ssd_eagle.drafters.base import Drafter, Proposal
from ssd_eagle.engine.llm import LLM
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams

PARENTS = [0, 0, 1, 1, 2, 3, 3, 5]  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6, 7}; 5 -> {8}


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


def test_tree_logits_equal_path_logits():
    target = make_tiny_llama(seed=2)
    prefix = list(range(20, 32))
    nodes = [5, 9, 17, 33, 2, 71, 8, 90]
    runner = ModelRunner(target, 2, 256)
    runner.forward(ForwardBatch.causal([prefix[:-1]], [1], [0], torch.float64, "cpu"))
    batch = ForwardBatch.tree([prefix[-1]], [nodes], [PARENTS], [1], [len(prefix) - 1], torch.float64, "cpu")
    tree_logits = runner.forward(batch).logits[0]
    with torch.no_grad():
        for node in range(len(nodes) + 1):
            ids = prefix + [nodes[j - 1] for j in path_to(node, PARENTS)]
            expected = target(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(tree_logits[node], expected, rtol=0, atol=1e-10)


class OracleTreeDrafter(Drafter):
    """Trees with two children per node: the target's greedy token on some branches, a wrong token on others,
    so that rounds accept different branches (and different depths)."""

    name = "oracle_tree"

    def __init__(self, target, depth: int = 3):
        self.target, self.depth, self.calls = target, depth, 0

    def propose(self, seqs, num_tokens):
        out = []
        for seq, budget in zip(seqs, num_tokens):
            self.calls += 1
            depth = min(self.depth, budget)
            if depth == 0:
                out.append(Proposal([]))
                continue
            truth = reference_greedy(self.target, seq.token_ids, depth, eos=set())
            tokens, parents, chain_node = [], [], 0
            for d in range(depth):
                right_first = (self.calls + d) % 2 == 0
                wrong = (truth[d] + 1 + self.calls) % 200
                pair = [truth[d], wrong] if right_first else [wrong, truth[d]]
                if (self.calls + d) % 5 == 4:  # sometimes both children are wrong
                    pair = [wrong, (wrong + 1) % 200]
                first = len(tokens) + 1
                tokens += pair
                parents += [chain_node, chain_node]
                chain_node = first if pair[0] == truth[d] else first + 1
            out.append(Proposal(tokens, parents=parents))
        return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_greedy_tree_output_equals_target_greedy(tie, byte_tokenizer):
    target = make_tiny_llama(seed=3, tie=tie)
    engine = LLMEngine(target, byte_tokenizer, OracleTreeDrafter(target), num_speculative_tokens=3,
                       max_num_seqs=3, max_model_len=512, max_draft_tokens=6)
    prompts = random_prompts(5, seed=8)
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 20)
    lengths = [k for o in outs for k in o.stats.accepted_lengths]
    assert max(lengths) >= 2 and 0 in lengths


def test_kv_cache_after_tree_acceptance_equals_fresh_prefill(byte_tokenizer):
    target = make_tiny_llama(seed=5)
    engine = LLMEngine(target, byte_tokenizer, OracleTreeDrafter(target), num_speculative_tokens=3,
                       max_num_seqs=1, max_model_len=512, max_draft_tokens=6)
    engine.add_request("a", list(range(40, 55)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    for _ in range(6):
        engine.step()
    seq = engine.requests["a"]
    assert any(k >= 2 for k in seq.stats.accepted_lengths)
    n = seq.num_cached
    fresh = ModelRunner(target, 1, 512)
    fresh.forward(ForwardBatch.causal([seq.token_ids[:n]], [0], [0], torch.float64, "cpu"))
    for layer in range(target.config.num_hidden_layers):
        torch.testing.assert_close(engine.target.kv.keys[layer][seq.slot, :, :n], fresh.kv.keys[layer][0, :, :n],
                                   rtol=0, atol=1e-12)
        torch.testing.assert_close(engine.target.kv.values[layer][seq.slot, :, :n],
                                   fresh.kv.values[layer][0, :, :n], rtol=0, atol=1e-12)


class SiblingTreeDrafter(Drafter):
    """A full binary tree of depth 2 with fixed, prompt-dependent children (deterministic proposals)."""

    name = "siblings"

    def propose(self, seqs, num_tokens):
        out = []
        for seq, budget in zip(seqs, num_tokens):
            if budget < 2:
                out.append(Proposal([]))
                continue
            a = seq.token_ids[-1]
            c1, c2 = (a + 1) % V, (a + 2) % V
            out.append(Proposal([c1, c2, (c1 + 1) % V, (c1 + 3) % V, (c2 + 1) % V, c2 % V],
                                parents=[0, 0, 1, 1, 2, 2]))
        return out


def test_tree_output_law_equals_the_targets(byte_tokenizer):
    target = make_tiny_llama(vocab_size=V, seed=6, init_std=0.15)
    engine = LLMEngine(target, byte_tokenizer, SiblingTreeDrafter(), num_speculative_tokens=2, max_num_seqs=64,
                       max_model_len=64, max_draft_tokens=6)
    prompt, temperature, n = [1, 3, 0, 2, 2], 0.9, 6000
    params = [SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    outs = LLM(engine=engine).generate([prompt] * n, params)
    flat = np.array([sum(t * V ** (3 - j) for j, t in enumerate(o.token_ids)) for o in outs])
    counts = np.bincount(flat, minlength=V**4)
    assert engine.stats.num_accepted > n // 4, "the trees must be accepted often enough to matter"
    assert pooled_chisquare(counts, exact_law(target, prompt, temperature)) > 1e-4


def test_only_plain_causal_batches_skip_the_mask():
    """SDPA's own causal mode is used only for batches built causal: a tree from position 0 (siblings must not see
    each other) keeps its mask. A field named like the ``causal`` builder once defaulted to that (truthy) method."""
    tree = ForwardBatch.tree([5], [[6, 7]], [[0, 0]], [0], [0], torch.float32, "cpu")
    assert tree.maskless is False and tree.plain_causal is False
    assert ForwardBatch.causal([[1, 2, 3]], [0], [0], torch.float32, "cpu").maskless is True


def test_a_cache_grown_inside_inference_mode_can_still_be_compacted():
    """The cache grows during a forward (inference mode); tree verification compacts it afterwards, outside one.
    A store reallocated as an inference tensor made that a RuntimeError (seen in bench_ssd's tree SD)."""
    from ssd_eagle.kv_cache import KVCache

    kv = KVCache(1, 1, 1, 2, 1024, torch.float32, "cpu")
    with torch.inference_mode():
        kv.reserve(300)
        kv.keys[0][0, 0, 5] = 1.0
    assert kv.capacity >= 300 and not kv.keys[0].is_inference()
    kv.compact(0, torch.tensor([5]), 2)
    assert torch.equal(kv.keys[0][0, 0, 2], torch.ones(2))
