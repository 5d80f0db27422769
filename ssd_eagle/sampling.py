"""Turning logits into the distribution we sample from, and sampling from it with per-request generators.

The same transformation (temperature, then top-k, then top-p on the top-k renormalised distribution, the order
vLLM applies them) is applied to the target's logits (p) and to the draft's logits (q). Rejection sampling is
lossless only when the q it tests with is the q the draft token was sampled from, so every drafter samples from
the output of :func:`logits_to_probs` and hands those very probabilities to the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors, for batched processing.

    Attributes:
        temperature: float [B]; greedy rows hold 1.0 (their probabilities are only used for logprobs).
        top_k: int64 [B]; 0 disables.
        top_p: float [B]; 1.0 disables.
        needs_filter: whether any row uses top-k or top-p (skips a sort over the vocabulary when not).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    needs_filter: bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> SamplingTensors:
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        needs_filter = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        return cls(temperature, top_k, top_p, needs_filter)


def upcast_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32, or float64 when they are (the exactness tests' dtype): every consumer (argmax, softmax,
    top-k) reads them in that precision, as vLLM's sampler does. On CPU a bf16 argmax runs ~5x slower than a float32
    one (0.71 vs 0.13 ms a row of 49152 logits, AMD EPYC avx512_bf16, one thread); the values are unchanged (bf16 and
    fp16 embed exactly in float32), so argmax ties break alike."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Apply temperature, top-k and top-p, and return probabilities.

    Args:
        logits: float [B, ..., V] (any float dtype; computed in float32, or float64 if the logits are float64).
        st: row parameters, each of shape [B].

    Returns:
        probs: [B, ..., V], each row sums to 1; tokens removed by top-k/top-p have probability exactly 0.
    """
    x = upcast_logits(logits)
    dtype = x.dtype
    extra = (1,) * (logits.dim() - 2)
    x = x / st.temperature.to(dtype).view(-1, *extra, 1)
    if st.needs_filter:
        x = _filter_top_k_top_p(x, st.top_k.view(-1, *extra, 1), st.top_p.to(dtype).view(-1, *extra, 1))
    return torch.softmax(x, dim=-1)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_x = sorted_x.masked_fill(mass_before >= top_p, float("-inf"))  # keeps the first token always
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row, exactly from ``probs``, using each row's own generator.

    Inverse-CDF sampling: one ``u ~ U[0, 1)`` per row (:func:`uniforms`) and the first token whose float64
    cumulative mass exceeds ``u * total``; a zero-probability token is never picked (the cumulative mass does not
    grow there). One draw per row instead of V exponentials keeps sampling cheap when many rows are drafted at
    once (the speculator's branches).

    Args:
        probs: float [B, V], non-negative, not necessarily normalised (a residual), each row with positive mass.
        generators: B generators on ``probs.device`` (None: torch's default generator).

    Returns:
        int64 [B] token ids.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    u = uniforms([1] * probs.shape[0], generators, probs.device, torch.float64)
    threshold = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total: in range
    return torch.searchsorted(cdf, threshold, right=True)[:, 0]


def uniforms(counts: list[int], generators: list[torch.Generator | None], device, dtype) -> torch.Tensor:
    """U[0, 1) draws: row b gets ``counts[b]`` from its own generator, so what a row consumes never depends on
    the other rows of the batch (a seeded request reproduces whatever it is batched with).

    Returns:
        [B, max(counts)]; entries past a row's count are 0.
    """
    width = max(counts, default=0)
    out = torch.zeros(len(generators), width, device=device, dtype=dtype)
    if width and _one_stream(generators) and len(set(counts)) == 1:
        return out.uniform_(generator=generators[0])
    for row, (gen, n) in enumerate(zip(generators, counts)):
        if n:
            out[row, :n].uniform_(generator=gen)
    return out


def _one_stream(generators: list[torch.Generator | None]) -> bool:
    """All rows draw from the same stream (one generator object, or all None): one call serves them all."""
    return all(g is generators[0] for g in generators)
