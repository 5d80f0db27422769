"""SD with a neural draft (a draft LM or an EAGLE-3 head): the engine's drafter over a
:class:`~ssd_eagle.drafters.backends.DraftBackend`.

A prompt is prefilled chunk by chunk as the target caches it (:meth:`NeuralDrafter.prefill`; ``add_sequence`` feeds
the last chunk), and the draft's store follows the live requests (:meth:`NeuralDrafter.fit_kv`).

Per sequence the drafter keeps ``num_cached``, the first token position whose draft cache entry is not valid for
the committed text, and for EAGLE-3 the target features still to feed (of token positions
``num_cached .. len(token_ids) - 1``: ``pending`` fused, then ``raw`` aux states not fused yet). A round: one
:meth:`~DraftBackend.extend` over the committed tokens not yet cached (usually one or two) gives the first draft's
distribution, then :func:`~ssd_eagle.drafters.chain.draft_chain` (K - 1 more forwards) or
:func:`~ssd_eagle.drafters.tree.grow_after_committed` (one forward per level).

The draft is brought up to date lazily (:meth:`NeuralDrafter.catch_up`), so that a request whose speculation the
planner (:mod:`ssd_eagle.planner`) has switched off costs no draft work per round: the tokens committed while no
round drafted are fed by the next proposal (a probe, or speculation back on), in dynamic-shape forwards of at most
``token_budget`` tokens (the engine's ``max_num_batched_tokens``). Until then an EAGLE-3 head only keeps the
target's aux states of those tokens (captured with every verification: the capture costs nothing measurable), fused
in one batched call every ``FUSE_ROWS`` rows or at the catch-up. The prompt is prefilled with the target's chunks.

After the target accepts k drafts:

- a draft LM keeps the accepted drafts it fed at their own positions (a chain's first K - 1; a tree's entries are
  not kept: the next round feeds the accepted tokens again);
- an EAGLE-3 head gets the target's features of the k + 1 verified inputs now committed; they replace the head's
  self-fed entries, which are simply overwritten (EAGLE-3, Li et al. 2025: while the target's features exist,
  ``f_i = fc(aux_i)``; while drafting, the head feeds back its own output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ssd_eagle.drafters.backends import DraftBackend
from ssd_eagle.drafters.base import Drafter, Proposal, SaguaroSampling
from ssd_eagle.drafters.chain import draft_chain
from ssd_eagle.drafters.tree import TreeSettings, grow_after_committed
from ssd_eagle.kv_cache import DraftKV


@torch.inference_mode()  # (the SSD backup calls it outside any: fixed-shape buffers are inference tensors)
def draft_from_committed(backend: DraftBackend, seqs: list, num_cached: list[int], pending: list, budgets: list[int],
                         saguaro: SaguaroSampling | None = None, tree: TreeSettings | None = None) -> list[Proposal]:
    """Draft after each row's committed text: one :meth:`~DraftBackend.extend` over its uncached committed tokens
    ``seqs[r].token_ids[num_cached[r]:]`` (with ``pending[r]``, EAGLE-3's features of them), then a chain of
    ``budgets[r]`` tokens or a dynamic tree of that depth rooted at the last committed token. Writes the draft's
    cache only from ``num_cached[r]`` on.

    Args:
        seqs: R sequences (``slot``, ``token_ids``, ``params``, ``draft_generator``); budgets: each >= 1.

    Returns:
        R proposals with ``hidden`` (EAGLE-3: the head's output at each node's parent).
    """
    b = backend
    slots = [s.slot for s in seqs]
    lengths = [len(s.token_ids) for s in seqs]
    logits, hidden = b.extend(slots, [s.token_ids[c:] for s, c in zip(seqs, num_cached)],
                              [c - b.offset for c in num_cached], pending if b.needs_aux else None)
    if tree is not None:
        return grow_after_committed(b, slots, lengths, logits, hidden, tree, budgets)
    return draft_chain(b.chain_feed(slots, [n - b.offset for n in lengths]), logits, hidden, seqs, budgets, saguaro,
                       b.vocab, b.temperature_scale)


def last_rows(pieces: list[torch.Tensor], n: int) -> torch.Tensor:
    """The last ``n`` rows of ``torch.cat(pieces)``, concatenating only the pieces they lie in (a prompt's aux
    states arrive in chunks; a drafter prefilling them chunk by chunk takes the new ones)."""
    tail, rows = [], 0
    for piece in reversed(pieces):
        if rows >= n:
            break
        tail.append(piece)
        rows += piece.shape[0]
    return torch.cat(tail[::-1])[rows - n:] if len(tail) > 1 else tail[0][rows - n:]


FUSE_ROWS = 64  # EAGLE-3: raw aux rows kept before they are fused in one call (bounds their memory)


@dataclass
class _State:
    num_cached: int  # first token position whose draft cache entry is not valid for the committed text
    pending: torch.Tensor | None = None  # EAGLE-3: features of token positions num_cached .. (then raw's)
    raw: list[torch.Tensor] = field(default_factory=list)  # EAGLE-3: aux states after pending's, not fused yet
    base: int = 0  # len(token_ids) when the last proposal was made (0: none since the last verification)
    fed: int = 0  # drafts of that proposal fed at their own positions
    skipped: bool = False  # a round verified without a proposal since the draft was last fed

    def features(self, backend: DraftBackend) -> torch.Tensor | None:
        """``pending`` followed by the fused ``raw`` rows (fused here, in one call); ``raw`` is emptied."""
        if self.raw:
            self.pending = backend.append_features(self.pending, torch.cat(self.raw))
            self.raw = []
        return self.pending


class NeuralDrafter(Drafter):
    """Chains (or dynamic trees) from a draft backend.

    Args:
        backend: the draft; its cache has one slot per engine slot (a sequence uses its target slot).
        saguaro: optional Saguaro sampling of q (chains only).
        tree: propose dynamic trees of this shape instead of chains.
    """

    def __init__(self, backend: DraftBackend, saguaro: SaguaroSampling | None = None,
                 tree: TreeSettings | None = None, token_budget: int = 512):
        self.backend = backend
        self.kv_geometry = DraftKV(backend.kv.bytes_per_position)  # (its store follows the target's: fit_kv)
        self.needs_aux_hidden = backend.needs_aux
        self.aux_layer_ids = backend.aux_layer_ids
        self.saguaro = saguaro
        self.tree = tree
        self.shape = tree.budget if tree is not None else 0  # the planner's shape for the next round (set_shape)
        self.token_budget = token_budget
        self.states: dict[str, _State] = {}

    def set_token_budget(self, tokens: int) -> None:
        self.token_budget = tokens

    def set_shape(self, tree: int) -> None:
        self.shape = tree

    def prefill(self, seq, aux: list[torch.Tensor] | None) -> None:
        st = self.states.setdefault(seq.request_id, _State(0))
        new = last_rows(aux, seq.num_cached - st.num_cached) if self.backend.needs_aux else None
        st.pending = self.backend.prefill(seq.slot, seq.token_ids, new, st.num_cached, seq.num_cached, st.pending)
        st.num_cached = seq.num_cached

    def add_sequence(self, seq, prompt_aux: torch.Tensor | None) -> None:
        st = self.states.setdefault(seq.request_id, _State(0))  # (prefill fed the chunks before the last)
        end = len(seq.token_ids) - 1
        new = prompt_aux[st.num_cached:] if self.backend.needs_aux else None
        st.pending = self.backend.prefill(seq.slot, seq.token_ids, new, st.num_cached, end, st.pending)
        st.num_cached = end

    def catch_up(self, seq) -> bool:
        """After rounds that verified no proposal of ``seq``: feed the draft the tokens committed since it was last
        fed, but the last (which the round's :meth:`~DraftBackend.extend` feeds), in dynamic-shape forwards of at
        most ``token_budget`` tokens (:meth:`~DraftBackend.write`). Otherwise the last round left at most K + 1
        tokens: they go with the extend. Returns whether it fed anything."""
        st, b = self.states[seq.request_id], self.backend
        last = len(seq.token_ids) - 1
        if not st.skipped or last - st.num_cached < 2:
            return False
        features = st.features(b)
        while st.num_cached < last:
            n = min(self.token_budget, last - st.num_cached)
            b.write(seq.slot, seq.token_ids[st.num_cached: st.num_cached + n], st.num_cached - b.offset,
                    None if features is None else features[:n])
            st.num_cached += n
            features = None if features is None else features[n:]
        st.pending, st.skipped = features, False
        return True

    def remove_sequence(self, seq) -> None:
        self.states.pop(seq.request_id, None)

    def fit_kv(self, num_rows: int, capacity: int) -> None:
        if self.backend.static is None or not self.backend.static.pads:  # padding rows write the last slot
            self.backend.kv.fit(num_rows, capacity)

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        self.catch_up_seconds = 0.0
        rows = [i for i, k in enumerate(num_tokens) if k > 0]
        if not rows:
            return proposals
        row_seqs = [seqs[i] for i in rows]
        start = time.perf_counter()
        if any([self.catch_up(seq) for seq in row_seqs]):
            self.catch_up_seconds = time.perf_counter() - start
        states = [self.states[s.request_id] for s in row_seqs]
        drafts = draft_from_committed(self.backend, row_seqs, [st.num_cached for st in states],
                                      [st.features(self.backend) for st in states], [num_tokens[i] for i in rows],
                                      self.saguaro, self._tree_settings())
        for i, seq, st, draft in zip(rows, row_seqs, states, drafts):
            n = len(seq.token_ids)
            st.num_cached, st.pending, st.base, st.skipped = n, None, n, False
            st.fed = len(draft.tokens) - 1 if draft.parents is None else 0
            proposals[i] = Proposal(draft.tokens, draft.q, parents=draft.parents, q_ids=draft.q_ids,
                                    ranks=draft.ranks)
        return proposals

    def _tree_settings(self) -> TreeSettings | None:
        """The next round's tree (None: chains): the configured one, its budget cut to the planned size."""
        if self.tree is None or not self.shape:
            return None
        return self.tree if self.shape >= self.tree.budget else replace(self.tree, budget=self.shape)

    def on_verified(self, seq, num_accepted: int, aux: torch.Tensor | None) -> None:
        st = self.states[seq.request_id]
        st.skipped |= not st.base
        if self.backend.needs_aux:
            st.raw.append(aux)
            if sum(a.shape[0] for a in st.raw) >= FUSE_ROWS:
                st.features(self.backend)
        elif st.base:
            st.num_cached = st.base + min(num_accepted, st.fed)
        st.base = 0
