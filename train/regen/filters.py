"""Deduplication keys and the repetition filter of regenerated text.

A small target decoding greedily often falls into a loop ("the the the", a paragraph restated until the token
budget ends); such a turn teaches the draft the loop, so it is cut (:func:`is_repetitive`). Prompts are deduplicated
by :func:`prompt_key` (case and whitespace ignored).
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\w+|[^\w\s]")


def prompt_key(text: str) -> str:
    """Deduplication key of a prompt: lower case, whitespace runs collapsed to one space."""
    return " ".join(text.split()).lower()


def conversation_key(messages: list[dict]) -> str:
    """Deduplication key of a conversation: the keys of its user turns, in order."""
    return "\n".join(prompt_key(m["content"]) for m in messages if m["role"] == "user")


def is_repetitive(text: str, *, n: int = 4, min_tokens: int = 48, min_distinct: float = 0.35,
                  tail: int = 200, max_line_repeats: int = 4) -> bool:
    """Whether a response is stuck in a loop.

    Tokens are word and punctuation runs. A response is repetitive when, over its last ``tail`` tokens (only
    responses of at least ``min_tokens`` tokens are judged), fewer than ``min_distinct`` of the ``n``-grams are
    distinct, or when one non-empty line of more than 3 tokens occurs ``max_line_repeats`` times or more.
    Ordinary prose and code keep well above 0.35 distinct 4-grams; a loop of period p keeps about p / tail.
    """
    tokens = _TOKEN.findall(text.lower())
    lines = [ln.strip() for ln in text.splitlines() if len(_TOKEN.findall(ln)) > 3]
    if lines and max(lines.count(ln) for ln in set(lines)) >= max_line_repeats:
        return True
    if len(tokens) < min_tokens:
        return False
    window = tokens[-tail:]
    grams = [tuple(window[i: i + n]) for i in range(len(window) - n + 1)]
    return len(set(grams)) / len(grams) < min_distinct
