"""Time-sized builds of the speculation cache: the fan-out the speculator builds fits inside one verification.

SSD (Kumar, Dao, May 2026, Sec. 4) overlaps the build of the next speculation cache with the target's verification;
a build that runs longer than the verification makes the verifier wait for the next reply. The speculator therefore
measures

- the verifier's verification time: from sending a reply to the arrival of the next PROPOSE
  (:func:`ssd_eagle.ssd.worker.serve`),
- its own build cost: the fixed part (the forward over the proposal's nodes) and the cost of one branch-step (one
  tree-masked forward over all branches), modelled as ``a + b * n`` seconds for ``n`` branches (the padded
  ``rows * branches per row``) and fitted by exponentially weighted least squares,

and caps the branches it builds (best candidates kept first) with :func:`branch_cap`. A build that still runs when
the verifier's next outcome arrives stops at the next branch-step boundary (:class:`BuildStop`), the outcome is
answered at once and the unfinished branches are dropped, unless finishing is expected to answer sooner: with R
seconds of build left, p the hit rate after a finished build and B the backup's time, finishing waits
``R + (1 - p) B`` on average, stopping ``B`` (:meth:`BuildBudget.worth_finishing`). p is only measured after
finished builds, so the rule draws it from its posterior (Thompson sampling) instead of using its mean: with the mean
a drafter whose first builds missed had p near 0, never finished a build again and so never measured p again (a
draft LM whose step outlasts a verification hit 0.00). An in-process speculator's deadline stops the build
regardless.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable


class BuildInterrupted(Exception):
    """Raised by :meth:`BuildStop.check` at a branch-step boundary: the build stops there."""


@dataclass
class BuildStop:
    """When a build stops early; :meth:`check` runs before every draft forward of a build (chains and trees).

    Attributes:
        poll: returns True once the verifier's next message has arrived (the worker's link), or None.
        deadline: a ``time.perf_counter()`` value (seconds) past which the build stops, or None.
        finish: returns whether finishing the build beats stopping it now (asked only once ``poll`` fired).
    """

    poll: Callable[[], bool] | None = None
    deadline: float | None = None
    finish: Callable[[], bool] | None = None

    def due(self) -> bool:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return True
        return bool(self.poll is not None and self.poll()) and not (self.finish is not None and self.finish())

    def check(self) -> None:
        """Raises:
            BuildInterrupted: when the build is due to stop."""
        if self.due():
            raise BuildInterrupted


def branch_cap(budget_s: float, fixed_s: float, steps: float, forward_s: float, per_branch_s: float,
               margin: float = 0.8) -> int:
    """The most branches whose build fits in ``margin * budget_s`` seconds.

    A build costs ``fixed_s + steps * (forward_s + per_branch_s * n)`` for ``n`` branches: ``steps`` branch-step
    forwards (K for chains), each ``forward_s`` plus ``per_branch_s`` per branch.

    Returns:
        the largest ``n >= 0`` that fits (0: not even one branch fits; a huge number when branches cost nothing).

    Raises:
        ValueError: a negative time or step count, or a margin outside (0, 1].
    """
    if min(budget_s, fixed_s, steps, forward_s, per_branch_s) < 0:
        raise ValueError("branch_cap needs non-negative times and step counts")
    if not 0 < margin <= 1:
        raise ValueError(f"margin must lie in (0, 1], got {margin}")
    room = margin * budget_s - fixed_s - steps * forward_s
    if room < 0:
        return 0
    if steps == 0 or per_branch_s == 0:
        return 1 << 30
    return int(math.floor(room / (steps * per_branch_s) + 1e-9))


@dataclass
class BuildBudget:
    """Exponential moving averages of the verification time and of the build's costs (seconds, ``perf_counter``).

    Attributes:
        margin: the share of a verification the predicted build may fill.
        alpha: the weight of the newest observation.
        verify_s: the verification time (None until observed: no cap, e.g. an in-process speculator).
        probe_every: while not even one branch fits, every this many builds still build one branch per row (so
            that the costs stay measured and the cap comes back when verifications grow longer).

    The first build is not observed: it pays one-off warm-up costs (allocations, kernel selection).
    """

    margin: float = 0.8
    alpha: float = 0.2
    verify_s: float | None = None
    fixed_s: float = 0.0
    steps: float = 0.0
    _n: float = 0.0  # moments of (branches, seconds per forward)
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0
    _seen: bool = False
    probe_every: int = 8
    _builds: int = 0
    _capped_out: int = 0
    backup_s: float | None = None  # a neural backup's time (None: not measured)
    hit_prior: tuple[float, float] = (1.0, 1.0)  # Beta(a, b) on p, the hit rate after a finished build
    hit_memory: float = 50.0  # lookups the posterior of p remembers (older ones fade: p may drift)
    hits_after_full: float = 0.0  # lookups after a finished build, and their hits (faded)
    lookups_after_full: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # the draws of p (seeded: reproducible)

    def _ema(self, old: float, new: float) -> float:
        return new if not self._seen else old + self.alpha * (new - old)

    def observe_verify(self, seconds: float) -> None:
        self.verify_s = seconds if self.verify_s is None else self.verify_s + self.alpha * (seconds - self.verify_s)

    def observe_backup(self, seconds: float) -> None:
        self.backup_s = seconds if self.backup_s is None else self.backup_s + self.alpha * (seconds - self.backup_s)

    def observe_lookup(self, hit: bool) -> None:
        """A lookup after a finished build."""
        keep = 1.0 - 1.0 / self.hit_memory
        self.hits_after_full = keep * self.hits_after_full + hit
        self.lookups_after_full = keep * self.lookups_after_full + 1

    def hit_posterior(self) -> tuple[float, float]:
        """(a, b) of the Beta posterior of p: the prior plus the (faded) hits and misses after finished builds."""
        a, b = self.hit_prior
        return a + self.hits_after_full, b + self.lookups_after_full - self.hits_after_full

    def remaining_s(self, steps: float, branches: float | None = None, fixed: bool = False) -> float:
        """Predicted seconds of ``steps`` branch forwards over ``branches`` (default: the usual count), plus the
        fixed part when ``fixed``."""
        a, b = self.forward_cost()
        n = self._n if branches is None else branches
        return (self.fixed_s if fixed else 0.0) + steps * (a + b * n)

    def worth_finishing(self, remaining_s: float) -> bool:
        """Whether finishing a build with ``remaining_s`` seconds left is expected to answer the waiting outcome
        sooner than the backup now: ``R < p B`` (B: the backup's time), p drawn from :meth:`hit_posterior`
        (Thompson sampling, Thompson 1933): a well-measured p decides as its mean would, an uncertain one (few
        finished builds) still finishes now and then, which is how p gets measured at all.

        The prior Beta(1, 1) (uniform, the weight of two lookups) claims nothing about the drafter: the hit rates
        measured here run from 0.16 to 0.32 and the SSD paper reports 0.5 to 0.9. A fired poll asks once per
        branch-step boundary, so a build that is finished is asked again, with less left, at the next one.
        Until a build was measured (the first two) it finishes, as builds did before they could be stopped;
        without a measured backup it stops."""
        if not self._seen:
            return True
        if self.backup_s is None:
            return False
        return remaining_s < self.draw_hit_rate() * self.backup_s

    def draw_hit_rate(self) -> float:
        """One Thompson draw of p from :meth:`hit_posterior`."""
        return self.rng.betavariate(*self.hit_posterior())

    def ready(self) -> bool:
        """Whether a build was measured (before that, builds finish: :meth:`worth_finishing`)."""
        return self._seen

    def observe_build(self, fixed_s: float, branches: int, steps: int, branch_s: float, complete: bool = True) -> None:
        """One build: ``fixed_s`` before the branches, then ``steps`` forwards over ``branches`` in ``branch_s``.
        An interrupted build (``complete=False``) still measures the cost of a forward, not the steps a build takes."""
        self._builds += 1
        if steps <= 0 or branches <= 0 or self._builds == 1:
            return
        t = branch_s / steps
        if complete or not self._seen:
            self.steps = self._ema(self.steps, steps)
        self.fixed_s = self._ema(self.fixed_s, fixed_s)
        self._n, self._t = self._ema(self._n, branches), self._ema(self._t, t)
        self._nn, self._nt = self._ema(self._nn, branches * branches), self._ema(self._nt, branches * t)
        self._seen = True

    def forward_cost(self) -> tuple[float, float]:
        """(a, b) of the per-forward cost ``a + b * n`` seconds. Until two branch counts were seen it is taken
        proportional (a = 0: capping then tries fewer branches and so learns the slope); a fitted slope <= 0 means
        the cost does not depend on n (b = 0)."""
        if not self._seen:
            return 0.0, 0.0
        var = self._nn - self._n * self._n
        if var <= 1e-6 * self._nn:
            return 0.0, self._t / self._n
        b = (self._nt - self._n * self._t) / var
        if b <= 0:
            return self._t, 0.0
        return max(self._t - b * self._n, 0.0), b

    def chain_depth(self, max_steps: int, min_branches: int) -> int:
        """Branch-chain length L (1..``max_steps``, tokens = forwards per branch) for the next build: the longest
        whose build fits ``min_branches`` branches in the verification, else 1. ``max_steps`` until a verification
        and a build were measured. A draft LM whose step costs a fifth of a verification cannot build K = 5 tokens
        of even one branch in time (the proposal's forward comes first), so it builds shorter chains: a cached
        proposal of L < K tokens still saves the backup's whole draft on a hit."""
        if self.verify_s is None or not self._seen:
            return max_steps
        a, b = self.forward_cost()
        fits = [s for s in range(1, max_steps + 1)
                if branch_cap(self.verify_s, self.fixed_s, s, a, b, self.margin) >= min_branches]
        return max(fits, default=1)

    def cap(self, steps: float | None = None) -> int | None:
        """The branch cap for the next build of ``steps`` branch forwards (default: the measured steps of a
        build), or None (no cap) before a verification and a build were measured."""
        if self.verify_s is None or not self._seen:
            return None
        a, b = self.forward_cost()
        cap = branch_cap(self.verify_s, self.fixed_s, self.steps if steps is None else steps, a, b, self.margin)
        self._capped_out = self._capped_out + 1 if cap == 0 else 0
        return 1 if cap == 0 and self._capped_out % self.probe_every == 0 else cap
