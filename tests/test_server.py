"""The OpenAI-compatible API in process (FastAPI TestClient, or the ASGI app called directly) with a tiny engine.

See ``tests/_server_helpers.py`` for the engine: greedy decoding cycles through "Hey é€漢😀!" byte by byte.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import time
from collections import Counter

import pytest
from fastapi.testclient import TestClient

from _server_helpers import CYCLE, asgi_request, lifespan, make_engine, parse_sse
from inference.api_server import build_app
from inference.serve import JsonFormatter, parse_args
from ssd_eagle.engine.llm import render_chat

MODEL = "tiny"


@pytest.fixture(scope="module")
def shared():
    """One app for the tests that do not change the engine."""
    engine = make_engine()
    with TestClient(build_app(engine, MODEL)) as client:
        yield client, engine


@pytest.fixture
def client(shared):
    return shared[0]


def instrument(engine, delay: float = 0.0) -> Counter:
    """Make each engine step sleep ``delay`` s first; returns a live count of tokens produced per request id, plus
    ``"max_batch"``: the most requests decoded together in one step."""
    produced: Counter = Counter()
    step = engine.step

    def counting_step():
        time.sleep(delay)
        produced["max_batch"] = max(produced["max_batch"], len(engine.running) + len(engine.waiting))
        outputs = step()
        for out in outputs:
            produced[out.request_id] += len(out.delta_token_ids)
        return outputs

    engine.step = counting_step
    return produced


def stream_text(events: list, chat: bool) -> str:
    assert events[-1] == "[DONE]"
    parts = []
    for event in events[:-1]:
        for choice in event["choices"]:
            parts.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(parts)


def error_of(response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# ------------------------------------------------------------------------------------------------ basic API
def test_models_and_health(client):
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL]
    assert data["data"][0]["max_model_len"] == 256
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    error_of(client.get("/v1/models/other"), 404, "model")
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["device"] == "cpu" and health["dtype"] == "float32"
    assert health["cpu"] and isinstance(health["cpu_flags"], list) and isinstance(health["native_bf16"], bool)


def test_completion_response_shape(client):
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hey", "max_tokens": 20,
                                                "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == (CYCLE.encode() * 2)[3:23].decode()  # the 20 bytes of the cycle after "Hey"
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 20, "total_tokens": 23}
    stats = body["spec_stats"]
    assert {"tau", "cache_hit_rate", "acceptance_rate", "mode"} <= set(stats) and stats["tau"] >= 1.0
    assert stats["mode"] == "sd:ngram"


def test_completion_defaults_to_16_tokens_and_accepts_token_ids(client):
    body = client.post("/v1/completions", json={"prompt": list(b"Hey")}).json()  # model omitted: the served one
    assert body["usage"]["completion_tokens"] == 16 and body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_uses_template_and_defaults_to_remaining_context(client, shared):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0}).json()
    prompt_tokens = len(render_chat(shared[1].tokenizer, messages))
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 256 - prompt_tokens  # chat default: the rest of the context
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].startswith(CYCLE)
    assert choice["finish_reason"] == "length"


def test_eos_and_stop_strings(client):
    eos = client.post("/v1/completions", json={"prompt": "abc~", "max_tokens": 10, "temperature": 0}).json()
    assert eos["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    one = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 40, "temperature": 0,
                                               "stop": "漢"}).json()
    assert one["choices"][0]["text"] == " é€" and one["choices"][0]["finish_reason"] == "stop"
    many = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
                                                     "temperature": 0, "stop": ["zzz", "😀"]}).json()
    assert many["choices"][0]["message"]["content"] == "Hey é€漢" and many["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        body = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 24, "temperature": 8.0,
                                                    "top_p": 0.95, "top_k": 100, "seed": seed}).json()
        return body["choices"][0]["text"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


# ------------------------------------------------------------------------------------------------ streaming
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 8.0, "seed": 3}],
                         ids=["greedy", "sampled"])
def test_stream_joins_to_the_non_streamed_text(client, chat, sampling):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 70, **sampling}
    body.update({"messages": [{"role": "user", "content": "Hey"}]} if chat else {"prompt": "Hey"})
    full = client.post(path, json=body).json()
    text = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    response = client.post(path, json={**body, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert stream_text(events, chat) == text
    final = events[-2]
    # same seed, same finish: a sampled answer may end on EOS ("stop") before max_tokens
    assert final["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] and "spec_stats" in final
    if sampling["temperature"] == 0:
        assert final["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert "usage" not in final  # only with stream_options.include_usage
    if chat:
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    if sampling["temperature"] == 0:
        assert "é€漢😀" in text and "\ufffd" not in text.rstrip("\ufffd")  # may end inside a character
        assert len(events) - 1 < full["usage"]["completion_tokens"]  # steps emitted several tokens
        assert full["spec_stats"]["tau"] > 1.5


def test_stream_splits_characters_across_steps_yet_joins_exactly(client):
    """With logprobs each chunk carries its step's tokens (and their bytes): some steps end inside a multi-byte
    character, whose text is held back to the next chunk, so the text streamed so far is always the complete
    characters of the bytes so far, and the joined stream is exact."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 90, "temperature": 0, "logprobs": True}
    full = client.post("/v1/chat/completions", json=body).json()
    events = parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    raw, text, splits = b"", "", 0
    for event in events[:-1]:
        choice = event["choices"][0]
        raw += bytes(b for token in choice["logprobs"]["content"] for b in token["bytes"])
        text += choice["delta"].get("content", "")
        complete = raw.decode("utf-8", errors="ignore") if choice["finish_reason"] is None else None
        if complete is not None and complete != raw.decode("utf-8", errors="replace"):
            splits += 1  # this step ended inside a character
        if complete is not None:
            assert text == complete
    assert splits > 0 and len(events) - 1 < 90
    assert text == full["choices"][0]["message"]["content"]
    assert [t["token"] for e in events[:-1] for t in e["choices"][0]["logprobs"]["content"]] == \
        [t["token"] for t in full["choices"][0]["logprobs"]["content"]]


