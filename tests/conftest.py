"""Session-wide test settings and fixtures; the shared helpers themselves live in ``tests/helpers.py``."""

from __future__ import annotations

import pytest
import torch

from helpers import make_byte_tokenizer

# Tiny models gain nothing from intra-op threads, and OpenMP threads waiting for a busy core (the SSD speculator
# process, another test worker) turn microseconds into milliseconds.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()

