"""The SSD speculator's heartbeat (ssd_eagle/ssd/worker.py ``beat``, ssd_eagle/ssd/client.py ``RemoteSpeculator``):
an idle speculator keeps beating and stays alive, a stopped one (SIGSTOP: alive but silent) is declared hung after
``heartbeat_timeout`` s and killed by its link's watchdog, and a propose blocked on it fails over within about
that time instead of waiting for ``speculator_timeout``."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from helpers import make_tiny_llama, noisy_copy
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.engine.factory import build
from ssd_eagle.ssd import transport as t
from ssd_eagle.ssd.client import RemoteSpeculator
from ssd_eagle.ssd.worker import SpeculatorSettings

HEARTBEAT_TIMEOUT = 1.5


@pytest.fixture
def engine(byte_tokenizer):
    target = make_tiny_llama(seed=3)
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=3, fanout=[2],
                             speculator="process", speculator_timeout=60.0,
                             speculator_heartbeat_timeout=HEARTBEAT_TIMEOUT)
    engine = build(EngineConfig(model="in-memory", mode="ssd", max_num_seqs=1, max_model_len=128,
                                speculative_config=spec), target, tokenizer=byte_tokenizer,
                   draft=noisy_copy(target, 0.02))
    yield engine
    process = engine.drafter.speculator.process
    engine.close()
    if process.is_alive():
        process.kill()


def test_an_idle_speculator_keeps_beating(engine):
    speculator = engine.drafter.speculator
    assert isinstance(speculator, RemoteSpeculator) and speculator.heartbeat_timeout == HEARTBEAT_TIMEOUT
    time.sleep(2.5 * HEARTBEAT_TIMEOUT)  # its main thread blocked on a receive, the heartbeat thread beats
    assert speculator.alive and not speculator.hung and speculator.heartbeat_age < HEARTBEAT_TIMEOUT
    assert speculator.down_reason is None and engine.drafter.probe()


def test_a_propose_blocked_on_a_stopped_speculator_fails_over_within_the_heartbeat_limit(engine):
    speculator = engine.drafter.speculator
    os.kill(speculator.process.pid, signal.SIGSTOP)
    outcome = {}

    def propose():
        start = time.monotonic()
        try:
            speculator.propose([])  # the message goes out; the reply never comes
        except t.SpeculatorUnavailable as err:
            outcome["error"] = err
        outcome["seconds"] = time.monotonic() - start

    caller = threading.Thread(target=propose)
    caller.start()
    caller.join(timeout=HEARTBEAT_TIMEOUT + 10)
    assert not caller.is_alive(), "the propose still waits on the hung speculator"
    assert "error" in outcome and outcome["seconds"] < HEARTBEAT_TIMEOUT + 1.5  # not the 60 s speculator_timeout
    speculator.process.join(timeout=5)
    assert speculator.process.exitcode == -signal.SIGKILL  # killed by the watchdog
    assert speculator.killed_hung is not None and speculator.killed_hung > HEARTBEAT_TIMEOUT
    assert not engine.drafter.probe() and "hung" in engine.drafter.error
    engine.close()  # closing a killed speculator returns at once
    assert speculator.closed


def test_the_heartbeat_limit_must_exceed_the_beat_interval():
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        RemoteSpeculator(None, None, heartbeat_timeout=0.5)
    with pytest.raises(ValueError, match="speculator_heartbeat_timeout"):
        SpeculativeConfig(speculator_heartbeat_timeout=0.2)


def test_a_speculator_that_dies_while_starting_fails_the_start_at_once():
    """A speculator process that exits before joining (here: a draft kind it cannot build) fails the start as soon
    as it exits, not after the join's timeout (a spawned speculator that died at start kept the verifier waiting the
    full 300 s, then failed with a store timeout)."""
    settings = SpeculatorSettings("no-such-kind", 3, [2, 2, 2, 2], None, "neural", 8, 1.0, (1, 4), 2, 256,
                                  vocab_size=257)
    start = time.monotonic()
    with pytest.raises(t.SpeculatorUnavailable, match="exited with code 1 while starting"):
        RemoteSpeculator(settings, make_tiny_llama(seed=3), startup_timeout=240.0)
    assert time.monotonic() - start < 60.0
