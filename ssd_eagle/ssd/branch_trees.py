"""Trees in SSD: the outcomes of a proposal, where verification lands on them, the fan-out over tree nodes, and
the branches (chains or trees) drafted for every predicted outcome (SSD paper, Sec. 4.1, written per node for
trees).

An outcome of verifying a proposal is a node u (the accepted path ends there; 0 = the root) and a bonus token b.
A node is named by its *rank path*: the rank among its siblings of every node on the path to it (siblings are
ordered best first, as :func:`ssd_eagle.drafters.tree.grow_trees` keeps them), so ``()`` is the root, ``(0, 0)``
the best child of the best child, and a chain's node k is ``(0,) * k``. :class:`NodeHitTable` counts, per rank
path, how often it was proposed, how often verification landed on it and the rank of the true bonus among the
draft's candidates there. With those counts the fan-out goes where it pays: the f-th candidate at u gains
``P(land at u) * P(bonus has rank f | landed at u)`` expected hits, and :func:`allocate_fanout` gives the budget B
to the largest gains, node by node (the marginal-gain rule the chain's geometric fan-out solves in closed form).
Until a rank path has been seen, its probabilities are the draft's own (:func:`draft_land_probabilities`, and
the power law of :mod:`ssd_eagle.ssd.fanout`, :func:`power_law_rank_prior`), blended with the counts as they arrive.

Measured 2026-12-01 (``scripts/eval_draft.py --node-table``; SmolLM2-135M bfloat16 with the committed EAGLE-3
head, AMD EPYC avx512_bf16, 2 held-out prompts x 64 tokens, K = 5, B = 24, T = 0, no time cap). The bonus is
hard to predict wherever verification stops: at the root, the true bonus is past the draft's 24 best remaining
candidates 53% of the time for a chain and 58% for a 16-node tree, whose 4 children took the root's best guesses
(a tree turns the easy outcomes into acceptances). The draft's own P(land) is close at the root (0.54-0.65 against
0.56-0.65 measured), overrates a second child (0.07 against 0.01) and underrates deep nodes. The children are
rightly left out of their parent's candidates: :func:`ssd_eagle.verify.tree_verify` emits a child's token only by
accepting it. So the tree's hits come from few, thinly covered nodes:

    shape (nodes, top-k)    cache hit   tau     (B = 24; the chain's figures were the same in both runs)
    chain (K = 5)           0.244       1.500
    16, top-4               0.127       1.726
    6, top-2                0.244       1.575

With the time cap (``scripts/bench_ssd.py --configs ar,ssd_eagle3,ssd_eagle3_tree,ssd_eagle3_tree_auto
--temperatures 0 --prompts 1 --max-tokens 64``: verifier and speculator on a core each, the machine loaded) the
16-node tree also verifies 17 tokens and builds ~2x a chain's branch-steps: hit 0.07-0.08, 0.81-0.84x the chain's tok/s. The
6-node top-2 tree verifies at about the chain's cost (bf16: 7 tokens cost what 6 do) and hit 0.13-0.21 (tau 1.575
against 1.50): 0.88x, 1.07x, 1.17x and 1.08x the chain's tok/s in four such runs, a tie within the load's noise.
:data:`AUTO_TREE` (``tree_budget: "auto"``) is that shape.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from ssd_eagle.drafters.base import Proposal, SaguaroSampling
from ssd_eagle.drafters.chain import draft_chain
from ssd_eagle.drafters.tree import TreeSettings, grow_trees


AUTO_TREE = TreeSettings(budget=6, depth=5, topk=2)
"""The tree ``tree_budget: "auto"`` proposes (depth capped by K): with the committed heads it tied the chain in SSD
at the same budget B, where larger trees lost (module docstring): they spread B over more nodes than it covers."""


@dataclass
class NodeLayout:
    """A proposal's nodes 0..T (0 = the root): parent, depth, children, rank path and token path of each."""

    parents: list[int]  # [T], parent of node 1..T
    depth: list[int]  # [T + 1]
    children: list[list[int]]  # [T + 1]
    key: list[tuple[int, ...]]  # [T + 1] rank paths
    path: list[tuple[int, ...]]  # [T + 1] the tokens accepted when verification ends at the node

    @classmethod
    def of(cls, proposal: Proposal) -> NodeLayout:
        parents = proposal.parent_list()
        T = len(parents)
        depth, children, key, path = [0] * (T + 1), [[] for _ in range(T + 1)], [()] * (T + 1), [()] * (T + 1)
        for i, p in enumerate(parents, start=1):
            depth[i] = depth[p] + 1
            key[i] = key[p] + (len(children[p]),)
            path[i] = path[p] + (proposal.tokens[i - 1],)
            children[p].append(i)
        return cls(parents, depth, children, key, path)


