"""Tree sizes: a tree's best n nodes are the tree a budget of n selects, what a round of the whole tree teaches of
each smaller size is exact, and the planner verifies the size that pays."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from helpers import make_tiny_llama, reference_greedy
from ssd_eagle.drafters.base import Proposal
from ssd_eagle.drafters.tree import _select
from ssd_eagle.planner import Acceptance, CostTable, Planner, PlannerConfig, tree_record, tree_size_ladder
from ssd_eagle.verify import tree_child_probs, tree_verify


def random_pool(seed: int, depth: int = 4, topk: int = 3, vocab: int = 12) -> list[tuple]:
    """A pool as :func:`~ssd_eagle.drafters.tree.grow_trees` builds it: (score, token, parent id, depth, hidden),
    ``topk`` children with distinct tokens under each of a level's ``topk`` best nodes."""
    rng = random.Random(seed)
    pool: list[tuple] = []
    frontier = [(0, 0.0)]  # (node id, score)
    for d in range(1, depth + 1):
        level = []
        for node, score in frontier:
            for token in rng.sample(range(vocab), topk):
                pool.append((score + math.log(rng.random()), token, node, d, None))
                level.append((len(pool), pool[-1][0]))
        frontier = sorted(level, key=lambda c: -c[1])[:topk]
    return pool


@pytest.mark.parametrize("seed", range(5))
def test_the_best_n_nodes_of_a_tree_are_what_a_budget_of_n_selects(seed):
    pool = random_pool(seed)
    whole = _select(pool, budget=len(pool))
    assert sorted(whole.ranks) == list(range(len(pool)))
    for n in range(1, len(pool) + 1):
        best, selected = whole.top(n), _select(pool, budget=n)
        assert (best.tokens, best.parents) == (selected.tokens, selected.parents)
        assert all(best.ranks[p - 1] < r for p, r in zip(best.parents, best.ranks) if p)  # parents rank first
    cut = whole.cut(2)  # (depth <= 2: the ranks go with their nodes)
    assert cut.top(4).tokens == _select([e for e in pool if e[3] <= 2], budget=4).tokens
    with pytest.raises(ValueError, match="ranks"):
        Proposal([1, 2], parents=[0, 0]).top(1)
    with pytest.raises(ValueError, match="ranks"):
        tree_record(Proposal([1, 2], parents=[0, 0]), [1], 1, 1)


def sub_rows(whole: Proposal, sub: Proposal) -> list[int]:
    """The rows (0 = the root, i = node i) of ``whole``'s target logits that ``sub``'s nodes take (by rank)."""
    row = {r: i for i, r in enumerate(whole.ranks, start=1)}
    return [0] + [row[r] for r in sub.ranks]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_of_the_whole_tree_teaches_each_smaller_size_exactly(seed, temperature):
    """The smaller tree's own verification, with the same target draws, accepts what :func:`tree_record` reads off
    the whole tree's round; at T = 1 its chances per depth are the whole round's child probabilities summed over the
    smaller tree's nodes."""
    pool = random_pool(seed, vocab=6)  # (a small vocabulary: the target's draws often match a child)
    whole = _select(pool, budget=16)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(whole.tokens) + 1, 6, generator=gen) * 2
    probs = torch.softmax(logits, -1) if temperature else None
    path, _ = tree_verify(logits, whole.tokens, whole.parents, probs, torch.Generator().manual_seed(seed))
    kids = tree_child_probs(probs, whole.tokens, whole.parents, path) if temperature else None
    reached = 0
    for n in range(1, 17):
        sub = whole.top(n)
        rows = sub_rows(whole, sub)
        sub_probs = probs[rows] if temperature else None
        sub_path, _ = tree_verify(logits[rows], sub.tokens, sub.parents, sub_probs, torch.Generator().manual_seed(seed))
        assert tree_record(whole, path, n, depth=4) == (4, len(sub_path))
        if temperature:  # (depths past the sub-tree's own are tried with chance 0, up to the 4 levels grown)
            own = [sum(k.values()) for k in tree_child_probs(sub_probs, sub.tokens, sub.parents, sub_path)]
            assert tree_record(whole, path, n, 4, kids) == \
                pytest.approx(own[: min(len(sub_path) + 1, 4)])
        reached = max(reached, len(sub_path))
    assert reached == len(path)


