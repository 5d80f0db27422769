"""What crosses the speculator's boundary each round: the verifier's outcome rows (:class:`SpecRequest`, carried by
PROPOSE) and the speculator's lookup and build statistics (:class:`SpeculatorStats`, carried by STATS); see
:mod:`ssd_eagle.ssd.protocol` for their layouts and :mod:`ssd_eagle.ssd.speculator` for the rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpecRequest:
    """One row of a propose call (what the verifier sends).

    Attributes:
        slot: the sequence's slot.
        num_accepted: k of the verifier's last round, or -1 for the first round after ``add`` (no lookup).
        bonus: the bonus token of that round (ignored when ``num_accepted == -1``).
        budget: most tokens the proposal may emit (chain length, or tree depth).
        aux: float [k + 1, 3 * H_target], aux states of the verified inputs now committed (EAGLE-3), else None.
        accepted: the k accepted tokens (needed for trees; for chains they are the proposal's first k).
        rounds: the verification rounds this outcome spans. Rounds the verifier's planner ran without speculation
            send nothing; their outcomes are merged into the next request's (``accepted``: every token committed
            since the last request but the last, which is ``bonus``; ``aux`` covers them all). A merged outcome
            (``rounds > 1``) is no lookup.
    """

    slot: int
    num_accepted: int
    bonus: int
    budget: int
    aux: torch.Tensor | None = None
    accepted: list[int] | None = None
    rounds: int = 1

    def merged(self, later: SpecRequest) -> SpecRequest:
        """This outcome followed by ``later``'s (the next round's), as one (``budget`` is ``later``'s).

        Raises:
            ValueError: a first-round row (``num_accepted == -1``) as ``later``."""
        if later.num_accepted < 0:
            raise ValueError("a later outcome needs num_accepted >= 0")
        if self.num_accepted < 0:
            return later
        accepted = list(self.accepted or []) + [self.bonus] + list(later.accepted or [])
        aux = None if self.aux is None else torch.cat([self.aux, later.aux])
        return SpecRequest(self.slot, len(accepted), later.bonus, later.budget, aux, accepted,
                           self.rounds + later.rounds)


@dataclass
class SpeculatorStats:
    """What the speculator measured: lookups, hits, builds, the rank of every true bonus among the candidates
    at its node (-1: not among them; the fan-out fitter's input), and the time spent building (seconds).

    Attributes:
        interrupted: builds stopped early by the verifier's next outcome (or a deadline); their unfinished branches
            were dropped.
        fanout_power: r fitted online (``fanout_power: "auto"``), None before the first fit or when r is fixed.
        backup: the backup choice's measurements (:meth:`BackupChoice.summary
            <ssd_eagle.ssd.backup.BackupChoice.summary>`: tokens per round, next-hit shares and verification ms per
            proposal source, ms per backup call, miss rounds per backup), filled where the statistics are read
            (``stats()`` of the speculator clients); None in the speculator's own running copy.
    """

    lookups: int = 0
    hits: int = 0
    bonus_ranks: list[int] = field(default_factory=list)
    build_time: float = 0.0
    builds: int = 0
    backup_forwards: int = 0  # draft forwards run while the verifier waited (misses)
    interrupted: int = 0
    fanout_power: float | None = None
    backup: dict | None = None