def test_stream_with_stop_string_and_usage(client):
    body = {"messages": [{"role": "user", "content": "Hey"}], "max_tokens": 60, "temperature": 0, "stop": ["😀!H"],
            "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse(client.post("/v1/chat/completions", json=body).text)
    assert stream_text(events, chat=True) == "Hey é€漢"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert events[-3]["choices"][0]["finish_reason"] == "stop" and events[-3]["usage"] is None


# ------------------------------------------------------------------------------------------------- logprobs
def test_completion_logprobs_shape(client):
    body = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 8, "temperature": 0,
                                                "logprobs": 3}).json()
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["tokens"][:3] == [" ", "bytes:\\xc3", "bytes:\\xa9"]  # "é" is two tokens
    assert lp["text_offset"][:4] == [0, 1, 1, 2]
    assert all(len(top) == 3 for top in lp["top_logprobs"])
    assert all(-1e-3 < v <= 0 for v in lp["token_logprobs"])  # the cycle is near-certain under the target


def test_chat_logprobs_shape(client):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                                                     "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 9
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert bytes(b for c in content for b in c["bytes"]).decode() == body["choices"][0]["message"]["content"]
    none = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": 2}).json()
    assert none["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------------------------------- invalid inputs
CHAT = [{"role": "user", "content": "hi"}]
BAD_COMPLETIONS = [
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "seed": "s"}, 400, "seed"),
    ({"prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stop": [1]}, 400, "stop[0]"),
    ({"prompt": "x", "logprobs": 30}, 400, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [99999]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),  # 1 + 256 > max_model_len
    ({"prompt": "x" * 300}, 400, "prompt"),
    ({"prompt": "x" * 100_000}, 400, "prompt"),  # refused before tokenizing
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "model": 3}, 400, "model"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "messages[0].tool_calls"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ({"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": CHAT, "function_call": "auto"}, 400, "function_call"),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": CHAT, "n": 3}, 400, "n"),
    ({"messages": CHAT, "presence_penalty": -0.5}, 400, "presence_penalty"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 2}, 400, "logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "max_tokens": 250}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 100_000}]}, 400, "messages"),
    ({"messages": CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS, ids=lambda v: json.dumps(v)[:40])
def test_bad_completion_requests(client, body, status, param):
    error_of(client.post("/v1/completions", json=body), status, param)


@pytest.mark.parametrize("body,status,param", BAD_CHATS, ids=lambda v: json.dumps(v)[:40])
def test_bad_chat_requests(client, body, status, param):
    error_of(client.post("/v1/chat/completions", json=body), status, param)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}'),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": -Infinity}'),
])
def test_non_finite_numbers_are_refused(client, path, body):
    """Python's JSON (and pydantic's) read Infinity and NaN; SamplingParams' constraints refuse them."""
    param = "top_p" if "top_p" in body else "temperature"
    error = error_of(client.post(path, content=body, headers={"content-type": "application/json"}), 400, param)
    assert "finite" in error["message"] or "greater than" in error["message"]


