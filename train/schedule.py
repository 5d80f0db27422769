"""The order and pace of a training run: which micro-batches each epoch sees (:func:`epoch_batches`) and the
learning-rate schedule (:func:`lr_lambda`, linear warmup then cosine decay, as in the EAGLE-3 and SpecForge
recipes). Both are pure functions of the config's numbers, so a resumed run continues the same sequence."""

from __future__ import annotations

import math
import random


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Micro-batches of sample indices for one epoch: shuffled, grouped by similar length (within windows of
    ``64 * batch_size``) to limit padding, batch order shuffled; deterministic in ``(seed, epoch)``."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = 64 * batch_size
    batches = []
    for i in range(0, len(order), window):
        chunk = sorted(order[i:i + window], key=lambda j: lengths[j])
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    batches = [b for b in batches if len(b) == batch_size]
    rng.shuffle(batches)
    return batches


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f
