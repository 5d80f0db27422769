"""``python -m inference.serve`` as a real process on loopback, driven by the official ``openai`` client and httpx.

The tiny model of ``tests/_server_helpers.py`` is saved to a temporary folder and served with the n-gram drafter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from _server_helpers import CYCLE, save_tiny_model

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key"
STARTUP_TIMEOUT = 90.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server subprocess; its stderr (JSON-lines logs) goes to a file."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "SSD_EAGLE_API_KEY"}
        cmd = [sys.executable, "-m", "inference.serve", "--model", str(model_dir), "--port", str(self.port),
               # not planned: these tests check the API (spec_stats with tau > 1), not the planner's timing-based
               # choice, which under a loaded CI machine may switch a tiny model's drafts off
               "--mode", "sd", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
               "--max-num-seqs", "4", "--num-threads", "1", *flags]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start in {STARTUP_TIMEOUT} s:\n{log_path.read_text()}")
            time.sleep(0.2)

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(path, max_positions=4096)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY,
                 "--served-model-name", "tiny", "tiny-alias")
    yield srv
    srv.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _metric(server: Server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "") + " "
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want)), 0.0)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == 4096  # default: the target's max positions
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_completions_streamed_and_not(client):
    full = client.completions.create(model="tiny", prompt="Hey", max_tokens=60, temperature=0, logprobs=1)
    choice = full.choices[0]
    assert choice.text.startswith(" é€漢😀!Hey") and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 60 and len(choice.logprobs.tokens) == 60
    assert full.model_extra["spec_stats"]["tau"] > 1
    chunks = list(client.completions.create(model="tiny-alias", prompt="Hey", max_tokens=60, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length" and "spec_stats" in chunks[-1].model_extra


def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Say hi in three scripts"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    text = full.choices[0].message.content
    assert text.startswith(CYCLE) and full.choices[0].finish_reason == "length"
    assert bytes(b for t in full.choices[0].logprobs.content for b in t.bytes).decode("utf-8", "replace") == text
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=50, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 50 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    sampled = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=8.0,
                                              seed=11).choices[0].message.content for _ in range(2)]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=30, temperature=8.0, seed=11, stream=True))
    assert sampled[0] == sampled[1] == streamed


def test_errors_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], presence_penalty=1)
    assert err.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    headers = {"Authorization": f"Bearer {KEY}"}
    for raw, code in ((b"\xff{", "invalid_utf8"), (b"{nope", "invalid_json")):
        response = httpx.post(server.url + "/v1/completions", content=raw, headers=headers, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["code"] == code
    assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def test_disconnect_stops_generation(server):
    aborted = _metric(server, "ssd_eagle_requests_total", endpoint="completions", outcome="aborted")
    body = {"model": "tiny", "prompt": "Hey", "max_tokens": 3900, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while _metric(server, "ssd_eagle_running_requests") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    before = _metric(server, "ssd_eagle_generation_tokens_total")
    time.sleep(0.5)
    assert _metric(server, "ssd_eagle_generation_tokens_total") == before  # the engine stopped producing
    assert _metric(server, "ssd_eagle_running_requests") == 0
    assert _metric(server, "ssd_eagle_requests_total", endpoint="completions", outcome="aborted") == aborted + 1


def test_json_logs(server, client):
    client.completions.create(model="tiny", prompt="Hey", max_tokens=3)
    logs = server.logs()  # every line is JSON
    assert any(e.get("event") == "request_finished" and e.get("completion_tokens") == 3 for e in logs)
    serving = next(e for e in logs if e.get("event") == "serving")
    health = httpx.get(server.url + "/health", timeout=5).json()
    assert serving["device"] == health["device"] == "cpu" and serving["dtype"] == health["dtype"]
    assert serving["native_bf16"] == health["native_bf16"] and serving["cpu_flags"] == health["cpu_flags"]
    stages = {e["stage"]: e["seconds"] for e in logs if e.get("event") == "startup_stage"}  # each stage timed
    assert {"load target", "engine set-up", "planner cost model"} <= set(stages), stages
    assert min(stages.values()) >= 0 and serving["startup_s"] >= sum(stages.values())
    assert logs.index(next(e for e in logs if e.get("stage") == "load target")) < logs.index(serving)
    assert "speculative_config" in serving and isinstance(serving["planner"], bool)  # (what the mode runs)


def test_sigterm_drains(model_dir, tmp_path):
    srv = Server(model_dir, tmp_path / "drain.log")
    try:
        assert httpx.get(srv.url + "/ready", timeout=5).json() == {"status": "ready"}
        body = {"model": str(model_dir), "prompt": "Hey", "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)  # the socket stays open while draining: new requests get 503 with Retry-After
            late = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
            assert late.status_code == 503 and late.headers["retry-after"] == "1"
            assert late.json()["error"]["code"] == "shutting_down"
            assert httpx.get(srv.url + "/health", timeout=5).json() == {"status": "draining"}
            assert httpx.get(srv.url + "/ready", timeout=5).status_code == 503
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert final["choices"][0]["finish_reason"] == "length"  # the in-flight request finished in full
        assert srv.proc.wait(timeout=30) == 0
        events = [e.get("event") for e in srv.logs()]
        assert "draining" in events and "shutdown" in events and "drain_timeout" not in events
        assert not any("Traceback" in line for line in srv.log_path.read_text().splitlines())
    finally:
        srv.stop()


def test_sigterm_past_the_graceful_timeout_ends_requests_with_an_error_and_exit_code_1(model_dir, tmp_path):
    srv = Server(model_dir, tmp_path / "timeout.log", "--graceful-timeout", "0")
    try:
        body = {"model": str(model_dir), "prompt": "Hey", "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutdown_timeout"
        assert srv.proc.wait(timeout=30) == 1
        assert "drain_timeout" in [e.get("event") for e in srv.logs()]
    finally:
        srv.stop()


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model that does not exist: had it been loaded first, the error would be about the model
        result = subprocess.run([sys.executable, "-m", "inference.serve", "--model", str(tmp_path / "missing"),
                                 "--port", str(port), "--mode", "ar"], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 2
    logs = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [e["event"] for e in logs if e.get("event")] == ["bind_failed"]
    assert str(port) in logs[-1]["message"] and "in use" in logs[-1]["message"]


def spawned(process) -> bool:
    """Whether ``process`` (a psutil.Process) has a multiprocessing ``spawn`` child (an SSD speculator)."""
    import psutil

    for child in process.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                return True
        except psutil.NoSuchProcess:  # (a short-lived helper process)
            pass
    return False


@pytest.mark.parametrize("sig, moment", [(signal.SIGTERM, "spawned"), (signal.SIGINT, "spawned"),
                                         (signal.SIGTERM, "joining")])
def test_a_signal_while_the_model_loads_exits_cleanly(tmp_path, sig, moment):
    """Signalled as the speculator process appears, or half a second later ("joining": the verifier waits in C
    for the pair's link, so the signal is raised as the link is made). The latter left the link to the garbage
    collector before the process was stopped, and the process printed gloo's "Connection closed by peer"
    traceback into the server's JSON log (a CI failure of stop 26)."""
    import psutil

    model_dir = tmp_path / "model"
    save_tiny_model(model_dir)
    spec = json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                       "speculator": "process"})
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "inference.serve", "--model", str(model_dir), "--port",
                                 str(_free_port()), "--mode", "ssd", "--speculative-config", spec,
                                 "--num-threads", "1"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            server = psutil.Process(proc.pid)
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while not spawned(server):  # the speculator is spawned while the engine is being built
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
            if moment == "joining":
                time.sleep(0.5)
            children = server.children(recursive=True)
            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
    lines = log_path.read_text().splitlines()
    logs = [json.loads(line) for line in lines]  # every line a whole JSON record: no traceback, nothing cut off
    assert logs[-1]["event"] == "exited" and logs[-1]["clean"] is True
    assert logs[-1]["during"] == "startup" and logs[-1]["signal"] == signal.Signals(sig).name
    assert not any(e.get("event") == "serving" for e in logs)


def test_a_port_taken_by_a_loading_server_is_refused_to_a_second_one():
    """The first server listens from the moment it binds (before its model loads): with SO_REUSEADDR two sockets
    that are bound but not listening share a port on Linux, so a second server loaded the whole model and then
    crashed in uvicorn with "Address already in use" (exit 1) instead of exiting 2 at once."""
    from inference.serve import bind_socket

    first = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", first.getsockname()[1]).close()
    finally:
        first.close()
