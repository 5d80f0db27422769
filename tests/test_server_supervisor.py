"""The server's speculator supervisor (inference/supervisor.py): a dead SSD speculator is noticed without a round,
running requests finish without speculation, and a fresh speculator is adopted on the engine thread and used by
new requests. A fake speculator stands in for the process; tests/test_ssd.py kills a real one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from _server_helpers import CYCLE, asgi_request, lifespan, make_model, make_tokenizer
from inference.api_server import build_app
from ssd_eagle.drafters.base import Proposal
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.ssd.client import SSDDrafter


class FakeSpeculator:
    """Records what it is told; ``alive`` is what a process check would say."""

    def __init__(self):
        self.alive, self.added, self.proposed, self.closed_on = True, [], 0, None

    def add(self, seq):
        self.added.append(seq.slot)

    def propose(self, requests):
        self.proposed += 1
        return [Proposal([]) for _ in requests]

    def remove(self, slot):
        pass

    def close(self):
        self.closed_on = threading.current_thread().name


def _body(result) -> dict:
    return json.loads(b"".join(result[2]))


def test_a_dead_speculator_is_noticed_without_a_round_and_replaced():
    first, second = FakeSpeculator(), FakeSpeculator()
    drafter = SSDDrafter(first, respawn=lambda: second)
    engine = LLMEngine(make_model(), make_tokenizer(), drafter, num_speculative_tokens=3, max_num_seqs=4,
                       max_model_len=256)
    step = engine.step

    def slow_step():
        threading.Event().wait(0.01)
        return step()

    engine.step = slow_step
    app = build_app(engine, "tiny")
    app.state.supervisor.backoff = 0.5

    async def run():
        async with lifespan(app):
            running = asyncio.create_task(asgi_request(app, "POST", "/v1/completions", {
                "prompt": "Hey", "max_tokens": 120, "temperature": 0}))
            while not first.added:
                await asyncio.sleep(0.01)
            first.alive = False  # the process died
            await asyncio.sleep(0.5)
            noticed = drafter.healthy  # by the supervisor alone: no /health call
            health = _body(await asgi_request(app, "GET", "/health"))
            while not drafter.healthy:
                await asyncio.sleep(0.05)
            later = await asgi_request(app, "POST", "/v1/completions", {"prompt": "Hey", "max_tokens": 5,
                                                                        "temperature": 0})
            done = await running
            metrics = (await asgi_request(app, "GET", "/metrics"))[2]
        return noticed, health, done, later, b"".join(metrics).decode()

    noticed, health, done, later, metrics = asyncio.run(run())
    assert noticed is False and health["status"] == "degraded" and "not running" in health["reason"]
    assert done[0] == 200 and _body(done)["usage"]["completion_tokens"] == 120
    assert _body(done)["choices"][0]["text"].encode() == (CYCLE * 20).encode()[3: 3 + 120]  # = plain decoding
    assert later[0] == 200 and second.added and second.proposed > 0  # new requests speculate again
    assert first.closed_on == "engine-loop"  # adopted between steps on the engine thread
    assert "ssd_eagle_speculator_restarts_total 1.0" in metrics
    assert "ssd_eagle_drafter_healthy 1.0" in metrics


@pytest.mark.parametrize("signal, within, reason", [
    (signal.SIGKILL, 1.0, ""),  # dead: the process check, or the round's broken link
    (signal.SIGSTOP, 5.0, "no heartbeat"),  # hung: alive but silent, the heartbeat (3 s) tells
])
def test_a_speculator_process_killed_or_stopped_mid_request_then_speculating_again(byte_tokenizer, signal,
                                                                                   within, reason):
    """A real SSD speculator process, killed (SIGKILL) or hung (SIGSTOP) mid-request: the request's tokens equal
    plain greedy decoding, /health says degraded within ``within`` s without a round, and after the restart a new
    request is drafted by the new process (a hung one was killed: no stopped process is left behind)."""
    from helpers import make_tiny_llama, noisy_copy
    from ssd_eagle.config import EngineConfig, SpeculativeConfig
    from ssd_eagle.engine.factory import build

    target = make_tiny_llama(seed=3)
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=4, fanout=[2],
                             speculator="process", speculator_timeout=20.0,
                             adaptive=False)  # (unplanned: the later request must be drafted, whatever the load)
    engine = build(EngineConfig(model="in-memory", mode="ssd", max_num_seqs=2, max_model_len=512,
                                speculative_config=spec), target, tokenizer=byte_tokenizer,
                   draft=noisy_copy(target, 0.02))
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]
    app = build_app(engine, "tiny")
    app.state.supervisor.backoff = 0.2
    prompt = [9, 8, 7, 6, 5]
    body = {"prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    old = engine.drafter.speculator

    async def run():
        async with lifespan(app):
            running = asyncio.create_task(asgi_request(app, "POST", "/v1/completions", body))
            while engine.stats.num_rounds < 3:
                await asyncio.sleep(0.01)
            os.kill(old.process.pid, signal)
            hit = time.monotonic()
            health = {"status": "ok"}
            while health["status"] == "ok" and time.monotonic() - hit < within + 2:
                health = _body(await asgi_request(app, "GET", "/health"))
                await asyncio.sleep(0.02)
            noticed = time.monotonic() - hit
            deadline = time.monotonic() + 120
            while (engine.drafter.speculator is old or not engine.drafter.healthy) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            done = await running
            drafted = engine.stats.num_drafted
            later = await asgi_request(app, "POST", "/v1/completions", {**body, "max_tokens": 20})
            return noticed, health, done, drafted, later

    try:
        noticed, health, done, drafted, later = asyncio.run(run())
    finally:
        engine.close()
        if old.process.is_alive():  # never leave a stopped process behind, whatever failed
            old.process.kill()
    assert noticed < within, noticed
    assert health["status"] == "degraded" and reason in health["reason"], health
    assert old.process.exitcode is not None  # killed (the hung one by the link's watchdog)
    assert done[0] == 200 and later[0] == 200
    assert _body(done)["choices"][0]["text"] == _plain_text(target, byte_tokenizer, prompt, 150)  # exact at T = 0
    assert engine.stats.num_drafted > drafted  # the new speculator drafted for the later request
    assert _body(later)["choices"][0]["text"] == _plain_text(target, byte_tokenizer, prompt, 20)


def _plain_text(target, tokenizer, prompt: list[int], max_tokens: int) -> str:
    """The text of plain greedy decoding (no drafter), through the same detokenizer as the server's."""
    from ssd_eagle.sampling_params import SamplingParams

    engine = LLMEngine(target, tokenizer, None, max_num_seqs=1, max_model_len=512)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        outputs = engine.step()
    return outputs[-1].text
