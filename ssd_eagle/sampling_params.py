"""Per-request sampling parameters, named as vLLM names them, and their constraints as types
(:mod:`inference.protocol` builds its request schemas from the same types)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

from ssd_eagle.schema import ConfigModel

MAX_LOGPROBS = 20


def _as_list(value):
    """One string, or a tuple, as a list."""
    return [value] if isinstance(value, str) else list(value) if isinstance(value, tuple) else value


def _no_empty_strings(strings: list[str]) -> list[str]:
    if any(not s for s in strings):
        raise ValueError("stop strings must not be empty")
    return strings


def _top_k_off(k: int) -> int:
    return 0 if k == -1 else k


MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1), AfterValidator(_top_k_off)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes
Stop = Annotated[list[str], BeforeValidator(_as_list), AfterValidator(_no_empty_strings)]
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_as_list)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class SamplingParams(ConfigModel):
    """How one request is decoded. Field names and defaults follow ``vllm.SamplingParams``.

    Attributes:
        max_tokens: hard cap on generated tokens (>= 1), honoured even when a whole draft block is accepted.
        temperature: 0 means greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it (-1 is stored as 0).
        seed: seeds the request's own random generator (reproducible sampling, a signed 64-bit integer); None draws
            a fresh seed.
        stop: strings that end generation (one string or a list); the stop string itself is not returned unless
            ``include_stop_str_in_output``.
        stop_token_ids: extra token ids that end generation (besides the model's EOS ids).
        ignore_eos: keep generating past EOS tokens.
        logprobs: number of top alternatives (0-20) to return with each token's log-probability (None: no
            logprobs). Log-probabilities are the target's, from its raw logits.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the returned text.

    Raises:
        ValueError: an unknown field, a value of the wrong type or out of range (a number that is not finite
            included); the message names the field.
    """

    max_tokens: MaxTokens = Field(16, description="hard cap on generated tokens")
    temperature: Temperature = Field(1.0, description="0: greedy; > 0: sample from softmax(logits / temperature)")
    top_p: TopP = Field(1.0, description="nucleus mass in (0, 1]; 1 disables it")
    top_k: TopK = Field(0, description="keep the k most likely tokens; 0 or -1 disables it")
    seed: Seed | None = Field(None, description="the request's own seed")
    stop: Stop = Field(default_factory=list, description="stop string")
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Logprobs | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0
