"""The default ``max_tokens`` of /v1/chat/completions (the rest of the context) and /v1/completions (16) is capped to
the room the prompt leaves in the context (vLLM) and in the KV budget (``--kv-cache-memory``): a request without
``max_tokens`` is served, not refused, on a server whose budget is smaller than its context."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from _server_helpers import make_model, make_tokenizer
from inference.api_server import build_app
from ssd_eagle.drafters.ngram import NgramDrafter
from ssd_eagle.engine.llm import render_chat
from ssd_eagle.engine.llm_engine import LLMEngine
from ssd_eagle.engine.scheduler import GIB, POSITION_GRANULARITY

MESSAGES = [{"role": "user", "content": "hi"}]
ROUND = 4  # one round of the n-gram drafter's K = 3 tokens plus the bonus token: reserved with every request


def _engine(max_model_len: int = 1024, budget_positions: int | None = None) -> LLMEngine:
    def build(budget):
        return LLMEngine(make_model(max_model_len), make_tokenizer(), drafter=NgramDrafter(), num_speculative_tokens=3,
                         max_num_seqs=2, max_model_len=max_model_len, kv_cache_memory=budget)

    if budget_positions is None:
        return build(None)
    bytes_per_position = build(None).target.kv.bytes_per_position
    return build((budget_positions * bytes_per_position + 0.5) / GIB)


def test_chat_default_is_capped_to_the_kv_budget_not_refused():
    engine = _engine(budget_positions=2 * POSITION_GRANULARITY)  # 512 positions of a 1024-token context
    prompt = len(render_chat(engine.tokenizer, MESSAGES))
    assert engine.scheduler.max_new_tokens(prompt) == 512 - prompt - ROUND
    with TestClient(build_app(engine, "tiny")) as client:
        body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0}).json()
        assert body["usage"]["completion_tokens"] == 512 - prompt - ROUND  # the budget's room, not 1024 - prompt
        assert body["choices"][0]["finish_reason"] == "length"
        # an explicit max_tokens past the budget is the client's: a 400 naming it
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 600})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        assert response.json()["error"]["code"] == "kv_cache_exceeded"
        # completions: OpenAI's 16, capped to the budget's room near its end
        body = client.post("/v1/completions", json={"prompt": [120] * 500, "temperature": 0}).json()
        assert body["usage"]["completion_tokens"] == 512 - 500 - ROUND
        # a prompt that alone leaves the budget no room is named
        response = client.post("/v1/completions", json={"prompt": [120] * 510})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert response.json()["error"]["code"] == "kv_cache_exceeded"


@pytest.mark.parametrize("budget_positions", [None, 4096])
def test_without_a_binding_budget_the_default_is_the_room_left_in_the_context(budget_positions):
    engine = _engine(max_model_len=256, budget_positions=budget_positions)
    prompt = len(render_chat(engine.tokenizer, MESSAGES))
    assert engine.scheduler.max_new_tokens(prompt) is None
    with TestClient(build_app(engine, "tiny")) as client:
        body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0}).json()
        assert body["usage"]["completion_tokens"] == 256 - prompt  # vLLM: the rest of the context
        body = client.post("/v1/completions", json={"prompt": [120] * 250, "temperature": 0}).json()
        assert body["usage"]["completion_tokens"] == 6  # min(16, 256 - 250)