@pytest.mark.parametrize("raw,code", [(b"{bad json", "invalid_json"), (b"", "invalid_json"),
                                      (b'{"prompt": "\xff\xfe"}', "invalid_utf8"), (b"[1, 2]", "invalid_request_body"),
                                      (b'"text"', "invalid_request_body")])
def test_unparseable_bodies(client, raw, code):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert error_of(client.post(path, content=raw), 400, None)["code"] == code


def test_accepted_neutral_values_and_routing_errors(client):
    ok = client.post("/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "user", "content": "hi", "name": "me"}],
        "max_completion_tokens": 3, "n": 1, "presence_penalty": 0, "response_format": {"type": "text"},
        "tool_choice": "none", "logit_bias": {}, "user": "u1", "top_k": -1, "seed": -5})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    error_of(client.get("/v1/nothing"), 404)
    error_of(client.get("/v1/completions"), 405)


def test_body_size_limit():
    with TestClient(build_app(make_engine(), MODEL, max_request_bytes=200)) as client:
        error_of(client.post("/v1/completions", json={"prompt": "x" * 500}), 413)
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------ auth and ops
def test_api_key():
    with TestClient(build_app(make_engine(), MODEL, api_key="sekrit")) as client:
        assert error_of(client.get("/v1/models"), 401)["code"] == "invalid_api_key"
        error_of(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        error_of(client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "sekrit"}), 401)
        good = {"Authorization": "Bearer sekrit"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=good).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def _metric(text: str, name: str, **labels) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    for line in text.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{want} not in /metrics")


def test_metrics_contents():
    with TestClient(build_app(make_engine(), MODEL)) as client:
        client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 30, "temperature": 0})
        client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "stream": True})
        client.post("/v1/completions", json={"prompt": "x", "n": 2})
        text = client.get("/metrics").text
    p = "ssd_eagle_"
    assert _metric(text, p + "requests_total", endpoint="completions", outcome="length") == 1
    assert _metric(text, p + "requests_total", endpoint="chat", outcome="length") == 1
    assert _metric(text, p + "requests_total", endpoint="completions", outcome="400") == 1
    assert _metric(text, p + "generation_tokens_total") == 35
    assert _metric(text, p + "prompt_tokens_total") == 3 + 20
    assert _metric(text, p + "generation_tokens_per_second") > 0
    assert _metric(text, p + "spec_tau") > 1
    assert math.isnan(_metric(text, p + "spec_cache_hit_rate"))  # n-gram drafting does no cache lookups
    assert _metric(text, p + "spec_rounds_total") > 0
    assert _metric(text, p + "queue_depth") == 0 and _metric(text, p + "running_requests") == 0
    assert _metric(text, p + "time_to_first_token_seconds_count") == 2
    assert _metric(text, p + "e2e_request_latency_seconds_count") == 2
    assert _metric(text, p + "time_per_output_token_seconds_count") == 2
    assert _metric(text, p + "drafter_healthy") == 1


