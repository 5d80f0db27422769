"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the current suffix.

Same idea as transformers' ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` method (Saxena 2023): try suffix
lengths from ``max_n`` down to ``min_n``; at the longest length with an earlier match, propose the tokens that
followed the most recent match. Proposals are deterministic, so they are point masses (``q=None``) for the
verifier. No model, no state: it reads ``seq.token_ids``.
"""

from __future__ import annotations

import numpy as np

from ssd_eagle.drafters.base import Drafter, Proposal


def lookup_continuation(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Continuation of the latest earlier occurrence of the longest matching suffix.

    Args:
        tokens: int64 [L] the sequence so far.
        num_tokens: most tokens to return.
        min_n, max_n: suffix lengths tried, longest first.

    Returns:
        Up to ``num_tokens`` ids (empty when no suffix of length >= min_n occurs earlier).
    """
    L = tokens.shape[0]
    if num_tokens <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start: start + num_tokens].tolist()
    return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafter.

    Args:
        min_n: shortest suffix to match (vLLM's ``prompt_lookup_min``), >= 1.
        max_n: longest suffix to match (vLLM's ``prompt_lookup_max``), >= min_n.

    Raises:
        ValueError: bad n range.
    """

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min/max must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(lookup_continuation(np.asarray(seq.token_ids, dtype=np.int64), k, self.min_n, self.max_n))
                for seq, k in zip(seqs, num_tokens)]
