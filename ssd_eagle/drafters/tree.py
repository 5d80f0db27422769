"""EAGLE-2-style dynamic draft trees (Li et al. 2024): expand by cumulative draft probability, keep the best.

From the root distribution (the draft's prediction after the last committed token) the tree grows one depth per
draft forward: the ``topk`` frontier nodes with the highest cumulative log-probability are fed to the draft
together (tree-masked: each sees the committed prefix, its ancestors and itself) and each proposes its ``topk``
best children. After ``depth`` levels the ``budget`` nodes with the highest cumulative log-probability form the
proposal (a node's score never exceeds its parent's, so the selection keeps every ancestor). A tree of depth D
costs D draft forwards whatever its size.

Children are deterministic choices (top-k), never samples from q: the verifier checks them by sample-and-match
(:func:`ssd_eagle.verify.tree_verify`), which is exact for such proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.drafters.backends import DraftBackend
from ssd_eagle.drafters.base import Proposal


@dataclass
class TreeSettings:
    """Dynamic-tree shape: total nodes (``budget``), levels (``depth``), expansions per level (``topk``)."""

    budget: int = 16
    depth: int = 5
    topk: int = 4

    def __post_init__(self) -> None:
        if self.budget < 1 or self.depth < 1 or self.topk < 1:
            raise ValueError(f"tree budget, depth and topk must be >= 1, got {self.budget}, {self.depth}, "
                             f"{self.topk}")


def grow_trees(backend: DraftBackend, slots: list[int], root_logits: torch.Tensor, root_hidden: torch.Tensor | None,
               base_visible: torch.Tensor, region_start: list[int], root_position: list[int],
               settings: TreeSettings, max_depth: list[int], poll=None) -> list[Proposal]:
    """Grow one dynamic tree per row, one :meth:`~ssd_eagle.drafters.backends.DraftBackend.step` of width
    ``topk`` per level. Positions are the draft's cache positions (:mod:`ssd_eagle.drafters.backends`).

    Args:
        backend: the draft; slots: the R rows' cache slots (a slot may repeat: several trees of one sequence).
        root_logits: [R, D] draft logits after the root (the last committed or predicted token), over the
            backend's columns (:attr:`~ssd_eagle.drafters.backends.DraftBackend.vocab`).
        root_hidden: [R, H] the draft's output at the root (EAGLE-3 pairs it with the depth-1 tokens), or None.
        base_visible: bool [R, S0], cache positions every node of the row may see (committed prefix, and the
            path to the root when the root is itself a draft).
        region_start: per row, first cache position of the tree's own region (``(depth-1) * topk`` positions).
        root_position: per row, the rotary position of the root; a depth-d node sits at root + d.
        settings: tree shape; ``max_depth`` caps each row's depth (its token budget).
        poll: optional, called before every draft forward; a true answer stops growing (each tree is then
            selected from the levels grown so far: shallower, still a valid proposal).

    Returns:
        One tree :class:`~ssd_eagle.drafters.base.Proposal` per row (``hidden``: the draft's output at each
        node's parent, when the draft has outputs); an empty chain where ``max_depth`` is 0.
    """
    R = root_logits.shape[0]
    k = settings.topk
    depth_cap = [min(settings.depth, d) for d in max_depth]
    # pool entries: (score, token, parent id (0 = root), depth, parent's output or None)
    pools: list[list[tuple]] = [[] for _ in range(R)]
    # frontier entries: (node id in the pool, score, cache positions of its fed ancestors)
    frontier: list[list[tuple[int, float, list[int]]]] = [[] for _ in range(R)]
    scores, ids = _top(backend, root_logits, k)
    for r in range(R):
        if depth_cap[r] == 0:
            continue
        for s, t in zip(scores[r].tolist(), ids[r].tolist()):
            pools[r].append((s, t, 0, 1, None if root_hidden is None else root_hidden[r]))
            frontier[r].append((len(pools[r]), s, []))
    feats = root_hidden[:, None].expand(R, k, -1) if root_hidden is not None else None
    region = torch.tensor(region_start)[:, None] + torch.arange(k)[None, :]
    for d in range(1, settings.depth):
        rows = [r for r in range(R) if d < depth_cap[r] and frontier[r]]
        if not rows or (poll is not None and poll()):
            break
        write = region + (d - 1) * k  # [R, k]
        tokens = torch.zeros(R, k, dtype=torch.long)
        for r in range(R):
            for j, (node, _, _) in enumerate(frontier[r]):
                tokens[r, j] = pools[r][node - 1][1]
        kv_len = max(int(write.max()) + 1, base_visible.shape[1])
        visible = torch.zeros(R, k, kv_len, dtype=torch.bool)
        visible[:, :, : base_visible.shape[1]] = base_visible[:, None, :]
        for r in range(R):
            for j in range(k):
                if j < len(frontier[r]):
                    visible[r, j, frontier[r][j][2]] = True
                visible[r, j, write[r, j]] = True
        positions = torch.tensor(root_position)[:, None].expand(R, k) + d
        logits, hidden = backend.step(slots, tokens, positions, write, visible, feats)
        scores, ids = _top(backend, logits, k)
        new_frontier: list[list[tuple[int, float, list[int]]]] = [[] for _ in range(R)]
        parent_col = torch.zeros(R, k, dtype=torch.long)
        for r in rows:
            cands = []
            for j, (node, score, ancestors) in enumerate(frontier[r]):
                for s, t in zip(scores[r, j].tolist(), ids[r, j].tolist()):
                    cands.append((score + s, t, node, j, ancestors + [int(write[r, j])]))
            cands.sort(key=lambda c: -c[0])
            base = len(pools[r])
            for score, t, node, j, _ in cands:
                pools[r].append((score, t, node, d + 1, None if hidden is None else hidden[r, j]))
            for i, (score, _, _, j, ancestors) in enumerate(cands[:k]):
                new_frontier[r].append((base + i + 1, score, ancestors))
                parent_col[r, i] = j
        frontier = new_frontier
        if hidden is not None:
            feats = hidden.gather(1, parent_col[..., None].expand(-1, -1, hidden.shape[-1]))
    return [_select(pool, settings.budget) for pool in pools]


def _top(backend: DraftBackend, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best children of every row (all D when D < k): (log-probabilities, target token ids)."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return top.values, backend.token_ids(top.indices)


def grow_after_committed(backend: DraftBackend, slots: list[int], lengths: list[int], root_logits: torch.Tensor,
                         root_hidden: torch.Tensor | None, settings: TreeSettings,
                         max_depth: list[int]) -> list[Proposal]:
    """:func:`grow_trees` rooted at each row's last committed token (``lengths[r]`` committed tokens, all in the
    draft's cache): the nodes see the committed text, the region starts right after it."""
    committed = torch.tensor(lengths) - backend.offset  # cache positions of the committed text
    base = torch.arange(int(committed.max()))[None, :] < committed[:, None]
    return grow_trees(backend, slots, root_logits, root_hidden, base, committed.tolist(),
                      (committed - 1).tolist(), settings, max_depth)


def _select(pool: list[tuple], budget: int) -> Proposal:
    """The ``budget`` best nodes (ancestor-closed), ordered by depth, with parents re-indexed, and each node's rank
    in the order of preference (:attr:`~ssd_eagle.drafters.base.Proposal.ranks`: the ``n`` best of them are what a
    budget of ``n`` selects)."""
    if not pool:
        return Proposal([])
    preferred = sorted(range(len(pool)), key=lambda i: (-pool[i][0], pool[i][3], i))
    place = {i: n for n, i in enumerate(preferred)}
    chosen = set(preferred[:budget])
    for i in preferred[:budget]:  # ties can drop an ancestor: add it back
        parent = pool[i][2]
        while parent and parent - 1 not in chosen:
            chosen.add(parent - 1)
            parent = pool[parent - 1][2]
    for i in sorted(chosen, key=lambda i: -pool[i][3]):  # deepest first: an added ancestor ranks before its child
        if pool[i][2]:
            place[pool[i][2] - 1] = min(place[pool[i][2] - 1], place[i])
    rank = {i: n for n, i in enumerate(sorted(chosen, key=lambda i: (place[i], pool[i][3])))}
    keep = sorted(chosen, key=lambda i: (pool[i][3], -pool[i][0], i))
    new_id = {old + 1: new + 1 for new, old in enumerate(keep)}
    features = [pool[i][4] for i in keep]
    return Proposal([pool[i][1] for i in keep], parents=[new_id.get(pool[i][2], 0) for i in keep],
                    hidden=torch.stack(features) if features[0] is not None else None,
                    ranks=[rank[i] for i in keep])
