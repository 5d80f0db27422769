"""Fan-out of the speculation cache, and the theory behind it (SSD paper, Sec. 4.1; Saguaro sampling, Sec. 4.2).

After proposing K tokens, the speculator pre-drafts for outcomes "k accepted, bonus b" with b among the top-F_k
draft tokens at position k (excluding the drafted token there, which would have been accepted). With per-token
acceptance rate a, outcome k has probability ``a^k (1 - a)`` for k < K and ``a^K`` for k = K; if the bonus is
covered with probability ``p_hit(F) = 1 - F^-r`` (a power law in the fan-out), maximising the expected hit rate
under a budget ``sum_k F_k = B`` gives the geometric fan-out

    F_k = F_0 a^(k / (1 + r))                           for k < K
    F_K = F_0 a^(K / (1 + r)) (1 - a)^(-1 / (1 + r))    (the all-accepted outcome)

with F_0 fixed by the budget. :func:`geometric_fanout` rounds it to integers by largest remainder (zeros allowed,
sum exactly B). :func:`fit_power_law` estimates r from measured hit rates and :func:`fit_fanout` turns measured
statistics into a fan-out (:class:`AutoFanout` does it online, for ``fanout_power: "auto"``).

This module is also the one home for the expected-value theory of Saguaro sampling used by training:
:func:`expected_acceptance`, :func:`residual_coverage`, :func:`expected_cache_hit`, and
:func:`nonstall_probability`, the quantity a Saguaro-aware draft is trained to raise.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch


def uniform_fanout(budget: int, num_speculative_tokens: int) -> list[int]:
    """``budget`` spread evenly over the K + 1 outcomes (largest remainder: earlier positions get the extra).

    Raises:
        ValueError: budget < 0 or K < 1.
    """
    _check(budget, num_speculative_tokens)
    n = num_speculative_tokens + 1
    return [budget // n + (1 if i < budget % n else 0) for i in range(n)]


def geometric_weights(num_speculative_tokens: int, acceptance_rate: float, power: float) -> list[float]:
    """Unnormalised geometric fan-out ``F_k / F_0`` for k = 0..K (the formula in the module docstring)."""
    a, r, K = acceptance_rate, power, num_speculative_tokens
    w = [a ** (k / (1 + r)) for k in range(K)]
    w.append(a ** (K / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    return w


def geometric_fanout(budget: int, num_speculative_tokens: int, acceptance_rate: float,
                     power: float) -> list[int]:
    """Integer geometric fan-out F_0..F_K summing exactly to ``budget`` (largest-remainder rounding).

    Args:
        budget: B, total branches per sequence (>= 0).
        num_speculative_tokens: K (>= 1).
        acceptance_rate: a in (0, 1).
        power: r > 0 in ``1 - p_hit(F) = F^-r``.

    Raises:
        ValueError: a parameter out of range (named).
    """
    _check(budget, num_speculative_tokens)
    if not 0.0 < acceptance_rate < 1.0:
        raise ValueError(f"acceptance_rate must be in (0, 1), got {acceptance_rate}")
    if not power > 0.0:
        raise ValueError(f"power r must be > 0, got {power}")
    return largest_remainder(geometric_weights(num_speculative_tokens, acceptance_rate, power), budget)


def largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integers proportional to ``weights`` that sum exactly to ``total`` (Hamilton's method; ties to the
    earlier index)."""
    s = sum(weights)
    exact = [w / s * total for w in weights]
    floors = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def _check(budget: int, k: int) -> None:
    if budget < 0:
        raise ValueError(f"fan-out budget must be >= 0, got {budget}")
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")


def outcome_probabilities(num_speculative_tokens: int, acceptance_rate: float) -> list[float]:
    """P(k accepted) for k = 0..K under i.i.d. per-token acceptance a: ``a^k (1-a)``, and ``a^K`` for k = K."""
    a, K = acceptance_rate, num_speculative_tokens
    return [a**k * (1 - a) for k in range(K)] + [a**K]