def size_planner(verify: list[float], rates: dict[int, float], **kw) -> Planner:
    """A depth-3 tree drafter of 8 nodes choosing among 2, 4 and 8 (no chains), free drafting; one request whose
    tree of n nodes reaches each depth with ``rates[n]`` (exact counts)."""
    planner = Planner(PlannerConfig(max_k=3, tree_nodes=8, tree_sizes=(2, 4), learn_costs=False, **kw),
                      CostTable({1: verify}))
    for n, rate in rates.items():
        acc = Acceptance(tried=[200.0] * 3, accepted=[200.0 * rate] * 3, decay=1.0)
        planner.learnt(n).acceptance["r"] = acc
        planner.learnt(n).engine_wide = acc
    return planner


def test_the_planner_verifies_the_tree_size_that_pays_and_explores_the_whole_tree():
    """Reach per depth 0.5 / 0.7 / 0.8 for 2 / 4 / 8 nodes: E = 1.875 / 2.533 / 2.952. Flat verification: the whole
    tree. Verification at 2 s past 5 tokens (the 8-node tree verifies 9): 2.952 / 2 < 2.533, the 4-node tree, with
    the whole tree explored now and then (its reach past what 4 nodes hold is measured only so)."""
    rates = {2: 0.5, 4: 0.7, 8: 0.8}
    flat = size_planner([1.0] * 9, rates)
    assert flat.choose(["r"]) == {"r": 3} and flat.tree_round == 8
    steep = size_planner([1.0] * 5 + [2.0] * 4, rates, explore_every=4, probe_overhead=1.0)
    shapes = []
    for _ in range(12):
        assert steep.choose(["r"]) == {"r": 3}
        shapes.append(steep.tree_round)
    assert shapes == [4, 4, 4, 8, 4, 4, 4, 4, 4, 4, 4, 8]  # (the interval doubles while the plan holds)
    assert steep.summary()["tree_size_rounds"] == {4: 10, 8: 2}
    with pytest.raises(ValueError, match="tree_sizes"):
        PlannerConfig(max_k=3, tree_nodes=8, tree_sizes=(16,))
    assert tree_size_ladder(12) == (2, 3, 6, 12) and tree_size_ladder(6) == (2, 3, 6) and tree_size_ladder(1) == (1,)


def test_a_tree_is_expected_to_accept_what_its_best_nodes_do_and_a_size_needs_min_rounds():
    """The whole tree measured unluckily (reach 0.3 a depth over 2 rounds) against its best 4 nodes (0.7 over 200:
    every round of the whole tree taught them too): the whole tree is expected to accept at least what its 4 nodes
    accept. A smaller size is planned only once ``min_rounds`` rounds measured it: with 3 rounds behind the 4-node
    tree the whole one stays the plan though the 4-node tree is cheaper."""
    planner = size_planner([1.0] * 9, {2: 0.5, 4: 0.7})
    unlucky = Acceptance(tried=[2.0] * 3, accepted=[0.6] * 3, decay=1.0)
    planner.learnt(8).acceptance["r"] = planner.learnt(8).engine_wide = unlucky
    assert planner.expected(3, "r", 8) == pytest.approx(planner.expected(3, "r", 4)) == pytest.approx(2.533, rel=1e-3)
    assert planner.expected(3, "r", 2) == pytest.approx(1.875, rel=1e-3)
    steep = size_planner([1.0] * 5 + [1.2] * 4, {4: 0.7, 8: 0.72}, min_rounds=6)
    few = Acceptance(tried=[3.0] * 3, accepted=[2.1] * 3, decay=1.0)
    steep.learnt(4).acceptance["r"] = steep.learnt(4).engine_wide = few
    assert steep.choose(["r"]) == {"r": 3} and steep.tree_round == 8
    few.tried, few.accepted = [6.0] * 3, [4.2] * 3
    assert steep.choose(["r"]) == {"r": 3} and steep.tree_round == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_observe_round_teaches_every_smaller_size_from_the_round(temperature):
    pool = random_pool(3, vocab=6)
    whole = _select(pool, budget=8)
    planner = Planner(PlannerConfig(max_k=4, tree_nodes=8, tree_sizes=(2, 4), learn_costs=False),
                      CostTable({1: [1.0] * 9}))
    assert planner.choose(["r"]) == {"r": 4} and planner.tree_round == 8  # (until measured: the whole tree)
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(1)) * 3
    probs = torch.softmax(logits, -1) if temperature else None
    path, _ = tree_verify(logits, whole.tokens, whole.parents, probs, torch.Generator().manual_seed(0))
    seq = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=not temperature))
    chances = {"r": tree_child_probs(probs, whole.tokens, whole.parents, path)} if temperature else None
    planner.observe_round([seq], [whole], [path], 0.0, 1.0, chances=chances)
    for n in (2, 4, 8):
        expected = Acceptance()
        record = tree_record(whole, path, n, 4, chances["r"] if temperature else None)
        expected.record_chances(record) if temperature else expected.record(*record)
        assert planner.learnt(n).acceptance["r"].accepted == pytest.approx(expected.accepted)
        assert planner.learnt(n).acceptance["r"].tried == expected.tried and planner.learnt(n).rounds > 0


