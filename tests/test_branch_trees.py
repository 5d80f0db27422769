"""Trees in SSD: the fan-out budget over tree nodes, the per-node hit table and the marginal-gain allocation
(hand-computed), and SSD with trees equal to greedy decoding with hits and misses, also when a build is stopped."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_llama, noisy_copy, random_prompts
from ssd_eagle.config import SpeculativeConfig
from ssd_eagle.drafters.base import Proposal
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.engine.llm import LLM
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.branch_trees import (AUTO_TREE, NodeHitTable, NodeLayout, allocate_fanout,
                                        draft_land_probabilities, tree_fanout)
from ssd_eagle.verify import tree_verify
from test_ssd import _greedy_outputs_match, ssd_engine

K = 3
TREE = dict(tree_budget=6, tree_depth=K, tree_topk=2)


def test_rank_paths_of_a_tree():
    # root -> {1, 2}; 1 -> {3, 4}; 3 -> {5}
    nodes = NodeLayout.of(Proposal([10, 11, 12, 13, 14], parents=[0, 0, 1, 1, 3]))
    assert nodes.key == [(), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert nodes.path[5] == (10, 12, 14) and nodes.depth == [0, 1, 1, 2, 2, 3]
    assert NodeLayout.of(Proposal([4, 5])).key == [(), (0,), (0, 0)]  # a chain's node k is (0,) * k


def test_allocate_fanout_takes_the_largest_marginal_gains():
    gains = [[0.30, 0.10, 0.05], [0.20, 0.15, 0.02], [0.12]]
    # picks 0.30 (node 0), 0.20 (1), 0.15 (1), 0.12 (2), 0.10 (0)
    assert allocate_fanout(gains, 5) == [2, 2, 1]
    assert allocate_fanout(gains, 7) == [3, 3, 1]
    assert allocate_fanout(gains, 20) == [3, 3, 1]  # no node gets more than it has gains for
    assert allocate_fanout(gains, 0) == [0, 0, 0]


def test_tree_fanout_from_a_hand_computed_hit_table():
    """Four nodes: root -> {1, 2}, 1 -> {3}; every node proposed 8 times, the outcomes counted by hand.

    node    landed  P(land)  bonus ranks        P(rank 0), P(rank 1)   gains (f = 0, 1)
    ()      4       0.5      0, 0, 1, past      0.5, 0.25              0.25, 0.125
    (0,)    2       0.25     0, 0               1.0, 0                 0.25, 0
    (1,)    1       0.125    1                  0, 1.0                 0, 0.125
    (0, 0)  1       0.125    0                  1.0, 0                 0.125, 0

    Budget 4: 0.25 (root), 0.25 (node 1), 0.125 (root's second), 0.125 (node 3). Node 2's second candidate
    would gain 0.125 too, but only after its first, which gains nothing."""
    proposal = Proposal([1, 2, 3], parents=[0, 0, 1])
    nodes = NodeLayout.of(proposal)
    table = NodeHitTable(max_rank=4, prior_rounds=0.0)
    for _ in range(8):
        table.observe_proposal(nodes.key, [0.25] * 4)
    for key, rank in [((), 0), ((), 0), ((), 1), ((), -1), ((0,), 0), ((0,), 0), ((1,), 1), ((0, 0), 0)]:
        table.observe_outcome(key, rank, stored=2)
    land = [0.7, 0.1, 0.1, 0.1]  # the draft's own estimate: weightless here (prior_rounds = 0)
    assert tree_fanout(land, nodes, table, 4, power=1.0) == [2, 1, 0, 1]
    rows = {r["node"]: r for r in table.rows()}
    assert rows[()]["land_rate"] == 0.5 and rows[()]["stored_hit_rate"] == 0.75 and rows[()]["draft_land"] == 0.25
    assert rows[(1,)]["bonus_rank_hist"][:2] == [0, 1]


def test_tree_fanout_before_any_outcome_uses_the_drafts_probabilities_and_the_power_law():
    """A root with one child: P(land at root) = 1 - 0.6 = 0.4, P(land at the child) = 0.6. Rank prior (r = 1):
    1 - 1/2 = 0.5, 1/2 - 1/3, 1/3 - 1/4. Gains: root 0.2, 0.067, 0.033; child 0.3, 0.1, 0.05."""
    proposal = Proposal([0], parents=[0])
    nodes = NodeLayout.of(proposal)
    probs = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.7, 0.2, 0.05, 0.05]])
    land = draft_land_probabilities(probs.log(), nodes, [0])
    assert land == pytest.approx([0.4, 0.6])
    table = NodeHitTable(max_rank=4)
    assert tree_fanout(land, nodes, table, 3, power=1.0) == [1, 2]
    assert tree_fanout(land, nodes, table, 4, power=1.0) == [2, 2]


@pytest.mark.parametrize("strategy", [dict(fanout=[3]), dict(fanout_strategy="geometric", fanout_acceptance=0.6)],
                         ids=["manual", "geometric"])
def test_trees_store_fanout_budget_candidates_per_round(strategy, byte_tokenizer):
    """``fanout_budget`` is the number of bonus candidates a tree speculation stores per round, whatever the
    strategy (manual once stored sum(fanout) = 12 here)."""
    assert sum(SpeculativeConfig(method="draft_model", model="d", **TREE, **strategy, fanout_budget=10,
                                 num_speculative_tokens=K)
               .resolved_fanout()) == 10
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=1, k=K, fanout_budget=10,
                        **TREE, **strategy)
    speculator = engine.drafter.speculator.speculator
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stored = []
    while engine.has_unfinished():
        engine.step()
        for seq in speculator.seqs.values():
            if seq.proposal is not None and seq.proposal.parents is not None:
                stored.append(sum(map(len, seq.candidates.values())))
    assert stored and set(stored) == {10}


@pytest.mark.parametrize("variant", [dict(fanout=[2]), dict(fanout_strategy="geometric", fanout_budget=8),
                                     dict(backup="fast", fanout_budget=6)], ids=["manual", "geometric", "fast"])
def test_greedy_ssd_trees_equal_target_greedy_with_hits_and_misses(variant, byte_tokenizer):
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, k=K, **TREE, **variant)
    _greedy_outputs_match(LLM(engine=engine), target, random_prompts(6, seed=2), 20)
    stats = engine.stats
    assert stats.cache_hits > 0 and stats.cache_lookups > stats.cache_hits, "hits and misses must both occur"
    table = engine.drafter.speculator.speculator.node_table
    assert sum(table.landed.values()) > 0 and max(len(key) for key in table.landed) >= 2


def test_a_stopped_tree_build_keeps_shallower_trees_and_stays_lossless(byte_tokenizer):
    """``poll`` answering true stops a build between draft forwards: the branch trees keep the levels grown."""
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, k=K, max_num_seqs=2, fanout_budget=8,
                        **TREE)
    local = engine.drafter.speculator
    local.speculator.budget.worth_finishing = lambda remaining_s: False  # a fired poll always stops the build
    calls = []

    def stop_after_two() -> bool:
        calls.append(1)
        return len(calls) % 4 == 0  # the proposal's forward, the roots' and one level, then stop

    depths = []

    def propose(requests):
        replies = local.speculator.propose(requests)
        local.speculator.build(stop_after_two)
        depths.extend(max(NodeLayout.of(p).depth) for s in local.speculator.seqs.values() for p in s.cache.values())
        return replies

    local.propose = propose
    _greedy_outputs_match(LLM(engine=engine), target, random_prompts(4, seed=5), 20)
    assert engine.stats.cache_hits > 0
    assert depths and max(depths) == 2  # K = 3 levels would have been grown


def test_a_tree_spreads_only_the_time_budgets_branches(byte_tokenizer):
    """Under the build's branch cap (:mod:`ssd_eagle.ssd.budget`) a tree allocates the capped count over its
    nodes, by the same gains, instead of storing B and dropping the rest by rank."""
    target = make_tiny_llama(seed=3)
    engine = ssd_engine(target, noisy_copy(target, 0.02), byte_tokenizer, max_num_seqs=1, k=K, fanout_budget=10,
                        **TREE)
    speculator = engine.drafter.speculator.speculator
    speculator.budget.cap = lambda: 3
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stored = []
    while engine.has_unfinished():
        engine.step()
        stored += [(sum(map(len, s.candidates.values())), len(s.cache)) for s in speculator.seqs.values()]
    assert stored and set(stored) == {(3, 3)}


def test_tree_budget_auto_is_the_measured_shape():
    """``tree_budget: "auto"`` proposes :data:`AUTO_TREE` (6 nodes, top-2: it tied the chain in SSD where 16 nodes,
    top-4 lost; branch_trees' docstring) unless ``tree_topk`` is given (a config dumped and re-read keeps a default
    tree_topk a default), and means chains for the n-gram drafter."""
    auto = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": "auto"})
    assert (auto.tree_budget, auto.tree_topk) == (AUTO_TREE.budget, AUTO_TREE.topk) == (6, 2)
    assert auto.tree_settings() == TreeSettings(6, 5, 2) and auto.max_draft_tokens == 6
    dumped = SpeculativeConfig.from_dict({**SpeculativeConfig(method="eagle3", model="d").to_dict(),
                                          "tree_budget": "auto"})  # (how --tree-budget overrides a config)
    assert (dumped.tree_budget, dumped.tree_topk) == (6, 2)
    topk3 = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": "auto", "tree_topk": 3})
    assert (topk3.tree_budget, topk3.tree_topk) == (6, 3) and topk3.tree_settings() == TreeSettings(6, 5, 3)
    assert SpeculativeConfig.from_dict({**topk3.to_dict(), "tree_budget": "auto"}).tree_topk == 3
    topk4 = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": "auto", "tree_topk": 4})
    assert topk4.tree_topk == 4  # explicit, though it is the field's default
    assert SpeculativeConfig.from_dict({"tree_budget": "auto"}).tree_settings() is None  # ngram: chains
    assert SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": 16}).tree_budget == 16
    for bad in ("big", -1, True, "6"):
        with pytest.raises(ValueError, match="tree_budget"):
            SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": bad})


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_bonus_at_a_node_is_never_one_of_its_children(temperature):
    """Why :func:`bonus_candidates` leaves a node's children out: the walk of ``tree_verify`` accepts a child
    whose token the target draws there, so the bonus where it stops is never a child's token (at any T)."""
    gen = torch.Generator().manual_seed(0)
    proposal = Proposal([0, 1, 2, 0, 1], parents=[0, 0, 1, 1, 2])  # root -> {0, 1}; 1 -> {2, 0}; 2 -> {1}
    nodes = NodeLayout.of(proposal)
    for _ in range(200):
        logits = torch.randn(6, 4, generator=gen) * 2
        probs = torch.softmax(logits, dim=-1) if temperature else None
        path, bonus = tree_verify(logits, proposal.tokens, proposal.parents, probs, gen)
        u = path[-1] if path else 0
        assert bonus not in {proposal.tokens[c - 1] for c in nodes.children[u]}


def test_tree_budget_auto_flag_keeps_an_explicit_tree_topk():
    """``--tree-budget auto`` laid over the default drafter: AUTO_TREE's top-2, or ``--tree-topk`` when given."""
    from ssd_eagle.config import engine_config_from_args
    from test_config import _generate_args

    def spec(*argv):
        args = _generate_args(["--mode", "sd", "--drafter", "eagle3", "--tree-budget", "auto", *argv])
        return engine_config_from_args(args).speculative_config

    assert (spec().tree_budget, spec().tree_topk) == (6, 2)
    assert (spec("--tree-topk", "3").tree_budget, spec("--tree-topk", "3").tree_topk) == (6, 3)


def test_a_tree_budget_laid_over_a_dumped_auto_tree_keeps_the_default_tree_topk():
    """A config whose ``tree_budget: "auto"`` picked AUTO_TREE's top-2 dumps (``to_dict``) ``auto`` again, not the
    top-2 as if it were given: re-read it is the same config, and a ``--tree-budget 16`` laid over it (how
    ``engine_config_from_args`` overrides a YAML or the default drafter) gets the default ``tree_topk`` (4), as it
    does over a config that never said auto. An explicit ``tree_topk`` stays explicit."""
    auto = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": "auto"})
    again = SpeculativeConfig.from_dict(auto.to_dict())
    assert (again.tree_budget, again.tree_topk) == (auto.tree_budget, auto.tree_topk) == (6, 2)
    assert again.to_dict() == auto.to_dict()
    plain = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": 16})
    over = SpeculativeConfig.from_dict({**auto.to_dict(), "tree_budget": 16})
    assert (over.tree_budget, over.tree_topk) == (plain.tree_budget, plain.tree_topk) == (16, 4)
    topk3 = SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", "tree_budget": "auto", "tree_topk": 3})
    assert SpeculativeConfig.from_dict({**topk3.to_dict(), "tree_budget": 16}).tree_topk == 3
    ngram = SpeculativeConfig.from_dict({"tree_budget": "auto"})
    assert SpeculativeConfig.from_dict(ngram.to_dict()).tree_budget == ngram.tree_budget == 0
