"""scripts/load_test.py's reporting: the inter-chunk gaps leave the long prompts out, TTFT is split into first and
later turns, the speculator is found among the server's children, and long prompts share no prefix."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load_test.py"
_spec = importlib.util.spec_from_file_location("load_test", SCRIPT)
load_test = importlib.util.module_from_spec(_spec)
sys.modules["load_test"] = load_test  # dataclasses resolve their module
_spec.loader.exec_module(load_test)


def _args(**kw) -> Namespace:
    return Namespace(**{"mix": "long-prompt", "clients": 2, "duration": 1.0, "endpoint": "chat", "max_tokens": 8,
                        **kw})


def test_gaps_leave_the_long_prompts_out_and_ttft_is_split_by_turn():
    R = load_test.Result
    results = [R(True, 1.0, 0.1, 8, kind="short", gaps=[0.05, 0.05, 0.05, 0.25]),
               R(True, 1.0, 0.2, 8, kind="later", gaps=[0.1, 0.1, 0.1]),
               R(True, 9.0, 0.4, 8, kind="first", gaps=[0.1, 0.1, 0.1]),
               R(True, 9.0, 8.0, 8, kind="long", gaps=[5.0, 5.0, 5.0, 9.0]),  # the one that waited: left out
               R(False, 0.5, error="HTTP 503")]
    phase = load_test.Phase(results, 0.0, 10.0)
    memory = {"server": 100.0, "speculator": 50.0, "total": 150.0}
    summary = load_test.summarize(phase, memory, {**memory, "total": 165.0}, 170.0, _args())
    assert summary["inter_chunk_gap"] == {"streams": 3, "longest_ms": 250.0, "median_ms": 100.0,
                                          "worst_longest_over_its_median": 5.0}
    assert summary["ttft_ms_by_kind"]["first"]["p50"] == 400.0 and summary["ttft_ms_by_kind"]["later"]["p50"] == 200.0
    assert summary["later_over_first_turn_ttft_p50"] == 0.5
    assert summary["errors"] == 1 and summary["errors_by_kind"] == {"HTTP 503": 1}
    assert summary["rss_mib"]["growth_percent"] == 10.0


def test_long_prompts_share_no_prefix_and_have_about_the_asked_length():
    a, b = load_test.long_prompt(1, 500), load_test.long_prompt(2, 500)
    assert a.split()[:2] != b.split()[:2] and 500 <= len(a.split()) <= 520


def test_the_speculator_is_a_spawn_child_of_the_server():
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 20
        while child.pid not in load_test.speculator_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        # (in the full suite, earlier tests' speculator processes may still be children of this process too)
        assert child.pid in load_test.speculator_pids(os.getpid())
        memory = load_test.memory(os.getpid())
        assert memory["speculator"] > 0  # the sum, up to rounding each of the three to 0.1 MiB:
        assert abs(memory["total"] - memory["server"] - memory["speculator"]) < 0.15
    finally:
        child.kill()
        child.join()
