"""Request and response schemas of the OpenAI-compatible API (OpenAI's field names and shapes; vLLM's extras).

Requests are validated strictly (JSON types are not coerced: ``"16"`` is not an integer; numbers must be finite:
``"temperature": Infinity`` or ``NaN`` is refused) and unknown fields are rejected, so nothing a client sends is
silently ignored. The sampling fields take their constraints from the types of :mod:`ssd_eagle.sampling_params`.
Fields that OpenAI defines but this server does not implement are accepted only at their neutral value (``n=1``,
``presence_penalty=0``, ``echo=false`` ...); :meth:`CompletionRequest.check_supported` /
:meth:`ChatCompletionRequest.check_supported` raise :class:`RequestError` naming the parameter otherwise.

Extras beyond OpenAI (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``. Responses add ``spec_stats`` (see :meth:`ssd_eagle.stats.SpecStats.summary`).
"""

from __future__ import annotations

import codecs
import functools
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from ssd_eagle.engine.sequence import TokenLogprob
from ssd_eagle.sampling_params import (Logprobs, MaxTokens, SamplingParams, Seed, Stop, StopTokenIds, Temperature,
                                       TopK, TopP)
from ssd_eagle.schema import ConfigModel


class RequestError(ValueError):
    """A request the server refuses with 400 (OpenAI ``invalid_request_error``).

    Attributes:
        param: the offending request field (``messages[0].content``), or None.
        code: a short machine-readable code, or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# ---------------------------------------------------------------------------------------------------- requests
class StreamOptions(ConfigModel):
    include_usage: bool = False


class TextContentPart(ConfigModel):
    """One part of a message's ``content`` array; only ``{"type": "text", "text": ...}`` is supported."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(f"content part type {data.get('type')!r} is not supported; only 'text' parts are")
        return data


class ChatMessage(ConfigModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart]
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") in ("tool", "function"):
            raise ValueError(f"role {data['role']!r} is not supported (this server does not support tools)")
        return data

    def to_template(self) -> dict:
        """The message as chat templates expect it (text parts joined with newlines, as vLLM does)."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class _SamplingRequest(ConfigModel):
    """Fields shared by both endpoints."""

    model: str | None = None  # None: the served model (vLLM accepts that too)
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect on decoding
    # vLLM extras
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _check_common(self) -> None:
        unsupported = [
            ("n", self.n != 1, "only n=1 is supported"),
            ("presence_penalty", self.presence_penalty != 0, "presence_penalty is not supported (must be 0)"),
            ("frequency_penalty", self.frequency_penalty != 0, "frequency_penalty is not supported (must be 0)"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("stream_options", self.stream_options is not None and not self.stream,
             "stream_options is only allowed when stream is true"),
        ]
        for param, bad, message in unsupported:
            if bad:
                raise RequestError(message, param, "unsupported_parameter")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; omitted fields take OpenAI's defaults (temperature 1, top_p 1).

        Raises:
            RequestError: a value SamplingParams rejects (param = the field it names); the request's own fields
                are already checked against the same constraints, so only ``max_tokens`` can get here.
        """
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
                logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            param = str(first["loc"][0]) if first["loc"] else None
            raise RequestError(f"invalid value for '{param}': {first['msg']}", param) from err


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions`` (OpenAI legacy completions). ``prompt`` is text or token ids (one prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Raises RequestError naming the first unsupported parameter."""
        self._check_common()
        if self.echo:
            raise RequestError("echo is not supported", "echo", "unsupported_parameter")
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix", "unsupported_parameter")
        if self.best_of not in (None, 1):
            raise RequestError("only best_of=1 is supported", "best_of", "unsupported_parameter")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a one-element batch is unwrapped).

        Raises:
            RequestError: an empty prompt, or several prompts in one request.
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError("batched prompts are not supported: send one prompt per request", "prompt",
                                   "unsupported_parameter")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise RequestError("prompt must not be empty", "prompt")
        return prompt


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    def check_supported(self) -> None:
        """Raises RequestError naming the first unsupported parameter."""
        self._check_common()
        if not self.messages:
            raise RequestError("messages must not be empty", "messages")
        for param in ("tools", "functions"):
            if getattr(self, param):
                raise RequestError(f"{param} are not supported by this server", param, "unsupported_parameter")
        for param in ("tool_choice", "function_call"):
            if getattr(self, param) not in (None, "none"):
                raise RequestError(f"{param} is not supported by this server", param, "unsupported_parameter")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise RequestError("only response_format {\"type\": \"text\"} is supported", "response_format",
                               "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many top alternatives to return."""
        return (self.top_logprobs or 0) if self.logprobs else None


# --------------------------------------------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ssd-eagle"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """OpenAI legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` objects; streamed chunks have the same shape with the delta as ``text``."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_stats: dict | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: dict | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    spec_stats: dict | None = None


def dump_chunk(chunk: BaseModel, include_usage: bool) -> dict:
    """A response or chunk as a JSON-ready dict: ``spec_stats`` only where set, ``usage`` (null on intermediate
    chunks) only when the client asked for it (OpenAI's ``stream_options.include_usage``); delta fields that are
    None are dropped."""
    data = chunk.model_dump()
    if data.get("spec_stats") is None:
        data.pop("spec_stats", None)
    if not include_usage and data.get("usage") is None:
        data.pop("usage", None)
    for choice in data.get("choices", []):
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return data


# --------------------------------------------------------------------------------------------- token strings
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Per-token strings and bytes for logprobs (OpenAI's conventions), cached per token id.

    ``bytes_of(id)`` is the token's exact UTF-8 bytes (byte-level BPE and SentencePiece byte-fallback vocabularies
    are mapped exactly; others fall back to the decoded text). ``text_of(id)`` is the decoded text, or OpenAI's
    ``"bytes:\\xNN..."`` form when the token is not valid UTF-8 on its own (part of a multi-byte character).
    Read-only tokenizer calls only, so it may run beside the engine thread.
    """

    def __init__(self, tokenizer, cache_size: int = 1 << 16):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_map = _byte_level_decoder()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.bytes_of = functools.lru_cache(maxsize=cache_size)(self._bytes_of)
        self.text_of = functools.lru_cache(maxsize=cache_size)(self._text_of)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is not None and token_id not in self._special:
            if self._byte_level and all(c in self._byte_map for c in piece):
                return bytes(self._byte_map[c] for c in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def _text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class CompletionLogprobsBuilder:
    """OpenAI legacy completions logprobs of one request, built a step at a time (streamed chunks continue the
    offsets). ``text_offset`` is the character offset in the completion text where each token starts; a token
    that ends inside a multi-byte character starts at the offset of that character."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self._offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(self, entries: list[TokenLogprob]) -> CompletionLogprobs:
        texts, out = self.texts, CompletionLogprobs()
        for entry in entries:
            out.tokens.append(texts.text_of(entry.token_id))
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append({texts.text_of(t): lp for t, lp in entry.top.items()})
            out.text_offset.append(self._offset)
            self._offset += len(self._utf8.decode(texts.bytes_of(entry.token_id)))
        return out


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> ChatLogprobs:
    """OpenAI chat logprobs (``{"content": [{token, logprob, bytes, top_logprobs}]}``) for ``entries``."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=texts.text_of(token_id), logprob=logprob, bytes=list(texts.bytes_of(token_id)))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                         top_logprobs=[top(t, lp) for t, lp in e.top.items()])
        for e in entries])