def test_health_degraded_when_drafter_unhealthy():
    engine = make_engine()
    with TestClient(build_app(engine, MODEL)) as client:
        engine.drafter.healthy = False
        body = client.get("/health").json()
        assert body["status"] == "degraded" and "drafter" in body["reason"]
        assert _metric(client.get("/metrics").text, "ssd_eagle_drafter_healthy") == 0
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
        engine.drafter.healthy = True
        assert client.get("/health").json()["status"] == "ok"


def test_json_logs():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("inference.api_server")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with TestClient(build_app(make_engine(), MODEL)) as client:
            rid = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 4}).json()["id"]
            client.post("/v1/completions", json={"prompt": "x", "echo": True})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    done = [e for e in lines if e.get("event") == "request_finished"]
    assert done and done[0]["request_id"] == rid and done[0]["outcome"] == "length"
    assert done[0]["completion_tokens"] == 4 and done[0]["level"] == "INFO" and "time" in done[0]
    refused = [e for e in lines if e.get("event") == "request_refused"]
    assert refused and refused[0]["param"] == "echo" and refused[0]["status"] == 400


# ------------------------------------------------------------------------------------- resilience
def test_engine_step_failure_fails_only_in_flight_requests_and_keeps_serving():
    engine = make_engine()
    step = engine.step
    armed = {"on": True}

    def failing_step():
        if armed["on"] and any(s.num_output_tokens >= 4 for s in engine.running):
            armed["on"] = False
            raise RuntimeError("boom")
        return step()

    engine.step = failing_step
    with TestClient(build_app(engine, MODEL)) as client:
        error = error_of(client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 40}), 500, None)
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        assert client.get("/health").json()["status"] == "degraded"
        armed["on"] = True
        events = parse_sse(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 40,
                                                                     "stream": True}).text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        ok = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 10}).json()
        assert ok["usage"]["completion_tokens"] == 10
        assert client.get("/health").json()["status"] == "ok"
        text = client.get("/metrics").text
        assert _metric(text, "ssd_eagle_engine_step_errors_total") == 2
        assert _metric(text, "ssd_eagle_requests_total", endpoint="completions", outcome="error") == 1
        assert not engine.has_unfinished() and not engine.requests


def test_engine_failing_before_admission_fails_the_waiting_request_instead_of_spinning():
    engine = make_engine()
    step = engine.step
    failures = []

    def broken_step():
        if not failures:
            failures.append(1)
            raise RuntimeError("cannot admit")
        return step()

    engine.step = broken_step
    with TestClient(build_app(engine, MODEL)) as client:
        error_of(client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 5}), 500)
        assert len(failures) == 1 and not engine.has_unfinished()
        assert client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 5}).status_code == 200


