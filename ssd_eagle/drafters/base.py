"""The one small interface every drafter implements.

The engine drives a drafter through a sequence's life:

1. ``prefill(seq, aux)`` after each prompt chunk but the last that the target cached (chunked prefill), then
   ``add_sequence(seq, prompt_aux)`` after the target's prefill sampled the first output token. ``prompt_aux``
   holds the target's aux hidden states for the prompt positions (only for drafters with
   ``needs_aux_hidden``); a drafter feeds there what its ``prefill`` calls have not.
2. Each round: ``propose(seqs, num_tokens)`` returns one :class:`Proposal` per sequence, at most
   ``num_tokens[i]`` tokens continuing ``seqs[i].token_ids``; then the target verifies and the engine calls
   ``on_verified(seq, k, aux)`` with the accepted length k and the aux hidden states of the k + 1 verified inputs
   that are now committed (the previous last token and the k accepted drafts).
3. ``remove_sequence(seq)`` when it finishes or is aborted.

A proposal's tokens at T > 0 must be samples from the ``q`` it reports (after the row's temperature/top-k/top-p,
:func:`ssd_eagle.sampling.logits_to_probs`, and Saguaro scaling when used): the verifier tests with exactly that
``q``, which is what makes the output law the target's. ``q=None`` declares deterministic proposals (point
masses): always right for greedy rows and for lookup-based drafters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch


@dataclass
class Proposal:
    """Draft tokens for one sequence: what a drafter returns, the speculator caches and replies, and the engine
    verifies (the one proposal type, end to end).

    Attributes:
        tokens: the proposed ids ``d_1..d_k`` (k may be 0); for a tree, the node tokens (node i = tokens[i-1]).
        q: float [k, V_target] (or [k, D] over ``q_ids``), the distributions the tokens were sampled from, or None
            for point masses (chains only; tree children are deterministic choices, verified by sample-and-match).
        cache_hit: SSD only: whether this proposal came from the speculation cache (None: no lookup happened).
        lookup_k: SSD only: the accepted length k that was looked up.
        parents: None for a chain; for a tree, the parent of each node (0 = the last committed token), parents
            listed before their children.
        hidden: EAGLE-3 only, the draft's side: float [k, H_draft], the head's output at each node's parent (the
            feature paired with the node's token when it is fed back). Never sent to the verifier.
        fanout: SSD only: the branches the speculation cache held for the lookup (the fan-out actually built).
        fanout_power: SSD only: the speculator's fitted r (``fanout_power: "auto"``; None before its first fit).
        backup: SSD only: the backup that drafted this proposal after a miss, ``neural`` or ``fast`` (None: from
            the speculation cache).
        q_ids: int64 [D], the target token id of each column of q (an EAGLE-3 head's draft vocabulary, in its order:
            q is 0 on every other token), or None: q spans the target's vocabulary.
        ranks: for a tree, each node's place in the drafter's order of preference (0 = its best node; a parent
            ranks before its children), so that the nodes of the n lowest ranks form the tree that drafter would
            have proposed with a budget of n nodes (:meth:`top`); None when the drafter gives no order.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    cache_hit: bool | None = None
    lookup_k: int | None = None
    parents: list[int] | None = None
    hidden: torch.Tensor | None = None
    fanout: int | None = None
    fanout_power: float | None = None
    backup: str | None = None
    q_ids: torch.Tensor | None = None
    ranks: list[int] | None = None

    def dense_q(self, vocab_size: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """q over the target's vocabulary, float [k, ``vocab_size``] (0 off ``q_ids``), or None without q.

        ``out``: a zero-filled [k, vocab_size] tensor to write it into, in ``out``'s device and dtype (the verifier's
        q: a q drafted on the CPU speculator, or decoded from a gloo reply, reaches a GPU target this way)."""
        if self.q is None:
            return None
        if out is None:
            out = self.q.new_zeros(self.q.shape[0], vocab_size)
        q = self.q.to(device=out.device, dtype=out.dtype)
        return out.copy_(q) if self.q_ids is None else out.index_copy_(-1, self.q_ids.to(out.device), q)

    def parent_list(self) -> list[int]:
        """Each node's parent (0 = the root), for a chain ``[0, 1, ..., k-1]``."""
        return self.parents if self.parents is not None else list(range(len(self.tokens)))

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-node path: a chain's length, a tree's depth (0: no tokens)."""
        if self.parents is None:
            return len(self.tokens)
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return max(depth)

    def within(self, budget: int, max_nodes: int) -> Proposal:
        """The engine's guard against drafter bugs: a chain longer than ``budget`` is :meth:`cut`; a tree deeper
        than ``budget`` or larger than ``max_nodes`` is dropped (nothing may break max_tokens or max_model_len).
        The lookup fields (cache hit, fan-out, fitted r) are kept either way."""
        if self.parents is None:
            return self if len(self.tokens) <= budget else self.cut(budget)
        if self.depth <= budget and len(self.tokens) <= max_nodes:
            return self
        return replace(self, tokens=[], q=None, parents=None, hidden=None, ranks=None)

    def cut(self, budget: int) -> Proposal:
        """At most ``budget`` tokens of a chain (the chain itself when it fits); a tree keeps the nodes at depth <=
        ``budget``."""
        if self.parents is None:
            if len(self.tokens) <= budget and all(x is None or x.shape[0] <= budget for x in (self.q, self.hidden)):
                return self  # (proposals are never modified: the speculator's hit path copies nothing it need not)
            return replace(self, tokens=self.tokens[:budget], q=None if self.q is None else self.q[:budget],
                           hidden=None if self.hidden is None else self.hidden[:budget])
        depth, keep = [0], []
        for i, p in enumerate(self.parents, start=1):
            depth.append(depth[p] + 1)
            if depth[i] <= budget:  # (a node's parent is shallower: kept too)
                keep.append(i)
        return self._keep(keep)

    def top(self, nodes: int) -> Proposal:
        """A tree's ``nodes`` best nodes by :attr:`ranks` (ancestor-closed: a parent ranks before its children),
        as the tree a budget of ``nodes`` would have proposed; the proposal itself when it has no more nodes.

        Raises:
            ValueError: a tree without ranks that has more than ``nodes`` nodes.
        """
        if len(self.tokens) <= nodes:
            return self
        best = self.best_nodes(nodes)
        return self._keep([i for i in range(1, len(self.tokens) + 1) if i in best])

    def best_nodes(self, nodes: int) -> set[int]:
        """The ids (1-based) of a tree's ``nodes`` best nodes by :attr:`ranks` (all of them when it has no more).

        Raises:
            ValueError: a tree without ranks that has more than ``nodes`` nodes.
        """
        ids = range(1, len(self.tokens) + 1)
        if len(self.tokens) <= nodes:
            return set(ids)
        if self.parents is None or self.ranks is None:
            raise ValueError(f"the best {nodes} of {len(self.tokens)} nodes need a tree proposal with ranks")
        return set(sorted(ids, key=lambda i: self.ranks[i - 1])[:nodes])

    def _keep(self, keep: list[int]) -> Proposal:
        """The tree of the nodes ``keep`` (1-based, ascending, ancestor-closed), parents re-indexed."""
        new_id = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
        return replace(self, tokens=[self.tokens[i - 1] for i in keep], q=None,
                       parents=[new_id[self.parents[i - 1]] for i in keep],
                       hidden=None if self.hidden is None else self.hidden[[i - 1 for i in keep]],
                       ranks=None if self.ranks is None else [self.ranks[i - 1] for i in keep])


class Drafter(ABC):
    """Base class of all drafters (see the module docstring for the call order)."""

    needs_aux_hidden: bool = False
    name: str = "drafter"
    healthy: bool = True  # False after a failure: the engine then decodes without drafts
    kv_geometry = None  # a ssd_eagle.kv_cache.DraftKV: the draft's stores, counted against the engine's KV budget
    error: str | None = None
    catch_up_seconds: float = 0.0  # what the last propose spent feeding committed text it had skipped (not drafting)

    def prefill(self, seq, aux: list[torch.Tensor] | None) -> None:
        """The target has cached the prompt positions ``0 .. seq.num_cached - 1`` (not the whole prompt yet);
        ``aux``: their aux states in pieces (``seq.prompt_aux``, float [n_i, 3 * H_target]) or None."""

    def add_sequence(self, seq, prompt_aux: torch.Tensor | None) -> None:
        """Start tracking ``seq`` (its ``token_ids`` = prompt + first sampled token)."""

    @abstractmethod
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        """Propose up to ``num_tokens[i]`` tokens for each sequence."""

    def on_verified(self, seq, num_accepted: int, aux: torch.Tensor | None) -> None:
        """The target accepted ``num_accepted`` of the last proposal; ``seq.token_ids`` already holds them and
        the bonus token. ``aux``: [num_accepted + 1, 3 * H_target] or None."""

    def remove_sequence(self, seq) -> None:
        """Forget ``seq``."""

    def set_shape(self, tree: int) -> None:
        """The planner's shape for the next round (:mod:`ssd_eagle.planner`): a drafter configured for trees
        proposes a chain (0) or its tree cut to its ``tree`` best nodes (at most its budget); others ignore it."""

    def set_token_budget(self, tokens: int) -> None:
        """The engine's ``max_num_batched_tokens``: a drafter catching up on many tokens forwards at most this many
        at a time."""

    def fit_kv(self, num_rows: int, capacity: int) -> None:
        """The live requests need cache rows ``0 .. num_rows-1`` and at most ``capacity`` positions each (the
        target's store shape): a drafter with its own store shrinks it to that (:meth:`KVCache.fit`)."""

    def close(self) -> None:
        """Release resources (processes, caches)."""


@dataclass(frozen=True)
class SaguaroSampling:
    """Saguaro sampling settings of a drafter (SSD paper, Sec. 4.2).

    Attributes:
        c: scale C in (0, 1] applied to the top-(F_k + 1) draft probabilities; 1 disables.
        fanout: F_k per draft position k (0-based); positions past the list use its last entry.
    """

    c: float = 1.0
    fanout: tuple[int, ...] = (3,)

    def fanout_at(self, position: int) -> int:
        return self.fanout[min(position, len(self.fanout) - 1)]
