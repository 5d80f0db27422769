"""Prometheus metrics of the server, kept in a registry of their own (one per app, no process-global state).

Names carry the ``ssd_eagle_`` prefix; speculative-decoding terms (tau, cache hit rate ...) are those of
:mod:`ssd_eagle.stats`. Times are seconds. Thread-safe: the engine thread records steps, the event loop records
requests.

- ``requests_total{endpoint, outcome}`` (counter): completion requests by outcome: ``stop``, ``length``,
  ``aborted`` (the client went away), ``error`` (500), or the HTTP status of a refusal (``400``, ``503`` ...).
- ``prompt_tokens_total`` / ``generation_tokens_total`` (counters): prompt tokens of finished requests; tokens
  generated (counted every engine step, so aborted requests count what they produced).
- ``generation_tokens_per_second`` (gauge): generated tokens/s over the last ``rate_window`` seconds.
- ``spec_rounds_total``, ``spec_drafted_tokens_total``, ``spec_accepted_tokens_total``,
  ``spec_emitted_tokens_total`` (counters): their rate ratios give tau and the acceptance rate over any window.
- ``spec_tau``, ``spec_acceptance_rate``, ``spec_cache_hit_rate`` (gauges): since start (hit rate NaN when the
  drafter does no cache lookups).
- ``spec_planned_draft_length`` (histogram, integer buckets): the draft length the planner (:mod:`ssd_eagle.planner`)
  gave each request's round, 0 (plain decoding) included; ``spec_rounds_without_speculation_total``,
  ``spec_planned_tree_rounds_total`` and ``spec_probes_total`` (counters): request rounds planned at 0, those given
  the drafter's tree (the rest drafted chains), and the probes of requests whose speculation was off. All four stay
  at 0 without a planner.
- ``queue_depth`` (gauge): requests accepted but not yet decoding; ``running_requests`` (gauge): decoding.
- ``kv_cache_usage_bytes`` (gauge): bytes the target's KV store, the drafts' stores (as reserved for the live
  requests, the SSD speculator's included) and the prefix cache hold, after the latest step;
  ``kv_cache_budget_bytes`` (gauge): the ``kv_cache_memory`` budget (NaN: unbounded).
- ``drafter_healthy`` (gauge): 1, or 0 while the drafter reports unhealthy; ``engine_step_errors_total``;
  ``speculator_restarts_total`` and ``speculator_restart_failures_total`` (:mod:`inference.supervisor`).
- ``time_to_first_token_seconds``, ``e2e_request_latency_seconds``, ``time_per_output_token_seconds``
  (histograms): from the request's arrival at the server.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ssd_eagle.stats import SpecStats

PREFIX = "ssd_eagle_"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_DRAFT_LENGTH_BUCKETS = tuple(range(9)) + (12, 16, 24, 32)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TokenRate:
    """Tokens per second over a sliding window of ``window`` seconds (thread-safe)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def record(self, num_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, num_tokens))
            self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()