# ------------------------------------------------------------------------------------------- concurrency
def test_mixed_sampling_parameters_share_a_batch():
    bodies = [{"prompt": "Hey", "max_tokens": 30, "temperature": 0},
              {"prompt": "abc", "max_tokens": 30, "temperature": 8.0, "seed": 1, "top_k": 50},
              {"prompt": "xy", "max_tokens": 30, "temperature": 0.7, "top_p": 0.5, "seed": 2, "stop": "漢"},
              {"prompt": "Hey", "max_tokens": 30, "temperature": 8.0, "seed": 4, "logprobs": 2}]

    async def run(concurrent: bool):
        engine = make_engine()
        produced = instrument(engine)
        app = build_app(engine, MODEL)
        async with lifespan(app):
            calls = [asgi_request(app, "POST", "/v1/completions", b) for b in bodies]
            if concurrent:
                results = await asyncio.gather(*calls)
            else:
                results = [await c for c in calls]
        return [json.loads(b"".join(r[2]))["choices"][0]["text"] for r in results], produced["max_batch"]

    together, batch = asyncio.run(run(True))
    alone, single = asyncio.run(run(False))
    assert batch == 4 and single == 1
    assert together == alone


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(stream):
    async def run():
        engine = make_engine()
        produced = instrument(engine, delay=0.02)
        app = build_app(engine, MODEL)
        async with lifespan(app):
            body = {"prompt": "Hey", "max_tokens": 200, "stream": stream}
            status, headers, chunks = await asgi_request(
                app, "POST", "/v1/completions", body, disconnect_after_chunks=2 if stream else None,
                disconnect_after_s=None if stream else 0.3)
            rid = headers["x-request-id"]
            for _ in range(500):  # the abort reaches the engine before its next step
                if rid not in engine.requests:
                    break
                await asyncio.sleep(0.01)
            before = produced[rid]
            await asyncio.sleep(0.3)
            assert produced[rid] == before < 150  # the engine stopped producing tokens for it
            assert rid not in engine.requests and not engine.has_unfinished()
            assert app.state.server.async_engine.num_running == 0
            metrics = app.state.server.metrics.render()[0].decode()
            assert _metric(metrics, "ssd_eagle_requests_total", endpoint="completions", outcome="aborted") == 1
            return status, chunks

    status, chunks = asyncio.run(run())
    assert status == (200 if stream else 499)
    assert not stream or b"[DONE]" not in b"".join(chunks)


def test_disconnect_while_queued_never_reaches_the_batch():
    async def run():
        engine = make_engine(max_num_seqs=1)
        produced = instrument(engine, delay=0.02)
        app = build_app(engine, MODEL)
        async with lifespan(app):
            busy = asyncio.create_task(asgi_request(app, "POST", "/v1/completions",
                                                    {"prompt": "Hey", "max_tokens": 60}))
            while app.state.server.async_engine.num_running == 0:
                await asyncio.sleep(0.01)
            status, headers, _ = await asgi_request(app, "POST", "/v1/chat/completions",
                                                    {"messages": CHAT, "max_tokens": 50, "stream": True},
                                                    disconnect_after_s=0.1)
            assert app.state.server.async_engine.num_queued == 0
            assert (await busy)[0] == 200
            return produced[headers["x-request-id"]] if headers else None, status, engine.has_unfinished()

    produced, status, unfinished = asyncio.run(run())
    assert produced == 0 and status == 200 and not unfinished


