"""The planner's decisions as the server shows them: per request in ``spec_stats`` (responses and the final stream
chunk), over all requests in ``/metrics`` (see :mod:`inference.metrics`)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from _server_helpers import make_engine, parse_sse
from inference.api_server import build_app
from ssd_eagle.planner import CostTable, Planner, PlannerConfig

K = 3  # the test engine's draft length (n-gram drafting on a target whose greedy output cycles)


def _metric(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus text exposition, read with prometheus_client's own parser."""
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels} not in /metrics"
    return found[0]


def planned_engine(verify: list[float]):
    engine = make_engine()
    engine.planner = Planner(PlannerConfig(max_k=K, probe_every=4, learn_costs=False, probe_overhead=1.0),
                             CostTable({1: verify}))  # probing as often as the backoff allows
    return engine


def test_spec_stats_and_metrics_count_rounds_without_speculation_and_probes():
    """A verification that costs its width in full: the planner never speculates; it probes after 4, 8, 16 rounds."""
    with TestClient(build_app(planned_engine([1.0, 3.0, 5.0, 7.0]), "tiny")) as client:
        stats = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 30,
                                                     "temperature": 0}).json()["spec_stats"]
        events = parse_sse(client.post("/v1/completions", json={"prompt": "He", "max_tokens": 20, "stream": True,
                                                                "temperature": 0}).text)
        text = client.get("/metrics").text
    streamed = events[-2]["spec_stats"]  # the final chunk, before [DONE]
    for s in (stats, streamed):
        per_k = {int(k): v for k, v in s["planned_rounds_per_k"].items()}
        assert set(per_k) == {0, 2} and sum(per_k.values()) == s["rounds"]  # plain rounds and probes of 2
        assert s["rounds_without_speculation"] == per_k[0] and s["probes"] == per_k[2] >= 2
    p = "ssd_eagle_"
    rounds = stats["rounds"] + streamed["rounds"]
    plain = stats["rounds_without_speculation"] + streamed["rounds_without_speculation"]
    assert _metric(text, p + "spec_planned_draft_length_count") == rounds
    assert _metric(text, p + "spec_planned_draft_length_bucket", le="0.0") == plain
    assert _metric(text, p + "spec_planned_draft_length_bucket", le="2.0") == rounds
    assert _metric(text, p + "spec_rounds_without_speculation_total") == plain
    assert _metric(text, p + "spec_probes_total") == stats["probes"] + streamed["probes"]


def test_metrics_histogram_of_the_chosen_k_when_drafts_pay():
    """A flat verification and drafts that are always right: the planner drafts K, no round goes without."""
    with TestClient(build_app(planned_engine([1.0] * 4), "tiny")) as client:
        stats = client.post("/v1/completions", json={"prompt": "Hey é€漢😀!Hey", "max_tokens": 40,
                                                     "temperature": 0}).json()["spec_stats"]
        text = client.get("/metrics").text
    assert stats["planned_rounds_per_k"] == {str(K): stats["rounds"]} and stats["rounds_without_speculation"] == 0
    p = "ssd_eagle_"
    assert _metric(text, p + "spec_planned_draft_length_bucket", le=f"{K - 1}.0") == 0
    assert _metric(text, p + "spec_planned_draft_length_bucket", le=f"{K}.0") == stats["rounds"]
    assert _metric(text, p + "spec_planned_draft_length_sum") == K * stats["rounds"]
    assert _metric(text, p + "spec_rounds_without_speculation_total") == 0
    assert _metric(text, p + "spec_probes_total") == 0
    assert _metric(text, p + "spec_planned_tree_rounds_total") == stats["planned_tree_rounds"] == 0  # (n-gram chains)


def test_metrics_count_the_rounds_planned_as_trees():
    """The engine's totals as a tree drafter's planner leaves them: tree rounds counted once, as they grow."""
    from inference.metrics import ServerMetrics
    from ssd_eagle.stats import SpecStats

    metrics, totals = ServerMetrics(), SpecStats()
    for k, tree in ((3, True), (3, True), (2, False), (0, False), (3, True)):
        totals.record_plan(k, probe=False, tree=tree)
        metrics.observe_step(totals, 1, True)
    text = generate_latest(metrics.registry).decode()
    assert _metric(text, "ssd_eagle_spec_planned_tree_rounds_total") == totals.planned_trees == 3
    assert totals.summary()["planned_tree_rounds"] == 3
