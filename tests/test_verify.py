"""Verification functions: greedy acceptance and the output law of rejection sampling.

The statistical tests run many independent decodes of a toy first-order Markov "target" P and "draft" Q over a
small vocabulary, through several rounds of draft-then-verify, and compare the law of the first three emitted
tokens with the target's exact law by a chi-square test. Tolerance: the test fails when the chi-square p-value
is below 1e-4 (with a fixed seed, so a pass is reproducible).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ssd_eagle.sampling import SamplingTensors, logits_to_probs
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.verify import greedy_verify, rejection_verify, saguaro_scale

V = 5
T = 3  # tokens whose joint law is checked
N = 60_000


def test_greedy_verify_counts_matching_prefix():
    logits = torch.zeros(3, 4, 6)
    target_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    logits.scatter_(2, target_ids[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 0], [1, 2, 3], [5, 5, 5]])
    k, bonus = greedy_verify(logits, drafts, torch.tensor([3, 2, 1]))
    assert k.tolist() == [2, 2, 1]  # row 1 proposed only 2; row 2 only 1
    assert bonus.tolist() == [3, 3, 5]


def test_greedy_verify_no_drafts_is_argmax():
    logits = torch.randn(2, 1, 9)
    k, bonus = greedy_verify(logits, torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert k.tolist() == [0, 0]
    assert bonus.tolist() == logits[:, 0].argmax(-1).tolist()


def test_saguaro_scale_moves_mass_off_the_top():
    q = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]])
    out = saguaro_scale(q, 0.5, 1)  # top-2 scaled by 0.5
    expected = torch.tensor([[0.25, 0.15, 0.1, 0.05, 0.05]])
    torch.testing.assert_close(out, expected / expected.sum())
    torch.testing.assert_close(saguaro_scale(q, 1.0, 3), q)
    per_position = saguaro_scale(q.repeat(2, 1), 0.5, torch.tensor([0, 2]))
    assert per_position[0, 1] > per_position[1, 1]  # position 0 scales only its top-1
    with pytest.raises(ValueError, match="saguaro C"):
        saguaro_scale(q, 0.0, 1)


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    st = SamplingTensors.from_params([SamplingParams(top_k=2)])
    torch.testing.assert_close(logits_to_probs(logits, st), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    st = SamplingTensors.from_params([SamplingParams(top_p=0.75)])  # 0.4 + 0.3 < 0.75 -> keeps 3
    torch.testing.assert_close(logits_to_probs(logits, st), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))


def _exact_law(P: np.ndarray, start: int) -> np.ndarray:
    law = np.zeros((V,) * T)
    for idx in np.ndindex(*law.shape):
        prob, prev = 1.0, start
        for tok in idx:
            prob *= P[prev, tok]
            prev = tok
        law[idx] = prob
    return law


def _simulate(P: torch.Tensor, Q: torch.Tensor | None, K: int, start: int, gen: torch.Generator,
              saguaro: tuple[float, list[int]] | None = None) -> np.ndarray:
    """Decode N rows of the Markov target P with drafts from Q (None: deterministic drafts = argmax of P's
    neighbour, i.e. point masses), K per round, until T tokens are out. Returns counts over V**T cells."""
    out = torch.full((N, T), -1, dtype=torch.long)
    filled = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), start, dtype=torch.long)
    rows = torch.arange(N)
    while bool((filled < T).any()):
        active = rows[filled < T]
        B = active.numel()
        prev = last[active]
        drafts = torch.zeros(B, K, dtype=torch.long)
        q = torch.zeros(B, K, V, dtype=P.dtype) if Q is not None else None
        for i in range(K):
            if Q is None:  # deterministic proposal: a fixed but imperfect guess
                drafts[:, i] = (prev + 1) % V
            else:
                qi = Q[prev]
                if saguaro is not None:
                    qi = saguaro_scale(qi, saguaro[0], saguaro[1][i])
                q[:, i] = qi
                drafts[:, i] = torch.multinomial(qi, 1, generator=gen).squeeze(1)
            prev = drafts[:, i]
        context = torch.cat([last[active, None], drafts], dim=1)  # [B, K+1]
        p = P[context]  # [B, K+1, V]
        k, bonus = rejection_verify(p, q, drafts, torch.full((B,), K), [gen] * B)
        emitted = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(B), k] = bonus
        for j in range(K + 1):
            take = (j <= k) & (filled[active] < T)
            r = active[take]
            out[r, filled[r]] = emitted[take, j]
            filled[r] += 1
        last[active] = bonus
    flat = (out * torch.tensor([V**2, V, 1])).sum(dim=1)
    return np.bincount(flat.numpy(), minlength=V**T)


def _markov(seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g, dtype=torch.float64) * sharp


CASES = {
    "plain": dict(params=SamplingParams(temperature=1.0), saguaro=None),
    "temperature": dict(params=SamplingParams(temperature=0.7), saguaro=None),
    "top_k": dict(params=SamplingParams(temperature=1.0, top_k=3), saguaro=None),
    "top_p": dict(params=SamplingParams(temperature=1.0, top_p=0.8), saguaro=None),
    "saguaro": dict(params=SamplingParams(temperature=1.0), saguaro=(0.4, [2, 1, 1])),
    "saguaro_top_k": dict(params=SamplingParams(temperature=0.8, top_k=4), saguaro=(0.6, [1, 1, 0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_sampling_reproduces_target_law(case):
    cfg = CASES[case]
    st = SamplingTensors.from_params([cfg["params"]] * V)
    P = logits_to_probs(_markov(1, 1.5), st)  # processed identically for p and q
    Q = logits_to_probs(_markov(2, 1.5) + _markov(1, 1.5), st)  # correlated with P, not equal
    gen = torch.Generator().manual_seed(1234)
    counts = _simulate(P, Q, K=3, start=0, gen=gen, saguaro=cfg["saguaro"])
    law = _exact_law(P.numpy(), 0).reshape(-1)
    keep = law > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = law[keep] / law[keep].sum() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > 1e-4


def test_rejection_sampling_with_point_mass_proposals():
    st = SamplingTensors.from_params([SamplingParams()] * V)
    P = logits_to_probs(_markov(3, 1.0), st)
    counts = _simulate(P, None, K=2, start=1, gen=torch.Generator().manual_seed(7))
    law = _exact_law(P.numpy(), 1).reshape(-1)
    assert chisquare(counts, law / law.sum() * counts.sum()).pvalue > 1e-4


def test_rejection_sampling_accepts_everything_when_q_equals_p():
    p = torch.softmax(torch.randn(4, 3, 7, dtype=torch.float64), -1)
    drafts = torch.stack([torch.multinomial(p[:, i], 1).squeeze(1) for i in range(2)], dim=1)
    k, _ = rejection_verify(p, p[:, :2], drafts, torch.full((4,), 2), [None] * 4)
    assert k.tolist() == [2, 2, 2, 2]


def test_sample_is_exact_never_picks_zero_mass_and_keeps_rows_independent():
    from ssd_eagle.sampling import sample

    n = 100_000
    p = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64) * 7  # unnormalised, like a residual
    draws = sample(p.expand(n, 6).clone(), [torch.Generator().manual_seed(0)] * n)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    expected = p / p.sum() * n
    chi2 = float(((counts[[1, 3, 4]] - expected[[1, 3, 4]]) ** 2 / expected[[1, 3, 4]]).sum())
    assert chi2 < 18.4  # 2 dof, p ~ 1e-4
    assert int(sample(torch.tensor([[0.0, 0.0, 0.0, 2.0]]), [None])) == 3  # mass only at the end
    # a row's draw depends only on its own generator, not on the rows batched with it
    alone = sample(p[None].float(), [torch.Generator().manual_seed(5)])
    batched = sample(torch.stack([torch.rand(6), p.float()]), [torch.Generator().manual_seed(1),
                                                                torch.Generator().manual_seed(5)])
    assert int(alone[0]) == int(batched[1])


def test_chain_acceptance_probs_is_the_rate_rejection_sampling_accepts_at():
    """sum_x min(p, q): by hand for p = (.5, .3, .2), q = (.2, .5, .3), 0.2 + 0.3 + 0.2 = 0.7; a point mass: p(d).
    Drafts drawn from q and tested by :func:`rejection_verify` are accepted at that rate (20000 rows: within 4
    standard errors)."""
    from ssd_eagle.verify import chain_acceptance_probs

    p = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]])
    q = torch.tensor([[[0.2, 0.5, 0.3]]])
    d = torch.tensor([[1]])
    assert chain_acceptance_probs(p, q, d).tolist() == [[pytest.approx(0.7)]]
    assert chain_acceptance_probs(p, None, d).tolist() == [[pytest.approx(0.3)]]
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q[0, 0].expand(n, 3), 1, generator=gen)
    k, _ = rejection_verify(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, torch.ones(n, dtype=torch.long),
                            [torch.Generator().manual_seed(i) for i in range(n)])
    assert abs(k.float().mean().item() - 0.7) < 4 * (0.7 * 0.3 / n) ** 0.5


def test_tree_child_probs_gives_the_targets_probability_of_each_child_along_the_path():
    """Root children tokens 1, 2 (nodes 1, 2); node 1's child token 0 (node 3); node 3 a leaf. Path [1, 3]: at the
    root p(1), p(2) (sum 0.7, the chance to go on), at node 1 p(0); node 3 has no children (the tree's depth)."""
    from ssd_eagle.verify import tree_child_probs

    probs = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.6, 0.1, 0.1, 0.2], [0.25] * 4, [0.25] * 4])
    kids = tree_child_probs(probs, nodes=[1, 2, 0], parents=[0, 0, 1], path=[1, 3])
    assert kids == [{1: pytest.approx(0.5), 2: pytest.approx(0.2)}, {3: pytest.approx(0.6)}, {}]
    assert tree_child_probs(probs, [1, 2, 0], [0, 0, 1], []) == [{1: pytest.approx(0.5), 2: pytest.approx(0.2)}]
    assert tree_child_probs(probs, [1, 2, 0], [0, 0, 1], [2]) == [{1: pytest.approx(0.5), 2: pytest.approx(0.2)}, {}]