def test_queue_bound_returns_503():
    async def run():
        engine = make_engine(max_num_seqs=2)
        instrument(engine, delay=0.03)
        app = build_app(engine, MODEL, max_queue=2)
        async_engine = app.state.server.async_engine
        body = {"prompt": "Hey", "max_tokens": 40}

        async def until(condition):
            for _ in range(1000):
                if condition():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("condition not reached")

        async with lifespan(app):
            running = [asyncio.create_task(asgi_request(app, "POST", "/v1/completions", body)) for _ in range(2)]
            await until(lambda: async_engine.num_running == 2)
            queued = [asyncio.create_task(asgi_request(app, "POST", "/v1/completions", body)) for _ in range(2)]
            await until(lambda: async_engine.num_queued == 2)
            status, headers, chunks = await asgi_request(app, "POST", "/v1/completions", body)
            results = await asyncio.gather(*running, *queued)
            after = await asgi_request(app, "POST", "/v1/completions", body)
        return status, headers, json.loads(b"".join(chunks)), [r[0] for r in results], after[0]

    status, headers, error, others, after = asyncio.run(run())
    assert status == 503 and error["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
    assert others == [200] * 4 and after == 200


def test_draining_refuses_new_requests_and_finishes_in_flight_ones():
    async def run():
        engine = make_engine()
        instrument(engine, delay=0.02)
        app = build_app(engine, MODEL)
        async_engine = app.state.server.async_engine
        before = await asgi_request(app, "GET", "/ready")  # no lifespan yet: the engine loop is not running
        async with lifespan(app):
            ready = await asgi_request(app, "GET", "/ready")
            first = asyncio.create_task(asgi_request(app, "POST", "/v1/completions",
                                                     {"prompt": "Hey", "max_tokens": 40, "stream": True}))
            while async_engine.num_running == 0:
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(async_engine.drain(timeout=60))
            await asyncio.sleep(0)
            refused = await asgi_request(app, "POST", "/v1/completions", {"prompt": "x"})
            health = await asgi_request(app, "GET", "/health")
            not_ready = await asgi_request(app, "GET", "/ready")
            done, drained = await first, await drain
        stopped = await asgi_request(app, "GET", "/health")
        assert not async_engine.alive  # lifespan shutdown stopped the engine thread
        return before, ready, refused, health, not_ready, done, drained, stopped

    before, ready, refused, health, not_ready, done, drained, stopped = asyncio.run(run())
    assert before[0] == 503 and json.loads(b"".join(before[2])) == {"status": "starting"}
    assert ready[0] == 200 and json.loads(b"".join(ready[2])) == {"status": "ready"}
    assert refused[0] == 503 and json.loads(b"".join(refused[2]))["error"]["code"] == "shutting_down"
    assert refused[1]["retry-after"] == "1"
    assert health[0] == 200 and json.loads(b"".join(health[2])) == {"status": "draining"}  # alive (liveness)
    assert not_ready[0] == 503 and json.loads(b"".join(not_ready[2])) == {"status": "draining"}
    assert done[0] == 200 and b"".join(done[2]).endswith(b"data: [DONE]\n\n") and drained is True
    events = parse_sse(b"".join(done[2]).decode())
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # finished in full
    assert stopped[0] == 503 and json.loads(b"".join(stopped[2])) == {"status": "stopped"}


@pytest.mark.parametrize("stream", [True, False])
def test_drain_timeout_ends_the_remaining_requests_with_an_error(stream):
    engine = make_engine()
    produced = instrument(engine, delay=0.05)

    def total() -> int:
        return sum(v for k, v in produced.items() if k != "max_batch")

    async def run(app, async_engine):
        async with lifespan(app):
            first = asyncio.create_task(asgi_request(app, "POST", "/v1/completions",
                                                     {"prompt": "Hey", "max_tokens": 200, "stream": stream}))
            while async_engine.num_running == 0:
                await asyncio.sleep(0.01)
            drained = await async_engine.drain(timeout=0.1)
            done, tokens = await first, total()
            await asyncio.sleep(0.2)  # the engine aborted it: nothing more is produced
        return drained, done, tokens, total(), async_engine.num_in_flight

    app = build_app(engine, MODEL)
    drained, done, tokens, later, in_flight = asyncio.run(run(app, app.state.server.async_engine))
    assert drained is False and in_flight == 0 and 0 < tokens < 200 and later <= tokens + 4
    if stream:
        events = parse_sse(b"".join(done[2]).decode())
        assert done[0] == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown_timeout"
    else:
        assert done[0] == 500 and json.loads(b"".join(done[2]))["error"]["code"] == "shutdown_timeout"


# ----------------------------------------------------------------------------------------------- config
def test_yaml_config_and_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("SSD_EAGLE_API_KEY", raising=False)
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9001\nmax-queue: 20\nmode: ar\nserved_model_name: smol\npin_cpus: false\n"
                    "speculative_config: {method: ngram, num_speculative_tokens: 3}\napi_key: null\n")
    args = parse_args(["--config", str(path), "--port", "9002"])
    assert (args.port, args.max_queue, args.mode, args.served_model_name) == (9002, 20, "ar", ["smol"])
    assert args.pin_cpus is False and args.api_key is None
    assert json.loads(args.speculative_config)["num_speculative_tokens"] == 3
    assert (args.host, parse_args([]).port) == ("127.0.0.1", 8000)
    for bad in ("prot: 1\n", "port: abc\n", "dtype: float8\n", "- port\n", "pin_cpus: 'no'\n"):
        path.write_text(bad)
        with pytest.raises(SystemExit):
            parse_args(["--config", str(path)])


