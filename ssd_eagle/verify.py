"""Verification of draft tokens, a chain or a tree: greedy acceptance and lossless rejection sampling.

Pure functions. **Chains** (:func:`greedy_verify`, :func:`rejection_verify`) work over batched tensors: row ``b``
proposes ``num_draft[b] <= K`` tokens ``d_1..d_{num_draft}``; the target scored ``[last, d_1, .., d_K]`` so
``p[b, i]`` is its distribution for the token after ``d_i`` (``d_0`` = the last committed token). They return
``(k, bonus)``: the accepted length k (int64 [B]) and the bonus token (int64 [B]) the target emits after the k
accepted tokens. **Trees** (:func:`tree_verify`) work on one row: the target scored the root and every node of the
draft tree in one forward (tree attention mask), and the walk returns the accepted path of node indices and the
bonus token. At each node it takes the target's token (the argmax at T = 0, a sample at T > 0), moves to the child
carrying it, and stops with that token as the bonus when no child does, so every emitted token is the target's own
(the tree's children are deterministic proposals, never tested against a q).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept ``d_i`` with probability
``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection sample the bonus from the residual
``norm(max(p_i - q_i, 0))``; after full acceptance sample it from ``p_K``. The output law is p's whatever q is, as
long as ``d_i`` was drawn from exactly this ``q_i``. A deterministic proposal (n-gram lookup, a greedy draft at
T=0 verified at T>0) is the point mass ``q_i = delta(d_i)``: pass ``q=None``.

Saguaro sampling (SSD paper, Sec. 4.2): the speculator scales the draft probabilities of its top-(F+1) tokens by
``C in (0, 1]`` and renormalises, so that after a rejection the residual's mass concentrates on the tokens the
speculator cached. :func:`saguaro_scale` is that map; the drafter samples from its output and the verifier tests
with the same tensor, which keeps the scheme lossless for every C and F.
"""

from __future__ import annotations

import torch

from ssd_eagle.sampling import sample, uniforms


