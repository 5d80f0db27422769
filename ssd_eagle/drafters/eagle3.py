"""The EAGLE-3 head as an SD drafter fed by the target's aux hidden states (Li et al. 2025, EAGLE-3).

Position i of the head pairs a feature with the *next* token: ``(f_i, x_{i+1})``, and its output predicts
``x_{i+2}``. While the target's features exist (every committed position but the last), ``f_i = fc(aux_i)``; while
drafting, the head feeds back its own output as the next feature, so K drafts cost 1 + (K - 1) forwards (the first
also carries the pairs not yet fed). The bookkeeping is :class:`~ssd_eagle.drafters.neural.NeuralDrafter`'s, the
head runs in :class:`~ssd_eagle.drafters.backends.Eagle3Backend` (the same code the SSD speculator drafts with).

Draft logits live in the head's reduced vocabulary; they are mapped to the target's (-inf elsewhere) before
sampling, so q is a distribution over target ids with zeros outside the draft vocabulary. With ``tree`` settings
the drafter proposes EAGLE-2 dynamic trees (:mod:`ssd_eagle.drafters.tree`); tree nodes are fed their parent's
output as the feature.
"""

from __future__ import annotations

from ssd_eagle.drafters.backends import Eagle3Backend
from ssd_eagle.drafters.base import SaguaroSampling
from ssd_eagle.drafters.neural import NeuralDrafter
from ssd_eagle.drafters.tree import TreeSettings


class Eagle3Drafter(NeuralDrafter):
    """SD with an :class:`~ssd_eagle.models.eagle3.Eagle3DraftModel`.

    Args:
        head: the EAGLE-3 head, with the target's embeddings attached (``set_embeddings``).
        num_slots: engine's max concurrent sequences (cache rows; a sequence uses its target slot).
        max_len: positions per slot (sequence plus draft positions).
        saguaro: optional Saguaro sampling of q (chains only).
        tree: propose dynamic trees of this shape instead of chains.
    """

    name = "eagle3"

    def __init__(self, head, num_slots: int, max_len: int, saguaro: SaguaroSampling | None = None,
                 tree: TreeSettings | None = None):
        super().__init__(Eagle3Backend(head, num_slots, max_len), saguaro, tree)
        self.head = self.backend.head

    @classmethod
    def from_pretrained(cls, path: str, target_model, num_slots: int, max_len: int,
                        saguaro: SaguaroSampling | None = None, tree: TreeSettings | None = None) -> Eagle3Drafter:
        """Load a head (our export or a public layout), check it fits the target, share the target's embeddings.

        Raises:
            ValueError: the head does not fit the target (vocabulary, sizes, layer ids, rope, max positions).
            FileNotFoundError: no checkpoint at ``path``.
        """
        from ssd_eagle.models.eagle3_formats import load_eagle3

        param = next(target_model.parameters())
        head = load_eagle3(path, target_config=target_model.config, dtype=param.dtype, device=param.device)
        head.set_embeddings(target_model.get_input_embeddings())
        return cls(head, num_slots, max_len, saguaro, tree)
