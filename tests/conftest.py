"""Session-wide test settings and fixtures; the shared helpers themselves live in ``tests/helpers.py``."""

from __future__ import annotations

import functools

import pytest
import torch

from helpers import make_byte_tokenizer

# Tiny models gain nothing from intra-op threads, and OpenMP threads waiting for a busy core (the SSD speculator
# process, another test worker) turn microseconds into milliseconds.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()



@pytest.fixture(autouse=True)
def measured_cost_tables(monkeypatch):
    """Engines built by tests time their planner's costs (verification, drafting) instead of reading
    ``~/.cache/ssd_eagle/costs``: a table cached while the machine was loaded (keyed by the runner code's digest, so
    any edit to it makes a new one) decided whether a test's engine speculated at all, and a test that needs cache
    hits failed on one machine state and passed on another. tests/test_planner.py checks the cache itself with its
    own folder."""
    import ssd_eagle.planner

    for name in ("measure_verify_costs", "measure_draft_costs"):
        measure = getattr(ssd_eagle.planner, name)
        monkeypatch.setattr(ssd_eagle.planner, name, functools.partial(measure, cache=False))