def greedy_verify(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts equal to the target's argmax.

    Args:
        target_logits: [B, K+1, V] (or [B, K+1] precomputed argmax ids, int64).
        draft_tokens: int64 [B, K] (entries past ``num_draft`` are ignored).
        num_draft: int64 [B], proposals per row, ``0 <= num_draft <= K``.

    Returns:
        (k, bonus): int64 [B] each; ``bonus`` is the target's argmax after the k accepted tokens.
    """
    target_ids = target_logits if target_logits.dim() == 2 else target_logits.argmax(dim=-1)
    K = draft_tokens.shape[1]
    valid = torch.arange(K, device=draft_tokens.device) < num_draft[:, None]
    match = (target_ids[:, :K] == draft_tokens) & valid
    k = match.to(torch.long).cumprod(dim=1).sum(dim=1)
    bonus = target_ids.gather(1, k[:, None]).squeeze(1)
    return k, bonus


def rejection_verify(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for a chain.

    Args:
        p: target probabilities [B, K+1, V] (after temperature/top-k/top-p).
        q: draft probabilities [B, K, V] the drafts were sampled from (same processing, Saguaro scaling included),
            or None for deterministic proposals (point masses).
        draft_tokens: int64 [B, K].
        num_draft: int64 [B], ``0 <= num_draft <= K``.
        generators: one per row; row b draws ``num_draft[b]`` uniforms and one categorical sample from it.

    Returns:
        (k, bonus): int64 [B] each.
    """
    B, K = draft_tokens.shape
    device = p.device
    pos = torch.arange(K, device=device)
    valid = pos < num_draft[:, None]
    u = p.new_zeros(B, K)
    drawn = uniforms(num_draft.tolist(), generators, device, p.dtype)
    u[:, : drawn.shape[1]] = drawn
    p_x = p[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept = (u * q_x < p_x) & valid
    k = accept.to(torch.long).cumprod(dim=1).sum(dim=1)

    rows = torch.arange(B, device=device)
    p_k = p[rows, k]  # [B, V]
    rejected = k < num_draft
    if q is None:
        residual = p_k.clone()
        rejected_rows = rows[rejected]
        residual[rejected_rows, draft_tokens[rejected_rows, k[rejected_rows]]] = 0.0
    else:
        q_k = q[rows, k.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_k)
        residual = torch.where(rejected[:, None], (p_k - q_k).clamp_(min=0.0), p_k)
    empty = residual.sum(dim=-1) <= 0  # p == q exactly at the rejected position: measure zero, fall back to p
    if empty.any():
        residual[empty] = p_k[empty]
    bonus = sample(residual, generators)
    return k, bonus


def chain_acceptance_probs(p: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """The chance that rejection sampling accepts each draft of a chain given the drafts before it were accepted,
    ``sum_x min(p_i(x), q_i(x))`` (Leviathan et al. 2023, Sec. 3.3: the expected acceptance of a draft sampled from
    ``q_i``), ``p_i(d_i)`` for a point mass (``q`` None). A lower-variance measure of acceptance than the accept or
    reject it draws (the cost planner learns from it, :mod:`ssd_eagle.planner`).

    Args:
        p: target probabilities [B, K+1, V] (or [B, K, V]); q: draft probabilities [B, K, V] or None.
        draft_tokens: int64 [B, K].

    Returns:
        float [B, K].
    """
    K = draft_tokens.shape[1]
    if q is None:
        return p[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)
    return torch.minimum(p[:, :K], q).sum(dim=-1)


def tree_child_probs(probs: torch.Tensor, nodes: list[int], parents: list[int],
                     path: list[int]) -> list[dict[int, float]]:
    """The target's probability of each child of the root and of each node of the accepted ``path`` (as
    :func:`tree_verify` returned it), ``{child node id: p_u(child's token)}``, ``len(path) + 1`` entries (the last
    node's empty when it has no children). An entry's sum is the chance that the walk went on past that node
    (:func:`tree_verify`); its sum over a sub-tree's nodes is the sub-tree's chance
    (:func:`ssd_eagle.planner.tree_record`).

    Args:
        probs: processed target probabilities [n, V] for the root (index 0) and the nodes.
        nodes / parents: the tree, as for :func:`tree_verify`.
    """
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents, start=1):
        children.setdefault(parent, []).append(i)
    tried = [children.get(u, []) for u in [0] + path]
    rows = [u for u, kids in zip([0] + path, tried) for _ in kids]
    values = probs[rows, [nodes[c - 1] for kids in tried for c in kids]].tolist() if rows else []  # (one sync)
    out, at = [], 0
    for kids in tried:
        out.append(dict(zip(kids, values[at: at + len(kids)])))
        at += len(kids)
    return out


def saguaro_scale(q: torch.Tensor, C: float, fanout: int | torch.Tensor) -> torch.Tensor:
    """Saguaro sampling's draft distribution: scale the top-(F+1) probabilities by C and renormalise.

    Args:
        q: draft probabilities [..., V].
        C: scale in (0, 1]; 1 returns q unchanged.
        fanout: F, an int or an int64 tensor broadcastable to ``q.shape[:-1]`` (per-position F_k); the top
            ``F + 1`` tokens of each row (ties broken by ``torch.topk``) are scaled.

    Returns:
        A new tensor like q, rows summing to 1.

    Raises:
        ValueError: C outside (0, 1] or a negative fan-out.
    """
    if not 0.0 < C <= 1.0:
        raise ValueError(f"saguaro C must be in (0, 1], got {C}")
    fan = torch.as_tensor(fanout, device=q.device)
    if (fan < 0).any():
        raise ValueError(f"fan-out must be >= 0, got {fanout}")
    if C == 1.0:
        return q.clone()
    m = min(int(fan.max()) + 1, q.shape[-1])
    top_idx = q.topk(m, dim=-1).indices
    in_top = torch.arange(m, device=q.device) < (fan + 1).expand(q.shape[:-1])[..., None]
    scale = torch.ones_like(q).scatter_(-1, top_idx, torch.where(in_top, C, 1.0).to(q.dtype))
    scaled = q * scale
    return scaled / scaled.sum(dim=-1, keepdim=True)


def tree_verify(target_logits: torch.Tensor, nodes: list[int], parents: list[int], probs: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Walk a draft tree from the root, keeping the child the target would emit (SpecInfer/EAGLE tree decoding).

    The children of a node are the drafter's deterministic choices (e.g. its top-k tokens), not samples from q.
    For such proposals the exact multi-candidate scheme is: at node u draw ``x ~ p_u`` (argmax at T = 0); if some
    child of u carries x, accept it and continue from it, else emit x as the bonus token and stop. Each emitted
    token is then exactly a draw from the target's distribution given the text before it, whatever the tree, so
    the output law is the target's; the chance of continuing past u is ``sum_{children c} p_u(c)``.

    Args:
        target_logits: [n, V] for the root (index 0) and the nodes (index i = node i).
        nodes: token of node i at ``nodes[i - 1]``; parents: parent of node i (0 = root), parents first.
        probs: processed target probabilities [n, V] for sampling, or None for greedy.
        generator: the row's generator (one categorical draw per visited node).

    Returns:
        (accepted node indices along the path, 1-based; the bonus token).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(nodes, parents), start=1):
        children.setdefault(parent, {}).setdefault(token, i)
    path: list[int] = []
    u = 0
    while True:
        x = int(target_logits[u].argmax()) if probs is None else int(sample(probs[u: u + 1], [generator])[0])
        nxt = children.get(u, {}).get(x)
        if nxt is None:
            return path, x
        path.append(nxt)
        u = nxt
