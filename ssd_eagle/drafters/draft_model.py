"""A small causal LM sharing the target's tokenizer, drafting K tokens autoregressively (classic SD).

The draft keeps its own cache (one slot per sequence, the sequence's target slot index). After a round with k
accepted tokens its cache is valid for the tokens it fed that are now committed: the prompt and earlier output,
plus the first ``min(k, K - 1)`` drafts (the K-th draft is never fed). The next round first feeds the committed
tokens it has not seen (one or two) and then drafts, so every round costs K draft forwards. With ``tree`` settings
it proposes EAGLE-2 dynamic trees instead. The bookkeeping is :class:`~ssd_eagle.drafters.neural.NeuralDrafter`'s,
the model runs in :class:`~ssd_eagle.drafters.backends.DraftLMBackend` (the same code the SSD speculator drafts
with).
"""

from __future__ import annotations

from ssd_eagle.drafters.backends import DraftLMBackend
from ssd_eagle.drafters.base import SaguaroSampling
from ssd_eagle.drafters.neural import NeuralDrafter
from ssd_eagle.drafters.tree import TreeSettings


class DraftModelDrafter(NeuralDrafter):
    """SD with a transformers causal LM.

    Args:
        model: the draft ``*ForCausalLM``; its vocabulary must be the target's.
        target_vocab_size: the target's vocabulary size (checked).
        num_slots: engine's max concurrent sequences.
        max_len: positions per slot.
        saguaro: optional Saguaro sampling of q (chains only).
        tree: propose dynamic trees of this shape instead of chains.

    Raises:
        ValueError: the draft's vocabulary differs from the target's.
    """

    name = "draft_model"

    def __init__(self, model, target_vocab_size: int, num_slots: int, max_len: int,
                 saguaro: SaguaroSampling | None = None, tree: TreeSettings | None = None):
        backend = DraftLMBackend(model, num_slots, max_len)
        if backend.vocab_size != target_vocab_size:
            raise ValueError(f"draft model vocabulary ({backend.vocab_size}) must equal the target's "
                             f"({target_vocab_size})")
        super().__init__(backend, saguaro, tree)
