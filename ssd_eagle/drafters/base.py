"""The one small interface every drafter implements.

The engine drives a drafter through a sequence's life:

1. ``add_sequence(seq, prompt_aux)`` after the target's prefill sampled the first output token. ``prompt_aux``
   holds the target's aux hidden states for the prompt positions (only for drafters with
   ``needs_aux_hidden``).
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
from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """Draft tokens for one sequence.

    Attributes:
        tokens: the proposed ids ``d_1..d_k`` (k may be 0); for a tree, the node tokens (node i = tokens[i-1]).
        q: float [k, V_target], the distributions the tokens were sampled from, or None for point masses
            (chains only; tree children are deterministic choices, verified by sample-and-match).
        parents: None for a chain; for a tree, the parent of each node (0 = the last committed token), parents
            listed before their children.
        cache_hit: SSD only: whether this proposal came from the speculation cache (None: no lookup happened).
        lookup_k: SSD only: the accepted length k that was looked up.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    cache_hit: bool | None = None
    lookup_k: int | None = None
    parents: list[int] | None = None


class Drafter(ABC):
    """Base class of all drafters (see the module docstring for the call order)."""

    needs_aux_hidden: bool = False
    name: str = "drafter"
    healthy: bool = True  # False after a failure: the engine then decodes without drafts
    error: str | None = None

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


def sample_draft_tokens(logits: torch.Tensor, seqs: list, position: int,
                        saguaro: SaguaroSampling | None = None) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Pick the next draft token of every row and report the q it was drawn from.

    Greedy rows take the argmax (q None: a point mass). Sampled rows draw from
    ``saguaro_scale(logits_to_probs(logits), C, F_position)`` with the sequence's ``draft_generator``.

    Args:
        logits: float [B, V_target] draft logits in the target's vocabulary (-inf outside a reduced vocabulary).
        seqs: the B sequences (for sampling params and generators).
        position: index of this draft token in the chain (selects F_k).

    Returns:
        (tokens int64 [B], q: B entries, each float [V_target] or None).
    """
    from ssd_eagle.sampling import SamplingTensors, logits_to_probs, sample
    from ssd_eagle.verify import saguaro_scale

    tokens = logits.argmax(dim=-1)
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        st = SamplingTensors.from_params([seqs[i].params for i in rows], logits.device)
        q = logits_to_probs(logits[rows], st)
        if saguaro is not None and saguaro.c < 1.0:
            q = saguaro_scale(q, saguaro.c, saguaro.fanout_at(position))
        tokens[rows] = sample(q, [seqs[i].draft_generator for i in rows])
        for j, i in enumerate(rows):
            qs[i] = q[j]
    return tokens, qs