def bonus_candidates(scores: torch.Tensor, exclude: set[int], fanout: int,
                     vocab: torch.Tensor | None = None) -> list[int]:
    """The speculation cache's bonus candidates at a node: the ``fanout`` best tokens of the draft's ``scores``
    [D] (logits or probabilities over the columns ``vocab``, the target id of each column; None: the target's
    vocabulary), best first, skipping ``exclude`` (the node's children: a bonus equal to one would have been an
    acceptance). Returns target token ids."""
    if fanout <= 0:
        return []
    order = scores.topk(min(fanout + len(exclude), scores.shape[-1])).indices
    order = (order if vocab is None else vocab[order]).tolist()
    return [t for t in order if t not in exclude][:fanout]


def ranked_candidates(logits: torch.Tensor, nodes: NodeLayout, tokens: list[int], count: int,
                      vocab: torch.Tensor | None = None) -> list[list[int]]:
    """:func:`bonus_candidates` of every node (``logits``: [T + 1, D] draft scores after each node over the
    columns ``vocab``), ``count`` each: ranked whatever fan-out is stored, so that :class:`NodeHitTable` sees the
    bonus's rank."""
    return [bonus_candidates(logits[u], {tokens[c - 1] for c in nodes.children[u]}, count, vocab)
            for u in range(len(nodes.depth))]


def draft_land_probabilities(logits: torch.Tensor, nodes: NodeLayout, tokens: list[int],
                             vocab: torch.Tensor | None = None) -> list[float]:
    """P(verification ends at u) for every node if the draft's own distributions were the target's: P(reach u)
    times P(stop at u) = 1 - the children's mass. ``logits``: [T + 1, D] draft logits after each node over the
    columns ``vocab`` (the target id of each column, in any order; None: the target's vocabulary); a node token
    outside them (an n-gram backup's) has draft probability 0."""
    if not nodes.parents:
        return [1.0]
    probs = torch.softmax(logits.float(), dim=-1)  # (faster than a logsumexp on CPU)
    ids = torch.tensor(tokens)
    if vocab is None:
        child = probs[torch.tensor(nodes.parents), ids].tolist()
    else:
        match = ids[:, None] == vocab.to(ids.device)[None, :]  # [T, D]: T is a proposal's nodes (a few dozen)
        cols = match.int().argmax(1)
        child = torch.where(match.any(1), probs[torch.tensor(nodes.parents), cols.to(probs.device)].cpu(),
                            0.0).tolist()
    reach, stop = [1.0] * len(nodes.depth), [1.0] * len(nodes.depth)
    for u in range(1, len(reach)):
        reach[u] = reach[nodes.parents[u - 1]] * child[u - 1]
        stop[nodes.parents[u - 1]] -= child[u - 1]
    return [r * max(s, 0.0) for r, s in zip(reach, stop)]


def allocate_fanout(gains: list[list[float]], budget: int) -> list[int]:
    """Spread ``budget`` candidates over nodes greedily: each goes to the node whose next candidate gains most
    (ties to the earlier node). ``gains[u][f]``: the expected hits of node u's (f + 1)-th candidate; a node gets
    at most ``len(gains[u])``. Optimal whenever every node's gains do not increase with f.

    Returns:
        candidates per node, summing to ``min(budget, sum of the lengths)``.
    """
    fan = [0] * len(gains)
    heap = [(-g[0], u) for u, g in enumerate(gains) if g]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, u = heapq.heappop(heap)
        fan[u] += 1
        if fan[u] < len(gains[u]):
            heapq.heappush(heap, (-gains[u][fan[u]], u))
    return fan


