"""A request's state inside the engine, and the outputs handed back to callers (shaped like vLLM's)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ssd_eagle.engine.detokenizer import IncrementalDetokenizer
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.stats import SpecStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Log-probability of an emitted token under the target's raw distribution, with the top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Sequence:
    """One request being decoded.

    Attributes:
        token_ids: prompt followed by the output so far. The target's cache holds every token but the last.
        num_cached: target cache positions that hold committed tokens (``len(token_ids) - 1`` between rounds;
            while the prompt is being prefilled, its tokens cached so far, reused prefix included once the drafter
            has caught up on it: :meth:`~ssd_eagle.prefix_cache.PrefixCache.reuse`).
        num_reused: prompt tokens whose keys/values came from the prefix cache instead of a prefill.
        prompt_aux: the target's aux hidden states of the cached prompt positions so far (float [n, 3H] pieces, in
            order), kept for drafters that need them (``add_sequence``) and for the prefix cache.
        slot: the cache row (target and draft caches) while running, else -1.
        generator: the verifier's random stream (acceptance tests, bonus samples).
        draft_generator: the drafter's random stream (draft samples), independent of the verifier's.
    """

    request_id: str
    prompt: str | None
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator
    draft_generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    slot: int = -1
    num_cached: int = 0
    num_reused: int = 0
    prompt_aux: list[torch.Tensor] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None
    num_reported_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the target's cache yet (no token sampled)."""
        return self.num_cached < self.num_prompt_tokens

    def report(self) -> RequestOutput:
        """The request's output so far, with what is new since its previous report."""
        delta_ids = self.token_ids[self.num_prompt_tokens + self.num_reported_tokens:]
        self.num_reported_tokens = self.num_output_tokens
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            outputs=[CompletionOutput(0, self.detokenizer.text, self.output_token_ids, self.finish_reason,
                                      self.stop_reason, list(self.logprobs) if self.logprobs is not None else None)],
            finished=self.finished, delta_text=self.detokenizer.next_delta(self.finished), delta_token_ids=delta_ids,
            stats=self.stats,
            metrics={"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                     "finish_time": self.finish_time},
        )


@dataclass
class CompletionOutput:
    """One generated completion (vLLM's ``CompletionOutput``; n = 1, so always index 0)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """What :meth:`LLMEngine.step` reports for a request that advanced (vLLM's ``RequestOutput`` plus deltas).

    Attributes:
        outputs: one :class:`CompletionOutput` with the full text and tokens so far.
        delta_text / delta_token_ids: what is new since this request's previous report (for streaming; the joined
            deltas equal the final text).
        stats: the request's speculative decoding statistics (see :mod:`ssd_eagle.stats`).
        metrics: arrival, first-token and finish times (``time.monotonic`` seconds).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str
    delta_token_ids: list[int]
    stats: SpecStats
    metrics: dict

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
