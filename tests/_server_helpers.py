"""A tiny in-memory engine for the server tests, and helpers to talk to an ASGI app directly.

The target is a real (tiny) ``LlamaForCausalLM`` whose weights are set so that greedy decoding cycles through
the UTF-8 bytes of :data:`CYCLE` (``"Hey é€漢😀!"``): embeddings are one-hot, the decoder layers add only a small
random perturbation, and the output layer maps each byte to the next byte of the cycle (logit margin ~16). The
tokenizer is byte-level (token i < 256 is byte i, 256 is ``<eos>``), so 2-, 3- and 4-byte characters are split
across tokens, and with the n-gram drafter several tokens are accepted per step, so characters are also split
across steps. ``~`` is followed by ``<eos>``. A high temperature (e.g. 8) makes sampled outputs random.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_ID = 256
VOCAB = 257
CYCLE = "Hey é€漢😀!"
EOS_AFTER = "~"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level test tokenizer of ``helpers`` with this module's chat template."""
    from helpers import make_byte_tokenizer

    tok = make_byte_tokenizer()
    assert tok.eos_token_id == EOS_ID
    tok.chat_template = CHAT_TEMPLATE
    return tok


def next_byte_table() -> dict[int, int]:
    """Token -> the token the model predicts next."""
    cycle = list(CYCLE.encode())
    assert len(set(cycle)) == len(cycle), "the cycle's bytes must be distinct"
    table = {t: cycle[0] for t in range(VOCAB)}
    table.update({a: b for a, b in zip(cycle, cycle[1:] + cycle[:1])})
    table[EOS_AFTER.encode()[0]] = EOS_ID
    return table


def make_model(max_positions: int = 256, seed: int = 0) -> LlamaForCausalLM:
    hidden = 272  # >= VOCAB, for one-hot embeddings
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=EOS_ID, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :VOCAB] = torch.eye(VOCAB)
        for layer in model.model.layers:  # keep the layers alive, but small
            layer.self_attn.o_proj.weight.mul_(0.02)
            layer.mlp.down_proj.weight.mul_(0.02)
        head = model.lm_head.weight
        head.normal_(0.0, 0.005)
        for src, dst in next_byte_table().items():
            head[dst, src] = 1.0
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID)
    return model


def make_engine(max_model_len: int = 256, max_num_seqs: int = 4):
    from ssd_eagle.drafters.ngram import NgramDrafter
    from ssd_eagle.engine.llm_engine import LLMEngine

    return LLMEngine(make_model(max(256, max_model_len)), make_tokenizer(), drafter=NgramDrafter(),
                     num_speculative_tokens=3, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def save_tiny_model(path, max_positions: int = 256) -> None:
    make_model(max_positions).save_pretrained(path)
    make_tokenizer().save_pretrained(path)


def parse_sse(body: str) -> list:
    """``data:`` payloads of an event stream: dicts, and the final ``"[DONE]"``."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@asynccontextmanager
async def lifespan(app):
    """Run the app's startup/shutdown around a block (what TestClient does as a context manager)."""
    async with app.router.lifespan_context(app):
        yield app


async def asgi_request(app, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
                       disconnect_after_chunks: int | None = None, disconnect_after_s: float | None = None):
    """Call the app without a client library; returns (status, headers, body chunks).

    ``disconnect_after_chunks``: the client disconnects once that many non-empty body chunks arrived.
    ``disconnect_after_s``: the client disconnects after that many seconds.
    """
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json")] + \
        [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}
    inbox: asyncio.Queue = asyncio.Queue()
    inbox.put_nowait({"type": "http.request", "body": body or b"", "more_body": False})
    result = {"status": None, "headers": {}, "chunks": []}
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, inbox.put_nowait, {"type": "http.disconnect"})

    async def receive():
        return await inbox.get()

    async def send(message):
        if message["type"] == "http.response.start":
            result["status"] = message["status"]
            result["headers"] = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body" and message.get("body"):
            result["chunks"].append(message["body"])
            if disconnect_after_chunks is not None and len(result["chunks"]) == disconnect_after_chunks:
                inbox.put_nowait({"type": "http.disconnect"})
        if message["type"] == "http.response.body" and not message.get("more_body"):
            inbox.put_nowait({"type": "http.disconnect"})

    await app(scope, receive, send)
    return result["status"], result["headers"], result["chunks"]