class NodeHitTable:
    """Per rank path: rounds that proposed it (with the draft's own P(land there) summed), outcomes that landed on
    it, and the true bonus's rank among the draft's ``max_rank`` best candidates there (-1: not among them),
    measured whatever fan-out was stored.

    Estimates blend the counts with a prior worth ``prior_rounds`` observations: P(land) with the draft's own
    estimate this round; P(bonus rank = f) with the ranks pooled over every node, themselves blended with the
    power law. So a rarely proposed node borrows from the draft and from the other nodes.

    Args:
        max_rank: candidates ranked per node.
        prior_rounds: weight of the priors, in observations.
    """

    def __init__(self, max_rank: int, prior_rounds: float = 16.0):
        self.max_rank, self.prior_rounds = max_rank, prior_rounds
        self.proposed: Counter = Counter()
        self.predicted: Counter = Counter()
        self.landed: Counter = Counter()
        self.stored_hits: Counter = Counter()
        self.ranks: defaultdict[tuple, Counter] = defaultdict(Counter)
        self.pooled: Counter = Counter()

    def observe_proposal(self, keys: list[tuple[int, ...]], predicted: list[float]) -> None:
        """A verified proposal's nodes, with the draft's own P(land) of each (:func:`draft_land_probabilities`)."""
        for key, p in zip(keys, predicted):
            self.proposed[key] += 1
            self.predicted[key] += p

    def observe_outcome(self, key: tuple[int, ...], rank: int, stored: int) -> None:
        """Verification landed on ``key``; the bonus had ``rank`` (-1: past ``max_rank``); ``stored`` were cached."""
        self.landed[key] += 1
        self.ranks[key][rank] += 1
        self.pooled[rank] += 1
        self.stored_hits[key] += 0 <= rank < stored

    def land_probability(self, key: tuple[int, ...], prior: float) -> float:
        """P(land at ``key`` | proposed), the counts blended with ``prior`` (the draft's estimate this round)."""
        n, w = self.proposed[key], self.prior_rounds
        return (self.landed[key] + w * prior) / (n + w) if n + w else prior

    def rank_probabilities(self, key: tuple[int, ...] | None, prior: list[float]) -> list[float]:
        """P(bonus rank = f | landed at ``key``) for f < len(prior), the counts blended with ``prior``;
        ``key=None``: pooled over every node."""
        counts = self.pooled if key is None else self.ranks[key]
        n, w = sum(counts.values()), self.prior_rounds
        return [(counts[f] + w * p) / (n + w) for f, p in enumerate(prior)] if n + w else list(prior)

    def rows(self) -> list[dict]:
        """The table: one row per rank path (depth, rank among siblings, counts, rates), shallowest first;
        ``draft_land``: the draft's own mean P(land) there, next to the measured ``land_rate``."""
        out = []
        for key in sorted(self.proposed, key=lambda k: (len(k), k)):
            n, counts, m = self.landed[key], self.ranks[key], self.proposed[key]
            out.append({"node": key, "depth": len(key), "sibling_rank": key[-1] if key else 0, "proposed": m,
                        "landed": n, "land_rate": n / m, "draft_land": self.predicted[key] / m,
                        "stored_hit_rate": self.stored_hits[key] / n if n else None,
                        "bonus_rank_hist": [counts[f] for f in range(min(self.max_rank, 8))] + [counts[-1]]})
        return out


def power_law_rank_prior(count: int, power: float) -> list[float]:
    """P(bonus rank = f), f < count, under ``1 - p_hit(F) = (F + 1)^-r`` (the fan-out module's law, shifted so
    that the first candidate can hit)."""
    return [(f + 1) ** -power - (f + 2) ** -power for f in range(count)]


