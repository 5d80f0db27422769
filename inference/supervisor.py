"""Watching the SSD speculator from the server: a dead speculator process is noticed within ``interval`` seconds
(no round needed: :meth:`~ssd_eagle.ssd.client.SSDDrafter.probe` checks the process), a hung one (alive, no
heartbeat for ``speculator_heartbeat_timeout`` s, 3 by default) as soon as its link's watchdog declares it hung and
kills it (:class:`~ssd_eagle.ssd.client.RemoteSpeculator`; a propose blocked on it then fails over at once); either
is replaced in the background with exponential backoff.

While the speculator is down, decoding goes on without speculation (the engine's drafter is unhealthy, losing
nothing: output at T = 0 equals plain decoding). A fresh speculator is spawned off the engine thread (loading the
draft takes seconds) and adopted on it between two steps (:meth:`~inference.async_engine.AsyncEngine.call`):
requests already running finish without speculation, new ones speculate again. ``/health`` says ``degraded``
meanwhile; ``/metrics`` counts restarts (``speculator_restarts_total``) and failed attempts.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class SpeculatorSupervisor:
    """Probes the drafter every ``interval`` s and restarts a dead speculator, waiting ``backoff`` s before the
    first attempt, doubling after each failure up to ``max_backoff`` s.

    Args:
        async_engine: the :class:`~inference.async_engine.AsyncEngine` whose engine's drafter is watched.
        metrics: a :class:`~inference.metrics.ServerMetrics`, or None.
    """

    def __init__(self, async_engine, metrics=None, interval: float = 0.25, backoff: float = 1.0,
                 max_backoff: float = 60.0):
        self.async_engine, self.metrics = async_engine, metrics
        self.interval, self.backoff, self.max_backoff = interval, backoff, max_backoff
        self._task: asyncio.Task | None = None

    @property
    def drafter(self):
        return self.async_engine.engine.drafter

    def start(self) -> None:
        """Start watching (on the event loop); nothing to watch without a drafter that can be probed."""
        if callable(getattr(self.drafter, "probe", None)):
            self._task = asyncio.ensure_future(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        delay = self.backoff
        while True:
            await asyncio.sleep(self.interval)
            healthy = self.drafter.probe()
            if self.metrics is not None:
                self.metrics.drafter_healthy.set(1 if healthy else 0)
            if healthy or self.drafter.respawn is None or not self.async_engine.accepting:
                continue
            log.warning("speculator down; restarting it", extra={"fields": {
                "event": "speculator_restart", "error": self.drafter.error, "after_s": delay}})
            await asyncio.sleep(delay)
            if await self._restart():
                delay = self.backoff
            else:
                delay = min(2 * delay, self.max_backoff)

    def _adopt(self, speculator) -> None:  # (between two engine steps)
        self.drafter.adopt(speculator)
        if getattr(self.async_engine.engine, "planner", None) is not None:
            self.async_engine.engine.planner.new_drafter()

    async def _restart(self) -> bool:
        try:
            speculator = await asyncio.to_thread(self.drafter.respawn)
        except Exception as err:  # noqa: BLE001 - retried with a longer backoff
            log.error("restarting the speculator failed", exc_info=err,
                      extra={"fields": {"event": "speculator_restart_failed", "error": f"{type(err).__name__}: {err}"}})
            if self.metrics is not None:
                self.metrics.speculator_restart_failures.inc()
            return False
        await self.async_engine.call(self._adopt, speculator)
        if self.metrics is not None:
            self.metrics.speculator_restarts.inc()
            self.metrics.drafter_healthy.set(1)
        log.info("speculator restarted", extra={"fields": {"event": "speculator_restarted"}})
        return True