class ServerMetrics:
    """All metrics of one server. ``render()`` returns the Prometheus text exposition and its content type."""

    def __init__(self, registry: CollectorRegistry | None = None, rate_window: float = 10.0):
        self.registry = registry or CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests = Counter(p + "requests", "Completion requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.token_rate = TokenRate(rate_window)
        Gauge(p + "generation_tokens_per_second", f"Generated tokens per second over the last {rate_window:g} s",
              registry=r).set_function(self.token_rate.rate)
        self.spec_rounds = Counter(p + "spec_rounds", "Verification rounds", registry=r)
        self.spec_drafted = Counter(p + "spec_drafted_tokens", "Draft tokens proposed to the target", registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.spec_emitted = Counter(p + "spec_emitted_tokens", "Tokens emitted by rounds", registry=r)
        self.tau = Gauge(p + "spec_tau", "Acceptance length tau (mean emitted tokens per round) since start",
                         registry=r)
        self.acceptance_rate = Gauge(p + "spec_acceptance_rate", "Per-token acceptance rate since start", registry=r)
        self.cache_hit_rate = Gauge(p + "spec_cache_hit_rate", "Speculation cache hit rate since start (NaN: none)",
                                    registry=r)
        self.cache_hit_rate.set(math.nan)
        self.planned_k = Histogram(p + "spec_planned_draft_length", "Draft length the planner gave a request's round "
                                   "(0: plain decoding)", buckets=_DRAFT_LENGTH_BUCKETS, registry=r)
        self.rounds_without_speculation = Counter(p + "spec_rounds_without_speculation",
                                                  "Request rounds the planner ran without drafting", registry=r)
        self.planned_trees = Counter(p + "spec_planned_tree_rounds", "Request rounds the planner gave a tree "
                                     "(the others that drafted: chains)", registry=r)
        self.probes = Counter(p + "spec_probes", "Probes of requests whose speculation the planner had switched off",
                              registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests accepted but not yet decoding", registry=r)
        self.running = Gauge(p + "running_requests", "Requests being decoded", registry=r)
        self.drafter_healthy = Gauge(p + "drafter_healthy", "1 while the drafter is healthy, else 0", registry=r)
        self.drafter_healthy.set(1)
        self.kv_usage = Gauge(p + "kv_cache_usage_bytes",
                              "Bytes held by the target's and the drafts' KV stores and the prefix cache", registry=r)
        self.kv_budget = Gauge(p + "kv_cache_budget_bytes", "The KV cache budget in bytes (NaN: unbounded)",
                               registry=r)
        self.kv_budget.set(math.nan)
        self.speculator_restarts = Counter(p + "speculator_restarts", "SSD speculators replaced after a crash",
                                           registry=r)
        self.speculator_restart_failures = Counter(p + "speculator_restart_failures",
                                                   "Failed attempts to replace a crashed SSD speculator", registry=r)
        self.step_errors = Counter(p + "engine_step_errors", "Engine steps that raised", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(p + "e2e_request_latency_seconds", "Request arrival to last token",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self._seen = SpecStats()  # engine totals already counted (engine thread only)

    # engine thread
    def observe_step(self, engine_stats: SpecStats, num_tokens: int, drafter_healthy: bool) -> None:
        """Record one engine step: ``num_tokens`` generated, the engine's aggregate ``SpecStats``."""
        self.generation_tokens.inc(num_tokens)
        self.token_rate.record(num_tokens)
        seen = self._seen
        for counter, total, name in ((self.spec_rounds, engine_stats.num_rounds, "num_rounds"),
                                     (self.spec_drafted, engine_stats.num_drafted, "num_drafted"),
                                     (self.spec_accepted, engine_stats.num_accepted, "num_accepted"),
                                     (self.spec_emitted, engine_stats.num_emitted, "num_emitted")):
            delta = total - getattr(seen, name)
            if delta > 0:
                counter.inc(delta)
                setattr(seen, name, total)
        for k, total in engine_stats.planned_k.items():
            delta = total - seen.planned_k.get(k, 0)
            for _ in range(delta):
                self.planned_k.observe(k)
            if k == 0 and delta > 0:
                self.rounds_without_speculation.inc(delta)
            seen.planned_k[k] = total
        if engine_stats.planned_trees > seen.planned_trees:
            self.planned_trees.inc(engine_stats.planned_trees - seen.planned_trees)
            seen.planned_trees = engine_stats.planned_trees
        if engine_stats.num_probes > seen.num_probes:
            self.probes.inc(engine_stats.num_probes - seen.num_probes)
            seen.num_probes = engine_stats.num_probes
        self.tau.set(engine_stats.tau)
        self.acceptance_rate.set(engine_stats.acceptance_rate)
        hit_rate = engine_stats.cache_hit_rate
        self.cache_hit_rate.set(math.nan if hit_rate is None else hit_rate)
        self.drafter_healthy.set(1 if drafter_healthy else 0)

    # event loop
    def observe_request(self, endpoint: str, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                        latency: float | None = None, ttft: float | None = None) -> None:
        """Record a finished (or refused) request. ``latency``/``ttft`` in seconds, None when not applicable."""
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if latency is not None:
            self.e2e_latency.observe(latency)
            if ttft is not None and completion_tokens > 1:
                self.tpot.observe((latency - ttft) / (completion_tokens - 1))

    def set_kv_usage(self, used: int, budget: int | None) -> None:
        self.kv_usage.set(used)
        self.kv_budget.set(math.nan if budget is None else budget)

    def set_queue(self, queued: int, running: int) -> None:
        self.queue_depth.set(queued)
        self.running.set(running)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