def tree_fanout(land: list[float], nodes: NodeLayout, table: NodeHitTable, budget: int, power: float) -> list[int]:
    """Candidates per node of a tree proposal: :func:`allocate_fanout` of ``budget`` over the gains
    ``P(land at u) * P(bonus rank = f | u)`` from ``table``, with the draft's own P(land) ``land`` (per node,
    :func:`draft_land_probabilities`) and the power law with ``power`` as priors."""
    pooled = table.rank_probabilities(None, power_law_rank_prior(min(budget, table.max_rank), power))
    gains = []
    for u, key in enumerate(nodes.key):
        p = table.land_probability(key, land[u])
        gains.append([p * h for h in table.rank_probabilities(key, pooled)])
    return allocate_fanout(gains, budget)


def outcome_branches(nodes: NodeLayout, ranked: list[list[int]], fan: list[int], kv: list[int],
                     hidden: torch.Tensor | None) -> tuple[list[dict], dict[tuple[int, ...], list[int]]]:
    """The branches to pre-draft for one row: for every node u the first ``fan[u]`` of its ``ranked`` candidates,
    each with the path to u, the cache positions of that path (``kv``: of the root and each node) and the draft's
    output at u (``hidden`` [T + 1, H] or None). Returns (branches, candidates stored per path)."""
    branches, candidates, anc = [], {}, [[kv[0]]]
    for u in range(len(nodes.depth)):
        if u:
            anc.append(anc[nodes.parents[u - 1]] + [kv[u]])
        if fan[u] == 0:
            continue
        cands = ranked[u][: fan[u]]
        candidates[nodes.path[u]] = cands
        for rank, t in enumerate(cands):
            branches.append({"key": (nodes.path[u], t), "token": t, "rank": rank, "depth": nodes.depth[u],
                             "visible": anc[u], "feature": None if hidden is None else hidden[u]})
    return branches, candidates


def draft_branch_chains(backend, seqs: list, branches: list[list[dict]], depth: int, min_width: int = 1,
                        saguaro: SaguaroSampling | None = None, check=None) -> list[list[Proposal]]:
    """``depth`` (<= K) drafted tokens for every branch: that many tree-masked forwards over all branches of all
    rows at once. Branch i of row r writes its root at cache position ``region_r + i`` and its token of chain index
    j at ``region_r + (j + 1) * F + i`` (:func:`branch_batch`); it sees the committed text, the path to its node
    and its own writes.

    Args:
        seqs, branches, min_width: as in :func:`branch_batch`; depth: tokens per chain.
        saguaro: the sampling the chains are drawn with (None: plain); check: called before every draft forward
            (it raises to stop the build).

    Returns:
        per row, one chain :class:`~ssd_eagle.drafters.base.Proposal` per branch of ``branches``.
    """
    tokens, positions, base, feats, region, F = branch_batch(backend, seqs, branches, min_width)
    B = len(seqs)
    slots = [s.slot for s in seqs]
    branch_idx = torch.arange(F)[None, :]

    def feed(rows, toks: torch.Tensor, hidden: torch.Tensor | None, index: int):
        """The draft_chain feed over all B * F branches: their tokens of chain index ``index`` (-1: the roots)."""
        if check is not None:
            check()
        write = region + (index + 1) * F + branch_idx  # [B, F]
        cols = torch.arange(max(int(write.max()) + 1, base.shape[-1]))[None, None, :]
        visible = (cols >= region[..., None]) & ((cols - region[..., None]) % F == branch_idx[..., None]) & \
            (cols <= write[..., None])
        visible[..., : base.shape[-1]] |= base
        logits, out = backend.step(slots, toks.view(B, F).cpu(), positions + index + 1, write, visible,
                                   None if hidden is None else hidden.view(B, F, -1))
        return logits.reshape(B * F, -1), (out.reshape(B * F, -1) if out is not None else None)

    logits, hidden = feed(None, tokens, feats, -1)
    rows = [seq if i < len(row) else None for seq, row in zip(seqs, branches) for i in range(F)]  # None: pad
    chains = draft_chain(feed, logits, hidden, rows, [depth] * (B * F), saguaro, backend.vocab,
                         backend.temperature_scale)
    return [chains[r * F: r * F + len(row)] for r, row in enumerate(branches)]


