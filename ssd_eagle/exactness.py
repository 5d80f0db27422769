"""Greedy exactness in low precision: the near-tie rule (issue 13).

In float32/float64 speculative decoding at T = 0 emits the target's greedy decode token for token (the tests
check token ids). In bfloat16 a verification of n tokens and a one-token decode step run different kernels
(different blockings, different summation orders), so the same position can get logits that differ in the last
bits, and where the top two logits are that close the argmax can flip. Speculative decoding is then still exact
with respect to *its own* forwards, and that is what is required in bf16:

1. every emitted token is the argmax of the logits of the verification that emitted it (:func:`argmax_consistent`);
2. where the output differs from the same-dtype autoregressive decode, AR's own top-2 gap at the first differing
   token is a near tie: ``top1 - top2 <= 2^-6 * max(|top1|, 1)`` (:func:`near_tie_bound`). Only the first
   divergence of a prompt is judged: after it the two decodes continue different texts.

:class:`TopTwoRecorder` records AR's top-2 logits at every step (a forward hook on the output layer), and
:func:`judge` applies rule 2 to one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE_SCALE = 2.0 ** -6


def near_tie_bound(top1: float) -> float:
    """The largest top-2 logit gap that still counts as a near tie, for a top-1 logit ``top1``."""
    return NEAR_TIE_SCALE * max(abs(top1), 1.0)


@dataclass(frozen=True)
class TopTwo:
    """The two largest logits of one output row (float logits, any dtype, read as python floats)."""

    top1: float
    top2: float
    top1_id: int
    top2_id: int

    @property
    def gap(self) -> float:
        return self.top1 - self.top2


class TopTwoRecorder:
    """Context manager recording :class:`TopTwo` of the first position of every sequence in each call of the model's
    output layer (logits ``[B, n, V]``), in call order.

    For a batch-1 autoregressive decode by :class:`~ssd_eagle.engine.llm_engine.LLMEngine` (the last prompt
    position at prefill, then the step's token, first of its forward even when the forward is padded) record i
    belongs to output token i.
    """

    def __init__(self, model):
        self.layer = model.get_output_embeddings()
        self.rows: list[TopTwo] = []
        self._handle = None

    def _hook(self, module, args, logits: torch.Tensor) -> None:
        values, ids = logits.detach().reshape(-1, logits.shape[-2], logits.shape[-1])[:, 0].topk(2, dim=-1)
        for (v1, v2), (i1, i2) in zip(values.float().tolist(), ids.tolist()):
            self.rows.append(TopTwo(v1, v2, i1, i2))

    def __enter__(self) -> TopTwoRecorder:
        self.rows = []
        self._handle = self.layer.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None


@dataclass(frozen=True)
class Divergence:
    """The first position where a decode differs from the autoregressive reference, and AR's logits there.

    Attributes:
        position: index in the output tokens.
        ar_token / token: the reference's and the other decode's token there (-1: that decode had stopped).
        gap: AR's top-1 minus top-2 logit at that position (inf when the tokens agree and only the stops differ);
            bound: :func:`near_tie_bound` of AR's top-1.
        runner_up: the other decode's token is AR's second choice.
    """

    position: int
    ar_token: int
    token: int
    gap: float
    bound: float
    runner_up: bool

    @property
    def allowed(self) -> bool:
        return self.gap <= self.bound


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other); None when the
    two are equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def judge(reference: list[int], reference_top2: list[TopTwo], other: list[int]) -> Divergence | None:
    """Apply the near-tie rule to one prompt: None when ``other`` equals the reference, else its first divergence.

    Args:
        reference: AR's output tokens; reference_top2: AR's :class:`TopTwo` per output token (at least as many).
        other: the speculative decode's output tokens.

    Raises:
        ValueError: fewer recorded rows than reference tokens, or a recorded top-1 that is not the AR token
            (the recording does not belong to this decode).
    """
    if len(reference_top2) < len(reference):
        raise ValueError(f"{len(reference_top2)} recorded rows for {len(reference)} reference tokens")
    i = first_divergence(reference, other)
    if i is None:
        return None
    if i == min(len(reference), len(other)):  # equal tokens, different stops: no logits can explain that
        return Divergence(i, reference[i] if i < len(reference) else -1, other[i] if i < len(other) else -1,
                          float("inf"), near_tie_bound(0.0), False)
    row = reference_top2[i]
    if row.top1_id != reference[i] and row.top1 != row.top2:
        raise ValueError(f"recorded top-1 {row.top1_id} at position {i} is not the reference token {reference[i]}")
    return Divergence(i, reference[i], other[i], row.gap, near_tie_bound(row.top1), other[i] == row.top2_id)


def argmax_consistent(logprobs) -> bool:
    """Every emitted token is the argmax of its own verification's logits: its log-probability is the largest of
    its row (``logprobs``: the engine's :class:`~ssd_eagle.engine.sequence.TokenLogprob` list, requested with
    ``SamplingParams(logprobs=1)`` or more; ties count as consistent)."""
    return all(lp.logprob >= max(lp.top.values()) for lp in logprobs)