def test_a_tree_drafter_drafts_the_planned_size_and_stays_exact(byte_tokenizer):
    """A draft model's tree drafter (the target's copy) of 6 nodes choosing among 3 and 6, verification of more than
    4 tokens 1.5x dearer: the first round drafts the whole tree (sizes unmeasured), which teaches the 3-node tree, so
    the next rounds draft 3 nodes; greedy output equals the target's greedy decode."""
    import copy

    from ssd_eagle.drafters import DraftModelDrafter
    from ssd_eagle.drafters.tree import TreeSettings
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.sampling_params import SamplingParams

    target = make_tiny_llama(seed=5).double()
    drafter = DraftModelDrafter(copy.deepcopy(target), target.config.vocab_size, 1, 256, tree=TreeSettings(6, 3, 2))
    sizes = []
    propose = drafter.propose

    def recording(seqs, num_tokens):
        out = propose(seqs, num_tokens)
        sizes.extend(len(p.tokens) for p in out if p.tokens)
        return out

    drafter.propose = recording
    engine = LLMEngine(target, byte_tokenizer, drafter, num_speculative_tokens=3, max_num_seqs=1, max_model_len=256,
                       max_draft_tokens=6)
    engine.planner = Planner(PlannerConfig(max_k=3, tree_nodes=6, tree_sizes=(3,), tree_depth=3, learn_costs=False),
                             CostTable({1: [1.0] * 4 + [1.5] * 3}))
    prompt = list(b"Hey \xc3\xa9")
    try:
        out = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    finally:
        engine.close()
    assert out.token_ids == reference_greedy(target, prompt, 40)
    assert sizes[0] == 6 and all(n <= 3 for n in sizes[1:8]) and engine.planner.tree_sizes.get(3, 0) >= 7


def test_a_row_near_its_end_counts_only_the_levels_its_budget_let_grow():
    """A depth-4 tree planned, but the row's budget (its max_tokens) lets one level grow: three siblings, the first
    accepted. Depth 1 was tried and accepted; nothing deeper was tried (not a rejection at depth 2)."""
    from ssd_eagle.stats import SpecStats

    planner = Planner(PlannerConfig(max_k=4, tree_nodes=8, tree_sizes=(2, 4), learn_costs=False),
                      CostTable({1: [1.0] * 9}))
    seq = SimpleNamespace(request_id="r", params=SimpleNamespace(greedy=True), stats=SpecStats())
    assert planner.plan([seq], [1]) == [1] and planner.tree_round == 8
    tree = Proposal([5, 6, 7], parents=[0, 0, 0], ranks=[0, 1, 2])
    planner.observe_round([seq], [tree], [[1]], 0.0, 1.0)
    for n in (2, 4, 8):
        assert planner.learnt(n).acceptance["r"].tried == [1.0] and planner.learnt(n).acceptance["r"].accepted == [1.0]