# ------------------------------------------------------------------------------ context limits and the KV budget
def test_a_prompt_that_alone_fills_the_context_is_named_even_with_max_tokens(client):
    for prompt in ([120] * 300, [120] * 256):  # longer than, and exactly, max_model_len: no room for one token
        error = error_of(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}), 400, "prompt")
        assert error["code"] == "context_length_exceeded" and "max_tokens" not in error["message"]
    chat = {"messages": [{"role": "user", "content": "x" * 260}], "max_tokens": 5}
    assert error_of(client.post("/v1/chat/completions", json=chat), 400, "messages")["code"] == \
        "context_length_exceeded"
    # room for some tokens, but fewer than max_tokens: the client's max_tokens is at fault
    error_of(client.post("/v1/completions", json={"prompt": [120] * 250, "max_tokens": 7}), 400, "max_tokens")


def test_completion_default_max_tokens_is_capped_to_the_room_left(client):
    """vLLM: without max_tokens, min(16, max_model_len - prompt tokens)."""
    body = client.post("/v1/completions", json={"prompt": [120] * 250, "temperature": 0}).json()
    assert body["usage"] == {"prompt_tokens": 250, "completion_tokens": 6, "total_tokens": 256}
    assert body["choices"][0]["finish_reason"] == "length"
    body = client.post("/v1/completions", json={"prompt": [120] * 200, "temperature": 0}).json()
    assert body["usage"]["completion_tokens"] == 16  # room enough: OpenAI's default


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": "x", "stop": ["\udc00"]}', "stop[0]"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud83d"}]}', "messages[0].content"),
])
def test_a_lone_surrogate_escape_is_a_400_naming_the_string(client, path, raw, param):
    error = error_of(client.post(path, content=raw, headers={"content-type": "application/json"}), 400, param)
    assert error["code"] == "invalid_utf16" and "not valid UTF-16/UTF-8" in error["message"]


def test_a_surrogate_pair_escape_is_one_character(client):
    raw = r'{"prompt": "\ud83d\ude00", "max_tokens": 1, "temperature": 0}'
    body = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}).json()
    assert body["usage"]["prompt_tokens"] == len("😀".encode())


def test_kv_budget_refuses_a_request_that_can_never_fit_and_metrics_report_usage():
    from _server_helpers import make_model, make_tokenizer
    from ssd_eagle.drafters.ngram import NgramDrafter
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.engine.scheduler import GIB

    bytes_per_position = make_engine().target.kv.bytes_per_position
    budget = 256 * bytes_per_position  # one slot of 256 positions: prompt + max_tokens + a round of 4 <= 256
    engine = LLMEngine(make_model(), make_tokenizer(), drafter=NgramDrafter(), num_speculative_tokens=3,
                       max_num_seqs=4, max_model_len=256, kv_cache_memory=(budget + 0.5) / GIB)
    with TestClient(build_app(engine, MODEL)) as client:
        error = error_of(client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 250}), 400,
                         "max_tokens")
        assert error["code"] == "kv_cache_exceeded" and "kv_cache_memory" in error["message"]
        ok = client.post("/v1/completions", json={"prompt": "Hey", "max_tokens": 249, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 249
        text = client.get("/metrics").text
    assert _metric(text, "ssd_eagle_kv_cache_budget_bytes") == budget
    used = _metric(text, "ssd_eagle_kv_cache_usage_bytes")
    assert 0 < used <= budget and used == engine.kv_cache_usage[0]
