"""The vocabulary of speculative decoding, and the statistics kept in its terms.

This docstring is the one definition of these terms for the whole project: code, logs, benchmark tables and
the server's responses use them exactly as written here.

- **target**: the model whose output we must reproduce (the verifier). **draft**: the cheap proposer (an n-gram
  lookup, a small causal LM, or an EAGLE-3 head). **drafter**: the object that runs a draft for the engine.
- **round**: one verification: the target runs one forward over ``[last token, d_1 .. d_K]`` and decides how many
  of the K draft tokens to keep. Prefill is not a round. In autoregressive mode (K = 0) every decode step is a round.
- **accepted length k**: the number of draft tokens the target accepts in a round, ``0 <= k <= K``.
- **bonus token**: the one token the target itself emits after the accepted ones (its argmax at T=0, otherwise a
  sample from p after full acceptance, or from the residual ``norm(max(p - q, 0))`` after a rejection). A round
  therefore produces ``k + 1`` tokens.
- **acceptance length tau**: the mean over rounds of ``k + 1``, counting only tokens that were emitted: when
  ``max_tokens``, an EOS token or a stop string cuts a round short, that round counts the tokens it actually emitted.
  Autoregressive decoding has tau = 1.
- **acceptance rate a**: per draft token, accepted / proposed (in rounds that proposed at least one token).
- **cache hit rate** (SSD): hits / lookups of the speculation cache, where a lookup is a round whose outcome
  ``(k, bonus)`` was looked up; rounds without a lookup (the first round of a request, rounds after a fallback) are
  not counted.
- **fan-out F_k**: the number of bonus-token candidates the speculator pre-drafts for outcome "k accepted".
- **speculation cache**: the speculator's map ``(sequence, k, bonus) -> next draft`` built while the target verifies.
- **aux hidden states**: the target's residual stream at the input of three layers (low, mid, high) that feed an
  EAGLE-3 head.

Timing fields are seconds (float, ``time.perf_counter`` differences).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters of one request (or, after :meth:`merge`, of many).

    Attributes:
        num_rounds: rounds run (see module docstring).
        num_emitted: tokens emitted by rounds (excludes the token sampled at prefill).
        num_drafted: draft tokens proposed to the target.
        num_accepted: draft tokens accepted by the target (before any cut by stop conditions).
        accepted_lengths: k of every round, in order.
        cache_lookups / cache_hits: SSD speculation cache lookups and hits.
        hits_per_k / lookups_per_k: the same split by the looked-up accepted length k.
        wait_on_hit / wait_on_miss: seconds the verifier waited for its drafts in rounds whose lookup hit / missed
            (per row: a batch's wait counts once for each of its rows); means per round in :meth:`summary`.
        verify_time: seconds spent in target forwards + verification.
        draft_time: seconds the verifier spent obtaining drafts (drafting, or waiting for the speculator).
        prefill_time: seconds spent in prefill.
        planned_k: rounds per draft length the planner (:mod:`ssd_eagle.planner`) gave the request, K = 0 (plain
            decoding) included, probes under their probe length; empty without a planner.
        num_probes: rounds in which a request the planner had switched off drafted a short probe.
        planned_trees: rounds in which the planner gave the request its drafter's tree (of those in ``planned_k``
            with K > 0; the others drafted chains).
        planned_tree_nodes: the same per tree size (``{nodes: rounds}``: the whole tree or its best nodes).
        fanout_built: branches the speculation cache held at the lookups (the fan-out actually built, summed).
        fanout_power: the speculator's fitted r at the last lookup (``fanout_power: "auto"``; None before its fit).
        rounds_on_fast_backup: rounds on a miss whose drafts the fast (n-gram) backup made (``backup: fast``, or
            ``auto``'s choice: :mod:`ssd_eagle.ssd.backup`); the other misses' the neural backup.
    """

    num_rounds: int = 0
    num_emitted: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    cache_lookups: int = 0
    cache_hits: int = 0
    lookups_per_k: dict[int, int] = field(default_factory=dict)
    hits_per_k: dict[int, int] = field(default_factory=dict)
    emitted_on_hit: int = 0
    rounds_on_hit: int = 0
    emitted_on_miss: int = 0
    rounds_on_miss: int = 0
    wait_on_hit: float = 0.0
    wait_on_miss: float = 0.0
    verify_time: float = 0.0
    draft_time: float = 0.0
    prefill_time: float = 0.0
    planned_k: dict[int, int] = field(default_factory=dict)
    num_probes: int = 0
    planned_trees: int = 0
    planned_tree_nodes: dict[int, int] = field(default_factory=dict)
    fanout_built: int = 0
    fanout_power: float | None = None
    rounds_on_fast_backup: int = 0

    def record_plan(self, k: int, probe: bool, tree: int = 0) -> None:
        """Record the planner's draft length ``k`` for one request's round (``probe``: a probe of a request whose
        speculation was off; ``tree``: the round drafts a tree of depth ``k`` and this many nodes, 0: a chain)."""
        self.planned_k[k] = self.planned_k.get(k, 0) + 1
        self.num_probes += probe
        if tree:
            self.planned_trees += 1
            self.planned_tree_nodes[tree] = self.planned_tree_nodes.get(tree, 0) + 1

    def record_round(self, num_drafted: int, num_accepted: int, num_emitted: int) -> None:
        """Record one round: ``num_drafted`` proposed, ``num_accepted`` accepted (k), ``num_emitted`` emitted."""
        self.num_rounds += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_emitted
        self.accepted_lengths.append(num_accepted)

    def record_lookup(self, k: int, hit: bool, num_emitted: int, wait: float = 0.0, fanout: int | None = None,
                      fanout_power: float | None = None, backup: str | None = None) -> None:
        """Record one speculation cache lookup for accepted length ``k``, the tokens the round then emitted, the
        seconds the verifier waited for the round's drafts, the branches the cache held, the fitted r and, on a
        miss, the backup that drafted (``neural`` or ``fast``)."""
        self.cache_lookups += 1
        self.fanout_built += fanout or 0
        if fanout_power is not None:
            self.fanout_power = fanout_power
        self.lookups_per_k[k] = self.lookups_per_k.get(k, 0) + 1
        if hit:
            self.cache_hits += 1
            self.hits_per_k[k] = self.hits_per_k.get(k, 0) + 1
            self.emitted_on_hit += num_emitted
            self.rounds_on_hit += 1
            self.wait_on_hit += wait
        else:
            self.wait_on_miss += wait
            self.emitted_on_miss += num_emitted
            self.rounds_on_miss += 1
            self.rounds_on_fast_backup += backup == "fast"

    @property
    def tau(self) -> float:
        """Acceptance length: mean emitted tokens per round (0.0 before the first round)."""
        return self.num_emitted / self.num_rounds if self.num_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance rate a (0.0 when nothing was drafted)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def cache_hit_rate(self) -> float | None:
        """Speculation cache hits / lookups, or None when there was no lookup."""
        return self.cache_hits / self.cache_lookups if self.cache_lookups else None

    @property
    def tau_on_hit(self) -> float | None:
        return self.emitted_on_hit / self.rounds_on_hit if self.rounds_on_hit else None

    @property
    def tau_on_miss(self) -> float | None:
        return self.emitted_on_miss / self.rounds_on_miss if self.rounds_on_miss else None

    def merge(self, other: SpecStats) -> SpecStats:
        """Add ``other``'s counters into this one (in place) and return self."""
        for name in ("num_rounds", "num_emitted", "num_drafted", "num_accepted", "cache_lookups", "cache_hits",
                     "emitted_on_hit", "rounds_on_hit", "emitted_on_miss", "rounds_on_miss", "wait_on_hit",
                     "wait_on_miss", "verify_time", "draft_time", "prefill_time", "num_probes", "planned_trees",
                     "fanout_built", "rounds_on_fast_backup"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.fanout_power is not None:
            self.fanout_power = other.fanout_power
        self.accepted_lengths.extend(other.accepted_lengths)
        for mine, theirs in ((self.lookups_per_k, other.lookups_per_k), (self.hits_per_k, other.hits_per_k),
                             (self.planned_k, other.planned_k),
                             (self.planned_tree_nodes, other.planned_tree_nodes)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        return self

    def summary(self) -> dict:
        """A JSON-ready dict of the headline figures (the server's ``spec_stats`` field). With a planner it adds
        ``planned_rounds_per_k`` (``{K: rounds}``, K = 0 included), ``rounds_without_speculation`` (rounds at K = 0),
        ``probes``, ``planned_tree_rounds`` (rounds that drafted a tree) and ``planned_tree_nodes`` (``{nodes:
        rounds}``, when a tree was drafted); with speculation cache lookups, the hit
        rates and the verifier's mean wait per round on hits and on misses in milliseconds (``wait_on_hit_ms``,
        ``wait_on_miss_ms``; None without such rounds), the misses the fast backup answered
        (``rounds_on_fast_backup``, of ``rounds_on_miss``), the branches the cache
        held per lookup (``fanout_per_lookup``) and the fitted r (``fanout_power``, None unless
        ``fanout_power: "auto"`` has fitted it)."""
        out = {
            "rounds": self.num_rounds,
            "emitted_tokens": self.num_emitted,
            "drafted_tokens": self.num_drafted,
            "accepted_tokens": self.num_accepted,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
        }
        if self.cache_lookups:
            out["cache_hit_rate"] = round(self.cache_hits / self.cache_lookups, 4)
            out["cache_lookups"] = self.cache_lookups
            out["fanout_per_lookup"] = round(self.fanout_built / self.cache_lookups, 2)
            out["fanout_power"] = None if self.fanout_power is None else round(self.fanout_power, 4)
            out["cache_hit_rate_per_k"] = {
                k: round(self.hits_per_k.get(k, 0) / n, 4) for k, n in sorted(self.lookups_per_k.items())
            }
            for name, wait, rounds in (("hit", self.wait_on_hit, self.rounds_on_hit),
                                       ("miss", self.wait_on_miss, self.rounds_on_miss)):
                out[f"rounds_on_{name}"] = rounds
                out[f"wait_on_{name}_ms"] = round(1e3 * wait / rounds, 3) if rounds else None
            out["rounds_on_fast_backup"] = self.rounds_on_fast_backup
        if self.planned_k:
            out["planned_rounds_per_k"] = dict(sorted(self.planned_k.items()))
            out["rounds_without_speculation"] = self.planned_k.get(0, 0)
            out["probes"] = self.num_probes
            out["planned_tree_rounds"] = self.planned_trees
            if self.planned_tree_nodes:
                out["planned_tree_nodes"] = dict(sorted(self.planned_tree_nodes.items()))
        return out
