"""SD with a neural draft (a draft LM or an EAGLE-3 head): the engine's drafter over a
:class:`~ssd_eagle.drafters.backends.DraftBackend`.

A prompt is prefilled chunk by chunk as the target caches it (:meth:`NeuralDrafter.prefill`; ``add_sequence`` feeds
the last chunk), and the draft's store follows the live requests (:meth:`NeuralDrafter.fit_kv`).

Per sequence the drafter keeps ``num_cached``, the first token position whose draft cache entry is not valid for
the committed text, and for EAGLE-3 the fused target features still to feed (``pending``, of token positions
``num_cached .. len(token_ids) - 1``). A round: one :meth:`~DraftBackend.extend` over the committed tokens not yet
cached (usually one or two) gives the first draft's distribution, then :func:`~ssd_eagle.drafters.chain.draft_chain`
(K - 1 more forwards) or :func:`~ssd_eagle.drafters.tree.grow_after_committed` (one forward per level).

After the target accepts k drafts:

- a draft LM keeps the accepted drafts it fed at their own positions (a chain's first K - 1; a tree's entries are
  not kept: the next round feeds the accepted tokens again);
- an EAGLE-3 head gets the target's features of the k + 1 verified inputs now committed; they replace the head's
  self-fed entries, which are simply overwritten (EAGLE-3, Li et al. 2025: while the target's features exist,
  ``f_i = fc(aux_i)``; while drafting, the head feeds back its own output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.drafters.backends import DraftBackend
from ssd_eagle.drafters.base import Drafter, Proposal, SaguaroSampling
from ssd_eagle.drafters.chain import draft_chain
from ssd_eagle.drafters.tree import TreeSettings, grow_after_committed
from ssd_eagle.kv_cache import DraftKV


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
    return draft_chain(b.chain_feed(slots, [n - b.offset for n in lengths]), logits, hidden, seqs, budgets, saguaro)


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


@dataclass
class _State:
    num_cached: int  # first token position whose draft cache entry is not valid for the committed text
    pending: torch.Tensor | None = None  # EAGLE-3: features of token positions num_cached .. len(token_ids) - 1
    base: int = 0  # len(token_ids) when the last proposal was made (0: none since the last verification)
    fed: int = 0  # drafts of that proposal fed at their own positions


class NeuralDrafter(Drafter):
    """Chains (or dynamic trees) from a draft backend.

    Args:
        backend: the draft; its cache has one slot per engine slot (a sequence uses its target slot).
        saguaro: optional Saguaro sampling of q (chains only).
        tree: propose dynamic trees of this shape instead of chains.
    """

    def __init__(self, backend: DraftBackend, saguaro: SaguaroSampling | None = None,
                 tree: TreeSettings | None = None):
        self.backend = backend
        self.kv_geometry = DraftKV(backend.kv.bytes_per_position)  # (its store follows the target's: fit_kv)
        self.needs_aux_hidden = backend.needs_aux
        self.aux_layer_ids = backend.aux_layer_ids
        self.saguaro = saguaro
        self.tree = tree
        self.states: dict[str, _State] = {}

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

    def remove_sequence(self, seq) -> None:
        self.states.pop(seq.request_id, None)

    def fit_kv(self, num_rows: int, capacity: int) -> None:
        if self.backend.static is None or not self.backend.static.pads:  # padding rows write the last slot
            self.backend.kv.fit(num_rows, capacity)

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        rows = [i for i, k in enumerate(num_tokens) if k > 0]
        if not rows:
            return proposals
        row_seqs = [seqs[i] for i in rows]
        states = [self.states[s.request_id] for s in row_seqs]
        drafts = draft_from_committed(self.backend, row_seqs, [st.num_cached for st in states],
                                      [st.pending for st in states], [num_tokens[i] for i in rows], self.saguaro,
                                      self.tree)
        for i, seq, st, draft in zip(rows, row_seqs, states, drafts):
            n = len(seq.token_ids)
            st.num_cached, st.pending, st.base = n, None, n
            st.fed = len(draft.tokens) - 1 if draft.parents is None else 0
            proposals[i] = Proposal(draft.tokens, draft.q, parents=draft.parents)
        return proposals

    def on_verified(self, seq, num_accepted: int, aux: torch.Tensor | None) -> None:
        st = self.states[seq.request_id]
        if self.backend.needs_aux:
            st.pending = self.backend.append_features(st.pending, aux)
        elif st.base:
            st.num_cached = st.base + min(num_accepted, st.fed)
        st.base = 0
