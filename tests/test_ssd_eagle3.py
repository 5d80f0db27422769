"""SSD-EAGLE-3: the feature-conditioned head in the speculator, chains and trees.

A random head rarely predicts the target, so these tests use a large fan-out (most tokens of the tiny vocabulary
are cached) to make hits common and misses still possible; the draft's quality is not what they test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import eagle3_head_for, make_tiny_llama, random_prompts, reference_greedy
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters.backends import Eagle3Backend
from ssd_eagle.drafters.eagle3 import Eagle3Drafter
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.speculator import Speculator, SpecRequest

K = 3


def eagle_ssd_engine(target, head, tokenizer, tree: int = 0, fanout=(60,), max_num_seqs=3, speculator="local"):
    spec = SpeculativeConfig(method="eagle3", model="in-memory", num_speculative_tokens=K, fanout=list(fanout),
                             speculator=speculator, tree_budget=tree, tree_depth=K, tree_topk=2)
    cfg = EngineConfig(model="in-memory", mode="ssd", max_num_seqs=max_num_seqs, max_model_len=256,
                       speculative_config=spec)
    return build(cfg, target, tokenizer=tokenizer, draft=head)


def target_aux(target, head, committed: list[int]) -> torch.Tensor:
    """The target's aux hidden states of every committed token but the last (what the engine sends at prefill)."""
    runner = ModelRunner(target, 1, 256, aux_layer_ids=head.config.aux_layer_ids)
    return runner.forward(ForwardBatch.causal([committed[:-1]], [0], [0], torch.float64, "cpu"), capture_aux=True,
                          compute_logits=False).aux_hidden[0]


@pytest.fixture(scope="module")
def target_and_head():
    target = make_tiny_llama(seed=4, num_layers=8, vocab_size=80, max_positions=256)
    return target, eagle3_head_for(target, draft_vocab=80)


@pytest.mark.parametrize("tree", [0, 6], ids=["chain", "tree"])
def test_greedy_ssd_eagle3_equals_target_greedy_with_hits_and_misses(tree, target_and_head, byte_tokenizer):
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, tree=tree, fanout=(20,) if tree else (60,))
    prompts = [[t % 80 for t in p] for p in random_prompts(4, seed=3)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups > stats.cache_hits, "hits and misses must both occur"


def test_a_seeded_round_runs_fewer_drafter_forwards_than_an_unseeded_one(target_and_head, byte_tokenizer):
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer)
    speculator = engine.drafter.speculator.speculator
    forwards = {True: [], False: []}
    original = speculator.propose

    def counting(requests):
        before = speculator.stats.backup_forwards
        replies = original(requests)
        for reply in replies:
            if reply.cache_hit is not None:
                forwards[reply.cache_hit].append(speculator.stats.backup_forwards - before)
        return replies

    speculator.propose = counting
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0, max_tokens=40,
                                                                    ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert forwards[True] and forwards[False]
    assert max(forwards[True]) == 0  # a hit answers from the cache: no draft forward while the verifier waits
    assert min(forwards[False]) >= 1 and max(forwards[False]) == K  # a miss drafts (up to) K tokens anew


