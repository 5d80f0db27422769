"""Incremental detokenization with stop strings, safe for streaming.

Text is decoded through a sliding window (the approach of vLLM and text-generation-inference): decode
``ids[prefix:]`` and ``ids[prefix:read]`` and take the difference, so each token costs O(window), leading-space
rules of the tokenizer are respected, and a token that ends in the middle of a multi-byte character (decoded as
U+FFFD) is held back until the character is complete. Stop strings are searched in the text as it grows; the text
is cut before the stop string (or after it with ``include_stop_str_in_output``). While a request runs, the last
``len(longest stop) - 1`` characters are held back from streaming, since they could begin a stop string, so the
joined stream always equals the final text.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens used as left context for the first output token


class IncrementalDetokenizer:
    """Turns output tokens into text, one token at a time.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt (its tail is decoding context only; it is never part of the text).
        stop: stop strings.
        include_stop_str_in_output: keep the matched stop string.
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.text = ""
        self.emitted = 0  # characters of text already handed out by next_delta
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stop_matched: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token_id: int) -> bool:
        """Append one output token. Returns True when a stop string completed (the text is then final)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> None:
        """Decode what is still held back (an incomplete character at the end of the output)."""
        if self.stop_matched is None and self.read_offset < len(self.ids):
            self._advance(final=True)

    def _advance(self, final: bool) -> bool:
        prefix_text = self._decode(self.ids[self.prefix_offset: self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return False
        before = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(before)

    def _check_stop(self, before: int) -> bool:
        for stop in self.stop:
            idx = self.text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1:
                self.text = self.text[: idx + len(stop) if self.include_stop else idx]
                self.stop_matched = stop
                return True
        return False

    def next_delta(self, finished: bool) -> str:
        """Text not yet handed out. While running, holds back what could still become a stop string."""
        end = len(self.text) if finished or self.stop_matched is not None else max(
            self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted: end]
        self.emitted = end
        return delta
