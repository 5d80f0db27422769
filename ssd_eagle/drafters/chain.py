"""Chain drafting: sample each draft token from the draft and report the q it was drawn from (SD chains, the SSD
backup and the speculator's branches all draft through :func:`draft_chain`).

A chain's tokens at T > 0 are samples from the q they report (after the row's temperature/top-k/top-p,
:func:`ssd_eagle.sampling.logits_to_probs`, and Saguaro scaling, SSD paper Sec. 4.2), which is what the verifier
tests them with; greedy rows take the argmax and report no q (a point mass).

The draft's own temperature scale s (``draft_temperature_scale`` in the draft's ``config.json``, calibrated by
``python -m train.calibrate``) makes a sampled row draw from ``q = softmax(z / (T s))``: any q keeps the output law
the target's (the verifier tests with the q that travels), and the q that maximises a token's acceptance chance
``sum_x min(p(x), q(x))`` is sharper than the draft's cross-entropy-trained estimate of p when that estimate is
unsure (a weak draft's q is flatter than p where it does not know the token). The committed SmolLM2-135M EAGLE-3
head on 64 training conversations (``train.calibrate``, bf16, teacher-forced): the first draft's acceptance chance
at T = 1 is 0.524 with s = 1 and 0.570 with s = 0.7, its second and third drafts' +9% and +11% (T = 0.5: 0.583 ->
0.586). Greedy rows and tree children (top-k, no q) do not depend on s. The SSD speculator drafts at s = 1 unless
told otherwise (:func:`ssd_eagle.ssd.worker.build_speculator` says why).
"""

from __future__ import annotations

from typing import Callable

import torch

from ssd_eagle.drafters.base import Proposal, SaguaroSampling

# feed(rows, tokens [R'], features [R', H] | None, index) -> (logits [R', D], outputs [R', H] | None)
FeedFn = Callable[[list[int], torch.Tensor, "torch.Tensor | None", int], tuple[torch.Tensor, "torch.Tensor | None"]]


def sample_draft_tokens(logits: torch.Tensor, seqs: list, position: int, saguaro: SaguaroSampling | None = None,
                        vocab: torch.Tensor | None = None,
                        temperature_scale: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Pick the next draft token of every row and report the q it was drawn from.

    Greedy rows take the argmax (q None: a point mass). Sampled rows draw from
    ``saguaro_scale(logits_to_probs(logits / temperature_scale), C, F_position)`` (the row's temperature T times
    the draft's scale s; module docstring) with the sequence's ``draft_generator``. Padding
    rows (``None``; e.g. the branches that fill a fixed-shape batch to the fan-out budget) take the argmax and
    draw nothing, so what a sequence's generator yields never depends on the batch's shape.

    Args:
        logits: float [B, D] draft logits over the columns ``vocab`` (the target id of each column; None: the
            target's vocabulary, D = V_target; :attr:`~ssd_eagle.drafters.backends.DraftBackend.vocab`).
        seqs: the B sequences (for sampling params and generators), None for a padding row.
        position: index of this draft token in the chain (selects F_k).
        temperature_scale: s > 0, the draft's temperature scale (1: q at the row's own temperature).

    Returns:
        (target token ids int64 [B], q: B entries, each float [D] over the same columns, or None).
    """
    from ssd_eagle.sampling import SamplingTensors, logits_to_probs, sample, upcast_logits
    from ssd_eagle.verify import saguaro_scale

    tokens = logits.argmax(dim=-1)
    qs: list[torch.Tensor | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s is not None and not s.params.greedy]
    if rows:
        st = SamplingTensors.from_params([seqs[i].params for i in rows], logits.device)
        z = upcast_logits(logits[rows])
        q = logits_to_probs(z if temperature_scale == 1.0 else z / temperature_scale, st)
        if saguaro is not None and saguaro.c < 1.0:
            q = saguaro_scale(q, saguaro.c, saguaro.fanout_at(position))
        tokens[rows] = sample(q, [seqs[i].draft_generator for i in rows])
        for j, i in enumerate(rows):
            qs[i] = q[j]
    return (tokens if vocab is None else vocab[tokens]), qs


def draft_chain(feed: FeedFn, logits: torch.Tensor, hidden: torch.Tensor | None, seqs: list, budgets: list[int],
                saguaro: SaguaroSampling | None = None, vocab: torch.Tensor | None = None,
                temperature_scale: float = 1.0) -> list[Proposal]:
    """Draft one chain per row: sample a token, feed it to the draft, sample the next; ``budgets[r]`` tokens cost
    ``budgets[r] - 1`` forwards (the last token is never fed).

    Args:
        feed: runs one draft forward over the tokens just sampled at chain index ``index`` (0-based) by the rows
            ``rows`` (indices into ``seqs``) that continue, with ``features`` the draft's outputs they were sampled
            from (see ``FeedFn``); where those tokens sit in the cache is the feed's business (a chain after the
            committed text: :meth:`~ssd_eagle.drafters.backends.DraftBackend.chain_feed`).
        logits: float [R, D], the draft's distribution of each chain's first token, over the columns ``vocab``
            (as in :func:`sample_draft_tokens`; ``feed`` returns the same columns).
        hidden: float [R, H], the draft's output there (EAGLE-3), or None.
        seqs: the R rows' sequences (``params``, ``draft_generator``); None for a padding row (greedy, draws
            nothing: see :func:`sample_draft_tokens`).
        budgets: tokens per chain, each >= 1.
        saguaro: Saguaro scaling of the sampled rows' q (None: plain sampling).
        temperature_scale: the draft's temperature scale s (:func:`sample_draft_tokens`).

    Returns:
        R chain proposals: ``tokens``, ``q`` float [k, D] with ``q_ids = vocab`` (None for greedy rows) and
        ``hidden`` [k, H] (the output each token was sampled from), or None without outputs.
    """
    R = len(seqs)
    tokens_out: list[list[int]] = [[] for _ in range(R)]
    qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
    hs: list[list[torch.Tensor]] = [[] for _ in range(R)]
    rows = list(range(R))
    for index in range(max(budgets)):
        tokens, q = sample_draft_tokens(logits, [seqs[r] for r in rows], index, saguaro, vocab, temperature_scale)
        for j, (r, t) in enumerate(zip(rows, tokens.tolist())):
            tokens_out[r].append(t)
            if q[j] is not None:
                qs[r].append(q[j])
            if hidden is not None:
                hs[r].append(hidden[j])
        keep = [j for j, r in enumerate(rows) if len(tokens_out[r]) < budgets[r]]
        if not keep:
            break
        if len(keep) < len(rows):
            rows, tokens = [rows[j] for j in keep], tokens[keep]
            hidden = hidden[keep] if hidden is not None else None
        logits, hidden = feed(rows, tokens, hidden, index)
    return [Proposal(tokens_out[r], torch.stack(qs[r]) if qs[r] else None,
                     hidden=torch.stack(hs[r]) if hs[r] else None, q_ids=vocab if qs[r] else None) for r in range(R)]