def test_eagle3_speculator_state_after_a_miss_equals_a_fresh_computation(target_and_head, byte_tokenizer):
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, fanout=(20,), max_num_seqs=1)
    speculator = engine.drafter.speculator.speculator
    original = speculator.propose
    misses, uncached = [], []

    def recording(requests):
        uncached.extend(len(speculator.seqs[r.slot].token_ids) - speculator.seqs[r.slot].num_cached for r in requests)
        replies = original(requests)
        for req, reply in zip(requests, replies):
            if reply.cache_hit is False and req.budget == K:
                misses.append((list(speculator.seqs[req.slot].token_ids), reply.tokens))
        return replies

    speculator.propose = recording
    engine.add_request("a", [7, 7, 1, 2, 3, 9], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(misses) >= 2
    # between rounds only the root is uncached: each round re-feeds the new tokens, not all since the prompt
    assert uncached and set(uncached) == {1}
    committed, proposed = misses[-1]
    fresh = Speculator(Eagle3Backend(head, 1, 256), K, [1] * (K + 1))
    fresh.add(0, committed, SamplingParams(temperature=0.0), seed=0, aux=target_aux(target, head, committed))
    assert fresh.propose([SpecRequest(0, -1, 0, K)])[0].tokens == proposed


def test_a_build_after_a_miss_feeds_the_root_and_nodes_only_and_computes_their_logits(target_and_head,
                                                                                     byte_tokenizer):
    """The neural backup has already fed a missed row's committed tokens: the build's forward feeds only the root
    (again) and the proposal's nodes, and computes logits at those positions only (before: the committed tokens a
    second time, with logits everywhere)."""
    target, head = target_and_head
    engine = eagle_ssd_engine(target, head, byte_tokenizer, fanout=(20,), max_num_seqs=1)
    speculator = engine.drafter.speculator.speculator
    forward, proposal_forward = speculator.backend.forward, speculator._proposal_forward
    fed = []  # per build forward: (row missed, committed tokens fed before the root, nodes) per row, logit positions
    missed = {}

    def recording(seqs):
        fed.append([(missed[id(s)], len(s.token_ids) - 1 - s.num_cached, len(s.proposal.tokens)) for s in seqs])

        def counting(batch, features, index=None):
            fed[-1].append(batch.input_ids.shape[1] if index is None else index.shape[1])
            return forward(batch, features, index)

        speculator.backend.forward = counting
        try:
            return proposal_forward(seqs)
        finally:
            speculator.backend.forward = forward

    build_rows = speculator._build_rows

    def remembering(rows, start):
        missed.update((id(seq), miss) for seq, miss in rows)
        return build_rows(rows, start)

    speculator._build_rows, speculator._proposal_forward = remembering, recording
    engine.add_request("a", [7, 7, 1, 2, 3, 9], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    after_miss = [row for *rows, width in fed for row in rows if row[0]]
    assert len(after_miss) >= 2 and all(before_root == 0 for _, before_root, _ in after_miss)
    assert all(width == 1 + max(n for *_, n in rows) for *rows, width in fed)


@pytest.mark.parametrize("tree", [None, TreeSettings(6, K, 2)], ids=["chain", "tree"])
def test_the_sd_drafter_and_the_speculator_backup_draft_alike(tree, target_and_head):
    """Both draft through the same backend and the same chain and tree functions: from the same committed text
    and target features they propose the same draft."""
    target, head = target_and_head
    committed = [3, 1, 4, 1, 5, 9, 2, 6]
    aux = target_aux(target, head, committed)
    params = SamplingParams(temperature=0.0)
    seq = SimpleNamespace(request_id="a", slot=0, token_ids=committed, params=params, draft_generator=None)
    drafter = Eagle3Drafter(head, 1, 256, tree=tree)
    drafter.add_sequence(seq, aux)
    proposal = drafter.propose([seq], [K])[0]
    speculator = Speculator(Eagle3Backend(head, 1, 256), K, [1] * (K + 1), tree=tree)
    speculator.add(0, committed, params, seed=0, aux=aux)
    reply = speculator.propose([SpecRequest(0, -1, 0, K)])[0]
    assert len(proposal.tokens) == (K if tree is None else 6)
    assert (reply.tokens, reply.parents) == (proposal.tokens, proposal.parents)


def test_a_cached_branch_chain_carries_the_head_outputs_it_was_sampled_from(target_and_head):
    """``Proposal.hidden[t]`` is the head's output at token t's parent, the feature paired with token t when the
    proposal is fed back. The speculator's branch chains once stored the feature one position earlier."""
    target, head = target_and_head
    committed = [7, 7, 1, 2, 3, 9]
    speculator = Speculator(Eagle3Backend(head, 1, 256), K, [2] * (K + 1))
    speculator.add(0, committed, SamplingParams(temperature=0.0), seed=0, aux=target_aux(target, head, committed))
    speculator.propose([SpecRequest(0, -1, 0, K)])
    outputs = []
    step = speculator.backend.step
    speculator.backend.step = lambda *args: outputs.append(step(*args)) or outputs[-1]
    speculator.build()
    cached = list(speculator.seqs[0].cache.values())  # branch i of the only row, in branch order
    assert len(outputs) == K and len(cached) == 2 * (K + 1)
    for i, chain in enumerate(cached):
        for t, (logits, hidden) in enumerate(outputs):
            assert chain.tokens[t] == int(logits[0, i].argmax())
            torch.testing.assert_close(chain.hidden[t], hidden[0, i], rtol=0, atol=0)