def draft_branch_trees(backend, slots: list[int], tokens: torch.Tensor, positions: torch.Tensor,
                       base: torch.Tensor, feats: torch.Tensor | None, region: torch.Tensor,
                       counts: list[int], settings: TreeSettings, max_depth: int, poll=None) -> list[list[Proposal]]:
    """A dynamic tree for every branch: feed the branch roots (one forward), then grow all trees together.

    Args:
        backend: the draft (:class:`~ssd_eagle.drafters.backends.DraftBackend`); slots: each row's cache slot.
        tokens, positions: [B, F] the branch roots (bonus candidates) and their rotary positions.
        base: bool [B, F, S] what each root sees (committed text and the path to its node).
        feats: [B, F, H] EAGLE-3 features paired with the roots, or None.
        region: [B, 1] first free cache position of each row; root i is written at ``region + i``, and branch i's
            tree region follows all roots.
        counts: real branches per row (<= F; the rest is padding).
        poll: called before every draft forward; a true answer stops growing (the trees keep the levels grown).

    Returns:
        per row, one tree :class:`~ssd_eagle.drafters.base.Proposal` per real branch.
    """
    B, F = tokens.shape
    write = region + torch.arange(F)[None, :]
    kv_len = max(int(write.max()) + 1, base.shape[-1])
    visible = torch.zeros(B, F, kv_len, dtype=torch.bool)
    visible[..., : base.shape[-1]] = base
    visible.scatter_(2, write[..., None], True)
    if poll is not None and poll():
        return [[] for _ in range(B)]
    logits, hidden = backend.step(slots, tokens, positions, write, visible, feats)
    # one grow_trees row per branch: its base sees the branch root too; its region follows all roots
    real = [(r, i) for r in range(B) for i in range(counts[r])]
    per_tree = (settings.depth - 1) * settings.topk
    trees = grow_trees(backend, [slots[r] for r, _ in real], torch.stack([logits[r, i] for r, i in real]),
                       torch.stack([hidden[r, i] for r, i in real]) if hidden is not None else None,
                       torch.stack([visible[r, i] for r, i in real]),
                       [int(region[r]) + F + i * per_tree for r, i in real], [int(positions[r, i]) for r, i in real],
                       settings, [max_depth] * len(real), poll)
    out: list[list[Proposal]] = [[] for _ in range(B)]
    for (r, _), tree in zip(real, trees):
        out[r].append(tree)
    return out


def branch_batch(backend, seqs: list, branches: list[list[dict]], min_width: int = 1):
    """The tensors of a build's branch forwards (chains and trees): for B rows (``token_ids`` and ``proposal`` of
    each, the proposal's nodes cached right after the committed text) and their :func:`outcome_branches`, padded to
    F = max(``min_width``, the widest row) branches per row.

    Returns:
        (tokens int64 [B, F] (the branch roots), their rotary positions [B, F], base visibility bool [B, F, S] (the
        committed text and the path to each branch's node), EAGLE-3 features [B, F, H] or None, region int64 [B, 1]
        (each row's first cache position past its committed text and proposal, where branches are written), F).
    """
    b = backend
    B, F = len(seqs), max(min_width, max(len(br) for br in branches))
    tokens = torch.zeros(B, F, dtype=torch.long)
    root_pos = torch.zeros(B, F, dtype=torch.long)
    width = max(max(br["visible"]) for row in branches for br in row) + 1
    base = torch.zeros(B, F, width, dtype=torch.bool)
    feats = torch.zeros(B, F, b.hidden_size, dtype=b.dtype, device=b.device) if b.needs_aux else None
    for r, (seq, row) in enumerate(zip(seqs, branches)):
        committed = len(seq.token_ids) - 1 - b.offset  # cache positions before the root's
        base[r, :, :committed] = True
        for i, br in enumerate(row):
            tokens[r, i] = br["token"]
            root_pos[r, i] = len(seq.token_ids) + br["depth"] - b.offset
            base[r, i, br["visible"]] = True
            if feats is not None:
                feats[r, i] = br["feature"]
    region = torch.tensor([len(s.token_ids) - b.offset + len(s.proposal.tokens) for s in seqs])[:, None]
    return tokens, root_pos, base, feats, region, F
