"""``backup: auto``: the speculator's backup on a cache miss, chosen every round from measured costs (issue 13).

On a miss the verifier waits for the backup's draft, then verifies it. A round whose misses the backup b answers
takes ``W_b + V_b`` seconds (``W_b``: the backup's measured time; ``V_src``: the verification of proposals from
``src``, measured by the worker per source, since a proposal's length sets what its verification costs: an empty
n-gram proposal is a one-token step) and each of its rows emits on average ``E_src`` tokens, ``k + 1`` of the rounds
whose proposal came from that source (``hit``, ``neural`` or ``fast``), measured when the row's next outcome arrives.
The choice also decides the *next* lookup: the speculator builds the cache for the outcomes of the proposal being
verified, and a short n-gram proposal gets the whole budget on few outcome nodes, so the lookup after it hits more
often than after a K-token neural one. With ``h_src`` the measured share of hits among the lookups after proposals
from ``src``, a row whose misses b answers is a two-state Markov chain (hit -> hit with ``h_hit``, b -> hit with
``h_b``) that spends a share ``pi = h_b / (1 - h_hit + h_b)`` of its rounds on hits; a round of ``n`` rows waits
for b unless all of them hit (``pi^n``). Auto picks the higher long-run (renewal-reward) tokens per second

    argmax_b  n (pi E_hit + (1 - pi) E_b) / (pi^n V_hit + (1 - pi^n) (V_b + W_b))

and, until ``h_hit`` and ``h_b`` are measured, the round's own rate with ``h`` cached rows and ``m`` missed,
``(h E_hit + m E_b) / (W_b + V_b)``. Measured on a 2-core Xeon with AMX (2026-12-03; SmolLM2-135M, bf16,
EAGLE-3 head, K = 5, batch 1; ``scripts/bench_ssd.py``, old and new rule interleaved, 2 passes each): after the
lookup's proposals the next lookup hit 0.54 of the time, after the head's 0.28 (after a hit 0.42); the one-round
rule, blind to that and to ``V_fast`` (56 against 69 ms), kept the head's 21 ms backup for 46 of 47 misses at T = 1,
the long-run rule took the lookup for 98%: chains at T = 0.5 / 1 went from 1.12-1.25x / 1.06x AR to 1.33-1.42x /
1.18-1.34x, trees (``tree_budget: auto``) from 1.18-1.21x / 1.02-1.20x / 1.09-1.20x to 1.27-1.45x / 1.29-1.33x /
1.19-1.29x at T = 0 / 0.5 / 1; T = 0 chains and the draft LM kept their choices.

Three refinements (2026-12-03, later, same machine and bench, EAGLE-3 head run 7, old and new interleaved, 2 passes):

- ``E_hit`` depends on the proposal before the hit. At T = 0 the lookup mostly finds nothing, and after its empty
  proposal the whole budget went to one outcome, drafted from fresh target features: those hits emitted 1.6-2.1
  tokens, those after a hit 1.0-1.3. One ``E_hit`` made the lookup look 15-20% worse than it ran. Hits are counted
  per predecessor (``hit_tokens``); in the chain a share ``1 - h_hit`` of the hits comes right after b, so
  ``E_hit = (1 - h_hit) E_hit|b + h_hit E_hit|hit``.
- A source's tokens and next-hit share are shrunk toward the mean of all sources by ``prior_weight``
  pseudo-observations (:meth:`BackupChoice.shrunk`): a head seen twice, then one 6-token probe, no longer looks
  twice as good.
- Neural must beat the lookup by ``neural_margin`` (10%). Its drafts make the verifier wait, and its estimate rests
  on few rounds. Within 10% the two were a tie that flipped back and forth, each flip costing 13-15 ms per miss.

Before these, auto ran at 1.23-1.24x / 1.18-1.19x / 1.10-1.15x AR at T = 0 / 0.5 / 1, below the lookup alone
(1.29-1.33x / 1.40x / 1.27-1.30x). After: 1.31-1.37x / 1.46-1.48x / 1.18-1.25x, against 1.32-1.37x / 1.41-1.45x /
1.34-1.37x for the lookup. Trees (``tree_budget: auto``) went from 1.33-1.37x / 1.27-1.33x / 1.02-1.11x to
1.39-1.47x / 1.39-1.43x / 1.29-1.42x. The draft LM's geometric chain went from 1.20-1.28x / 1.29-1.33x / 1.12-1.18x
to 1.27-1.29x / 1.30-1.41x / 1.18-1.22x.

A neural backup whose K-step draft is a large share of V (a draft LM's chain: ~95 ms against a ~100 ms verification)
loses to the n-gram lookup (~1 ms) unless its drafts are accepted that much longer, and a cheap one (an EAGLE-3 head
on a slow target) keeps drafting. The estimates are faded means (the last ``token_memory`` rounds, ``time_memory``
calls), so the choice follows the drafter, the text and the batch as they change without flipping on one lucky round
(a round's k + 1 runs from 1 to K + 1); a backup's first call is not timed (one-off warm-up). Until both backups are
measured auto runs neural first (as before), then fast; afterwards the backup not chosen answers a *probe* round now
and then, so that its estimates stay current: ``probe_every`` miss rounds after the choice last changed, then twice
as long after every probe that did not change it, up to ``max_probe_every`` (a slow neural backup that keeps losing
costs one of its drafts per 128 misses). Without a measured V (an in-process speculator, or a speculator's first
round) auto keeps neural; from ``fast_batch`` rows up it picks fast whatever the costs (the paper's rule: a batch's
neural backup grows with the batch).

A build that the verifier's next outcome finds running weighs finishing against answering now with the chosen
backup (:meth:`BackupChoice.worth_finishing`) by the one-round tokens-per-second measure (one V for every source).

Limits: the chain treats a batch's rows as independent, and a round of mixed sources counts its verification
for each of them. Every proposal stays exactly as lossless as before: the choice only decides who drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKUPS = ("neural", "fast")
SOURCES = ("hit",) + BACKUPS


@dataclass
class BackupChoice:
    """Measured tokens and times per proposal source, and auto's choice of backup (see the module docstring).

    Attributes:
        fast_batch: rows from which auto picks fast whatever the costs.
        probe_every / max_probe_every: miss rounds from a change of choice to the first probe of the other backup /
            the longest interval between probes (doubled after every probe that left the choice as it was).
        token_memory / time_memory: observations the faded means of tokens / of times remember.
        prior_weight: pseudo-observations of the pooled mean (all sources) that :meth:`rate` folds into each
            source's tokens and next-hit share, so that a source seen a few times is judged close to the rest.
        neural_margin: the share by which the neural backup's rate must beat the lookup's for auto to pick it.
        tokens: per source, the mean emitted tokens (``k + 1``) of the rounds it answered (None: none seen).
        hit_tokens: per source, the mean emitted tokens of the hits that came right after its proposals (a hit after
            an empty lookup proposal was built for one outcome with the whole budget, from fresh target features).
        next_hit: per source, the share of the lookups after its proposals that hit (None: none seen).
        verify: per source, the mean verification time of its proposals, seconds (None: none measured).
        seconds: per backup, its mean time per call (None: not timed yet).
        chosen: miss rounds answered by each backup under auto (probes included).
    """

    fast_batch: int = 8
    probe_every: int = 16
    max_probe_every: int = 128
    token_memory: float = 50.0
    time_memory: float = 10.0
    prior_weight: float = 4.0
    neural_margin: float = 0.1
    tokens: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SOURCES))
    hit_tokens: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SOURCES))
    next_hit: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SOURCES))
    verify: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SOURCES))
    seconds: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(BACKUPS))
    chosen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BACKUPS, 0))
    _calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BACKUPS, 0))
    _interval: int = 0  # miss rounds between probes now (0: probe_every)
    _since: int = 0  # measured miss rounds since the last probe or change of choice
    _last: str | None = None  # the preferred backup of the last measured round
    _weights: dict[str, float] = field(default_factory=dict)  # faded observation counts, per estimate

    def _faded(self, kind: str, key: str, value: float, memory: float) -> None:
        """Fold ``value`` into the faded mean ``self.<kind>[key]`` (tokens, next_hit, verify or seconds), the plain mean
        while fewer than about ``memory`` values were seen."""
        name, estimates = f"{kind}:{key}", getattr(self, kind)
        weight = self._weights[name] = (1.0 - 1.0 / memory) * self._weights.get(name, 0.0) + 1.0
        old = estimates[key]
        estimates[key] = value if old is None else old + (value - old) / weight

    def observe_tokens(self, source: str, emitted: int, after: str | None = None) -> None:
        """A row whose proposal came from ``source`` emitted ``emitted`` tokens (k + 1) in its verification; a hit's
        count also goes to ``hit_tokens[after]`` (``after``: the source of the proposal before it, None: unknown)."""
        self._faded("tokens", source, emitted, self.token_memory)
        if source == "hit" and after is not None:
            self._faded("hit_tokens", after, emitted, self.token_memory)

    def observe_next_hit(self, source: str, hit: bool) -> None:
        """The lookup of the outcome of a proposal from ``source`` hit the speculation cache (or not)."""
        self._faded("next_hit", source, float(hit), self.token_memory)

    def observe_verify(self, sources: set[str], seconds: float) -> None:
        """A verification of a round whose proposals came from ``sources`` took ``seconds``."""
        for source in sources:
            self._faded("verify", source, seconds, self.time_memory)

    def observe_backup(self, backup: str, seconds: float) -> None:
        """One call of ``backup`` took ``seconds`` (the first call of each is warm-up: not timed)."""
        self._calls[backup] += 1
        if self._calls[backup] > 1:
            self._faded("seconds", backup, seconds, self.time_memory)

    def shrunk(self, kind: str, key: str) -> float | None:
        """``self.<kind>[key]`` (``tokens``, ``hit_tokens`` or ``next_hit``) with ``prior_weight`` pseudo-observations
        of the mean of all sources (weighted by their observation counts) folded in: a backup with 2 observations of
        6 tokens against a pooled 1.5 counts (2 * 6 + 4 * 1.5) / 6 = 3, not 6. Values set by hand (no observations)
        are returned as they are."""
        estimates = getattr(self, kind)
        weights = {s: self._weights.get(f"{kind}:{s}", 0.0) for s, v in estimates.items() if v is not None}
        total, own = sum(weights.values()), estimates[key]
        if own is None or total == 0.0 or self.prior_weight == 0.0:
            return own
        pooled = sum(w * estimates[s] for s, w in weights.items()) / total
        return (weights[key] * own + self.prior_weight * pooled) / (weights[key] + self.prior_weight)

    def measured(self, backup: str) -> bool:
        return self.tokens[backup] is not None and self.seconds[backup] is not None

    def rate(self, backup: str, verify_s: float, hits: int = 0, misses: int = 1) -> float:
        """Expected tokens per second of the rounds of ``hits + misses`` rows whose misses ``backup`` answers: the
        long run once the next-hit shares of hits and of ``backup`` are measured, else this round (``hits`` cached
        rows, ``misses`` rows ``backup`` answers); a source's verification time defaults to ``verify_s``. See the
        module docstring."""
        e_hit, e_b, w_b = self.shrunk("tokens", "hit") or 0.0, self.shrunk("tokens", backup), self.seconds[backup]
        v_hit, v_b = (verify_s if self.verify[s] is None else self.verify[s] for s in ("hit", backup))
        h_hit, h_b = self.shrunk("next_hit", "hit"), self.shrunk("next_hit", backup)
        if h_hit is None or h_b is None:
            return (hits * e_hit + misses * e_b) / (w_b + v_b)
        rows = hits + misses
        pi = h_b / (1.0 - h_hit + h_b) if h_b > 0 else 0.0
        all_hit = pi ** rows
        after_b, after_hit = (e_hit if (e := self.shrunk("hit_tokens", s)) is None else e for s in (backup, "hit"))
        e_hit = (1.0 - h_hit) * after_b + h_hit * after_hit  # a share 1 - h_hit of the hits come right after b
        return rows * (pi * e_hit + (1.0 - pi) * e_b) / (all_hit * v_hit + (1.0 - all_hit) * (v_b + w_b))

    def preferred(self, verify_s: float | None, hits: int = 0, misses: int = 1) -> str:
        """The backup auto would pick for such a round, without probing: fast from ``fast_batch`` rows up, neural
        without a measured V, the unmeasured one (neural first) until both are measured, then neural only where its
        rate beats the lookup's by ``neural_margin``."""
        if hits + misses >= self.fast_batch:
            return "fast"
        if verify_s is None:
            return "neural"
        if not all(map(self.measured, BACKUPS)):
            return "neural" if not self.measured("neural") else "fast"
        neural, fast = (self.rate(b, verify_s, hits, misses) for b in BACKUPS)
        return "neural" if neural > (1.0 + self.neural_margin) * fast else "fast"

    def choose(self, verify_s: float | None, hits: int, misses: int) -> str:
        """The backup for a round of ``hits + misses`` rows, ``misses`` of them missed: :meth:`preferred`, or the
        other one on a probe round (counted in ``chosen``)."""
        backup = self.preferred(verify_s, hits, misses)
        if hits + misses < self.fast_batch and verify_s is not None and all(map(self.measured, BACKUPS)):
            if backup != self._last:  # the choice changed: probe soon again
                self._last, self._since, self._interval = backup, 0, self.probe_every
            self._since += 1
            if self._since >= self._interval:
                backup = BACKUPS[1 - BACKUPS.index(backup)]
                self._since, self._interval = 0, min(2 * self._interval, self.max_probe_every)
        self.chosen[backup] += 1
        return backup

    def worth_finishing(self, remaining_s: float, verify_s: float | None, hit_rate: float,
                        rows: int = 1) -> bool | None:
        """Whether finishing a build of ``rows`` rows with ``remaining_s`` seconds left beats answering the waiting
        outcome now with the backup b auto would pick, in expected tokens per second of a row's round:

            (p E_hit + (1 - p) E_b) / (R + (1 - p) W_b + V)   against   E_b / (W_b + V)

        (``p = hit_rate``: a finished build hits with probability p; a miss still waits for b). With equal tokens
        it is :meth:`BuildBudget.worth_finishing <ssd_eagle.ssd.budget.BuildBudget.worth_finishing>`'s
        ``R < p W_b``. None while V, ``E_hit`` or b is not measured (the caller then decides by time alone)."""
        backup = self.preferred(verify_s, 0, rows)
        if verify_s is None or self.tokens["hit"] is None or not self.measured(backup):
            return None
        e_hit, e_b, w_b = self.shrunk("tokens", "hit"), self.shrunk("tokens", backup), self.seconds[backup]
        finish = (hit_rate * e_hit + (1 - hit_rate) * e_b) / (remaining_s + (1 - hit_rate) * w_b + verify_s)
        return finish > e_b / (w_b + verify_s)

    def summary(self) -> dict:
        """JSON-ready: the estimates (tokens per round, next-hit shares and verification milliseconds per source,
        milliseconds per backup call) and the miss rounds per backup."""
        return {"tokens": {s: None if t is None else round(t, 3) for s, t in self.tokens.items()},
                "hit_tokens_after": {s: None if t is None else round(t, 3) for s, t in self.hit_tokens.items()},
                "next_hit": {s: None if h is None else round(h, 3) for s, h in self.next_hit.items()},
                "verify_ms": {s: None if t is None else round(1e3 * t, 3) for s, t in self.verify.items()},
                "ms": {b: None if t is None else round(1e3 * t, 3) for b, t in self.seconds.items()},
                "chosen": dict(self.chosen)}


def worth_finishing(budget, choice: BackupChoice | None, remaining_s: float, rows: int) -> bool:
    """Finish the running build of ``rows`` rows (``remaining_s`` left) for the outcome that arrived? Under auto
    (``choice`` given), by expected tokens/s against the backup auto would pick (:meth:`BackupChoice.worth_finishing`)
    once a build and that backup are measured; otherwise by time alone (``budget``: a
    :class:`~ssd_eagle.ssd.budget.BuildBudget`, :meth:`~ssd_eagle.ssd.budget.BuildBudget.worth_finishing`)."""
    if choice is not None and budget.ready():
        finish = choice.worth_finishing(remaining_s, budget.verify_s, budget.draw_hit_rate(), rows)
        if finish is not None:
            return finish
    return budget.worth_finishing(remaining_s)

