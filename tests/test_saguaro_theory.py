"""The Saguaro non-stall probability: its closed form equals a Monte Carlo run of the runtime's own sampler,
ratio test and cache-set code, and its gradient moves a draft towards rounds that do not stall."""

from __future__ import annotations

import math

import pytest
import torch

from ssd_eagle.sampling import sample
from ssd_eagle.ssd.fanout import expected_acceptance, nonstall_probability
from ssd_eagle.ssd.branch_trees import bonus_candidates
from ssd_eagle.verify import rejection_verify, saguaro_scale

V = 12
N = 40_000


def monte_carlo(p: torch.Tensor, q: torch.Tensor, c: float, fanout: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    q_c = saguaro_scale(q, c, fanout)
    drafts = sample(q_c.expand(N, V).clone(), [gen] * N)  # the drafter's sampler
    p_rows = p.expand(N, 2, V).clone()  # position 0 is tested; position 1 would follow full acceptance
    k, bonus = rejection_verify(p_rows, q_c.expand(N, 1, V), drafts[:, None], torch.ones(N, dtype=torch.long),
                                [gen] * N)
    ok = 0
    for x, kk, b in zip(drafts.tolist(), k.tolist(), bonus.tolist()):
        ok += kk == 1 or b in bonus_candidates(q, {x}, fanout)  # the speculator's cache set
    return ok / N


@pytest.mark.parametrize("c,fanout", [(1.0, 2), (0.5, 1), (0.3, 3), (0.8, 0)])
def test_closed_form_equals_monte_carlo(c, fanout):
    g = torch.Generator().manual_seed(int(c * 10) + fanout)
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.log(p) + torch.randn(V, generator=g, dtype=torch.float64), -1)
    exact = float(nonstall_probability(p, q, c, fanout))
    estimate = monte_carlo(p, q, c, fanout, seed=fanout)
    sigma = math.sqrt(exact * (1 - exact) / N)
    assert abs(estimate - exact) < 4 * sigma + 1e-9, (exact, estimate)


def test_without_cache_it_is_the_acceptance_rate():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    torch.testing.assert_close(nonstall_probability(p, q, 1.0, 0), expected_acceptance(p, q))


def test_gradient_moves_a_draft_towards_higher_nonstall_probability():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, V, generator=g) * 2, -1)
    logits = torch.randn(4, V, generator=g, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    before = float(nonstall_probability(p, torch.softmax(logits.detach(), -1), 0.5, 2).mean())
    for _ in range(30):
        opt.zero_grad()
        (-nonstall_probability(p, torch.softmax(logits, -1), 0.5, 2).mean()).backward()
        opt.step()
    after = float(nonstall_probability(p, torch.softmax(logits.detach(), -1), 0.5, 2).mean())
    assert after > before + 0.05