def expected_hit_rate(fanout: list[int], acceptance_rate: float, power: float) -> float:
    """Expected cache hit rate of a fan-out under the model: ``sum_k P(k) (1 - F_k^-r)`` (F = 0 never hits)."""
    probs = outcome_probabilities(len(fanout) - 1, acceptance_rate)
    return sum(p * (1.0 - f ** -power) for p, f in zip(probs, fanout) if f > 0)


@dataclass(frozen=True)
class PowerLawFit:
    """``1 - p_hit(F) = c * F^-r`` fitted by least squares on log scale (c = 1 in the paper's model)."""

    power: float
    scale: float
    points: int


def fit_power_law(fanouts: list[int], hit_rates: list[float]) -> PowerLawFit:
    """Fit r (and a scale c) from measured (F, hit rate) pairs: ``log(1 - h) = log c - r log F``.

    Pairs with F < 1 or hit rate outside (0, 1) carry no information and are dropped.

    Raises:
        ValueError: fewer than two usable points.
    """
    pts = [(math.log(f), math.log(1.0 - h)) for f, h in zip(fanouts, hit_rates) if f >= 1 and 0.0 < h < 1.0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        raise ValueError("fit_power_law needs at least two points with distinct F >= 1 and 0 < hit rate < 1")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return PowerLawFit(power=-slope, scale=math.exp(my - slope * mx), points=n)


def hit_rate_by_rank(ranks: list[int], max_fanout: int,
                     stored: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Empirical ``p_hit(F)`` for F = 1..max_fanout from the rank of the true bonus token among the draft's
    candidates at each observed lookup (rank 0 = the draft's best candidate; -1 = not among the stored ones).

    A lookup that stored s candidates and did not find the bonus among them says only "rank >= s": it is
    *censored* at s, and treating it as a miss for every F > s flattens the curve past the stored candidates. With
    ``stored`` (the candidate count of each lookup) the rate is the Kaplan-Meier estimate ``1 - prod_{f < F}
    (1 - d_f / n_f)``, with ``d_f`` lookups of rank f and ``n_f`` lookups still at risk at f (rank >= f, or
    censored past f); F stops where nobody is at risk any more. Without ``stored`` every -1 counts as a miss.

    Returns:
        (fan-outs F, hit rates), of equal length (<= max_fanout).
    """
    n = len(ranks)
    if stored is None:
        fs = list(range(1, max_fanout + 1))
        return fs, [sum(1 for r in ranks if 0 <= r < f) / n if n else 0.0 for f in fs]
    if len(stored) != n:
        raise ValueError(f"stored has {len(stored)} entries for {n} ranks")
    fs, hits, survival = [], [], 1.0
    for f in range(max_fanout):
        at_risk = sum(1 for r, s in zip(ranks, stored) if r >= f or (r < 0 and s > f))
        if at_risk == 0:
            break
        survival *= 1.0 - sum(1 for r in ranks if r == f) / at_risk
        fs.append(f + 1)
        hits.append(1.0 - survival)
    return fs, hits


class OnlinePowerFit:
    """r of ``1 - p_hit(F) = c F^-r`` fitted from the bonus ranks the speculator observes (censored at the
    candidates it stored, :func:`hit_rate_by_rank`), once ``min_lookups`` are in.

    Args:
        default: r until then (and whenever the points cannot be fitted).
        min_lookups: observations needed before fitting.
        max_fanout: largest F used in the fit.
        window: the fit uses the latest this many lookups (bounds its cost, and follows a drifting draft).
    """

    def __init__(self, default: float = 1.0, min_lookups: int = 50, max_fanout: int = 32, window: int = 4096):
        self.default, self.min_lookups, self.max_fanout = default, min_lookups, max_fanout
        self.ranks: deque[int] = deque(maxlen=window)
        self.stored: deque[int] = deque(maxlen=window)
        self.lookups = 0  # all recorded, the window's and earlier

    def record(self, rank: int, stored: int) -> None:
        """One lookup: the bonus token's rank among ``stored`` candidates (-1: not among them)."""
        self.ranks.append(rank)
        self.stored.append(stored)
        self.lookups += 1

    @property
    def fitted(self) -> bool:
        return self.lookups >= self.min_lookups

    @property
    def power(self) -> float:
        """The fitted r, clamped to [0.05, 5] (``default`` before ``min_lookups`` or when unfittable)."""
        if not self.fitted:
            return self.default
        try:
            fit = fit_power_law(*hit_rate_by_rank(list(self.ranks), self.max_fanout, list(self.stored)))
        except ValueError:
            return self.default
        return min(max(fit.power, 0.05), 5.0)


class AutoFanout:
    """``fanout_power: "auto"``: the geometric fan-out re-fitted from what the speculator observes.

    Every ``refit_every`` lookups from ``min_lookups`` on, r comes from :class:`OnlinePowerFit` and the acceptance
    rate a from the chains' outcomes (accepted / (accepted + rejected) draft tokens: the maximum-likelihood a of
    i.i.d. acceptance, truncated at the chain's end); the fan-out is then :func:`geometric_fanout` of the same
    budget B (for trees only r matters: they spread B per node).

    Args:
        budget: B = sum of the fan-out; num_speculative_tokens: K.
        default: r (and the fan-out it gives) until the first fit.
    """

    def __init__(self, budget: int, num_speculative_tokens: int, default: float = 1.0, min_lookups: int = 50,
                 refit_every: int = 50):
        self.budget, self.K, self.refit_every = budget, num_speculative_tokens, refit_every
        self.fit = OnlinePowerFit(default, min_lookups)
        self.accepted = self.rejected = 0
        self.power: float | None = None  # the last fitted r
        self._fitted_at = 0

    def record(self, rank: int, stored: int, accepted: int | None = None, proposed: int | None = None) -> None:
        """One lookup: the bonus's ``rank`` among the ``stored`` candidates at its node (-1: not among them; 0
        stored: no candidates there) and, for a chain, ``accepted`` of its ``proposed`` tokens."""
        self.fit.record(rank, stored)
        if accepted is not None and proposed is not None:
            self.accepted += accepted
            self.rejected += accepted < proposed

    def refit(self) -> list[int] | None:
        """The re-fitted fan-out F_0..F_K when a refit is due, else None."""
        n = self.fit.lookups
        if not self.fit.fitted or n - self._fitted_at < self.refit_every:
            return None
        self._fitted_at = n
        self.power = self.fit.power
        a = self.accepted / max(self.accepted + self.rejected, 1)
        return geometric_fanout(self.budget, self.K, min(max(a, 0.05), 0.95), self.power)


def fit_fanout(budget: int, num_speculative_tokens: int, acceptance_rate: float, bonus_ranks: list[int],
               max_fanout: int = 32, stored: list[int] | None = None) -> tuple[list[int], PowerLawFit]:
    """Pick the geometric fan-out from measured statistics: a from the acceptance rate, r from the ranks of the
    true bonus tokens among the draft's candidates (:func:`hit_rate_by_rank`, censored at ``stored`` when
    given; :func:`fit_power_law`).

    Raises:
        ValueError: not enough distinct hit-rate points to fit r.
    """
    fs, hits = hit_rate_by_rank(bonus_ranks, max_fanout, stored)
    fit = fit_power_law(fs, hits)
    a = min(max(acceptance_rate, 1e-3), 1 - 1e-3)
    return geometric_fanout(budget, num_speculative_tokens, a, max(fit.power, 1e-3)), fit


# ---------------------------------------------------------------------------------------------------------------
# Saguaro sampling: expected values for one position, given the target's p and the draft's q (issue 7's theory)

def saguaro_q(q: torch.Tensor, c: float, fanout: int) -> torch.Tensor:
    """The draft distribution Saguaro samples from (same map as :func:`ssd_eagle.verify.saguaro_scale`)."""
    from ssd_eagle.verify import saguaro_scale

    return saguaro_scale(q, c, fanout)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(draft token accepted) = ``sum_x min(p(x), q(x))`` for draft ~ q, target p. Shapes [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def residual_coverage(p: torch.Tensor, q: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """P(bonus in ``cached`` | rejection): the residual ``norm(max(p - q, 0))``'s mass on the cached set.

    Args:
        p, q: [..., V]; cached: bool [..., V] (the speculator's candidate set at this position).

    Returns:
        [...]; 0 where the residual is empty (p == q).
    """
    residual = (p - q).clamp(min=0.0)
    total = residual.sum(dim=-1)
    return torch.where(total > 0, (residual * cached).sum(dim=-1) / total.clamp(min=1e-30), torch.zeros_like(total))


def expected_cache_hit(p: torch.Tensor, q: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """P(the round does not stall at this position) = P(accept) + P(reject) * coverage of the residual by the
    cached set. Shapes [..., V] (cached bool) -> [...]."""
    accept = expected_acceptance(p, q)
    return accept + (1.0 - accept) * residual_coverage(p, q, cached)


def candidate_set(q: torch.Tensor, drafted: torch.Tensor | None, fanout: int) -> torch.Tensor:
    """The speculator's cached bonus candidates at a position: the top-``fanout`` tokens of q excluding the drafted
    token (bool [..., V]). ``drafted``: int64 [...] or None (the all-accepted position: no exclusion)."""
    scores = q.clone()
    if drafted is not None:
        scores.scatter_(-1, drafted[..., None], float("-inf"))
    top = scores.topk(min(fanout, q.shape[-1]), dim=-1).indices
    return torch.zeros_like(q, dtype=torch.bool).scatter_(-1, top, True) if fanout > 0 else \
        torch.zeros_like(q, dtype=torch.bool)


def nonstall_probability(p: torch.Tensor, q: torch.Tensor, c: float, fanout: int) -> torch.Tensor:
    """P(a round does not stall at a drafted position) under Saguaro sampling, differentiable in q.

    Setting: the speculator drafts ``x ~ q_C = saguaro(q, C, F)`` (top-(F+1) of q scaled by C, renormalised) and
    caches, as bonus candidates for "rejected here", the top-F tokens of q excluding x. The round does not stall
    when x is accepted, or when it is rejected and the bonus ``y ~ r = max(p - q_C, 0) / Z`` is cached.

    Derivation. Write ``T_j`` for the top-j tokens of q, ``A = sum_x min(p(x), q_C(x))`` (acceptance) and
    ``Z = 1 - A = sum_x max(p(x) - q_C(x), 0)`` (the residual's mass). x is rejected with probability
    ``max(q_C(x) - p(x), 0)`` (joint with drafting x), and then ``r(x) = 0``. If ``x in T_{F+1}`` the cached set is
    ``T_{F+1} minus {x}``, which carries residual mass ``M_{F+1} = sum_{y in T_{F+1}} max(p(y) - q_C(y), 0)``
    (x contributes 0); otherwise it is ``T_F``, with mass ``M_F``. Hence

        P_ns = A + (D_in * M_{F+1} + D_out * M_F) / Z,
        D_in = sum_{x in T_{F+1}} max(q_C(x) - p(x), 0),   D_out = Z - D_in.

    The sets ``T_j`` are piecewise constant in q (no gradient flows through the ranking); everything else is
    differentiable, and the cost is O(V) per position.

    Args:
        p, q: [..., V] target and draft distributions (after the same temperature/top-k/top-p).
        c: Saguaro's C in (0, 1]; fanout: F >= 0.

    Returns:
        [...] probabilities in [0, 1].
    """
    from ssd_eagle.verify import saguaro_scale

    q_c = saguaro_scale(q, c, fanout)
    order = q.detach().topk(min(fanout + 1, q.shape[-1]), dim=-1).indices
    in_top1 = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, order, True)  # T_{F+1}
    in_top = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, order[..., :fanout], True) if fanout > 0 \
        else torch.zeros_like(q, dtype=torch.bool)  # T_F
    accept = torch.minimum(p, q_c).sum(dim=-1)
    excess_p = (p - q_c).clamp(min=0.0)
    excess_q = (q_c - p).clamp(min=0.0)
    z = excess_p.sum(dim=-1)
    d_in = (excess_q * in_top1).sum(dim=-1)
    d_out = excess_q.sum(dim=-1) - d_in
    m_top1 = (excess_p * in_top1).sum(dim=-1)
    m_top = (excess_p * in_top).sum(dim=-1)
    covered = torch.where(z > 0, (d_in * m_top1 + d_out * m_top) / z.clamp(min=1e-30), torch.zeros_like(z))
    return accept + covered
