"""A small causal LM sharing the target's tokenizer, drafting K tokens autoregressively (classic SD).

The draft keeps its own :class:`KVCache` (one slot per sequence, the sequence's target slot index). After a round
with k accepted tokens its cache is valid for the tokens it fed that are now committed: the prompt and earlier
output, plus the first ``min(k, K - 1)`` drafts (the K-th draft is never fed). The next round first feeds the
committed tokens it has not seen (one or two) and then drafts, so every round costs K draft forwards.
With ``tree`` settings it proposes EAGLE-2 dynamic trees instead (the tree's entries are not kept: the next round
feeds the accepted tokens again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.drafters.base import Drafter, Proposal, SaguaroSampling, sample_draft_tokens
from ssd_eagle.drafters.tree import TreeSettings, grow_trees
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.model_runner import ModelRunner


@dataclass
class _DraftState:
    num_cached: int = 0  # draft KV positions valid for the committed sequence
    base: int = 0  # len(token_ids) when the last proposal was made
    fed_drafts: int = 0  # drafts of the last proposal that were fed to the draft model


class DraftModelDrafter(Drafter):
    """Drafts with a transformers causal LM.

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
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab_size:
            raise ValueError(f"draft model vocabulary ({draft_vocab}) must equal the target's ({target_vocab_size})")
        self.runner = ModelRunner(model, num_slots, max_len)
        self.saguaro = saguaro
        self.tree = tree
        self.states: dict[str, _DraftState] = {}

    def add_sequence(self, seq, prompt_aux=None) -> None:
        state = self.states[seq.request_id] = _DraftState()
        prompt = seq.token_ids[:-1]
        batch = ForwardBatch.causal([prompt], [seq.slot], [0], self.runner.dtype, self.runner.device)
        self.runner.forward(batch, compute_logits=False)
        state.num_cached = len(prompt)

    def remove_sequence(self, seq) -> None:
        self.states.pop(seq.request_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        if not active:
            return proposals
        states = [self.states[seqs[i].request_id] for i in active]
        # feed the committed tokens the draft has not seen; its last logits give draft 1
        chunks = [seqs[i].token_ids[st.num_cached:] for i, st in zip(active, states)]
        starts = [st.num_cached for st in states]
        for i, st in zip(active, states):
            st.base, st.fed_drafts = len(seqs[i].token_ids), 0
        last = torch.tensor([[len(c) - 1] for c in chunks])
        batch = ForwardBatch.causal(chunks, [seqs[i].slot for i in active], starts,
                                    self.runner.dtype, self.runner.device)
        logits = self.runner.forward(batch, logits_index=last.to(self.runner.device)).logits[:, 0]
        if self.tree is not None:
            return self._propose_trees(seqs, active, num_tokens, logits, proposals)
        rows = active
        for position in range(max(num_tokens[i] for i in active)):
            row_seqs = [seqs[i] for i in rows]
            tokens, qs = sample_draft_tokens(logits, row_seqs, position, self.saguaro)
            for j, i in enumerate(rows):
                proposals[i].tokens.append(int(tokens[j]))
                if qs[j] is not None:
                    proposals[i].q = qs[j][None] if proposals[i].q is None else torch.cat([proposals[i].q, qs[j][None]])
            keep = [j for j, i in enumerate(rows) if len(proposals[i].tokens) < num_tokens[i]]
            if not keep:
                break
            rows = [rows[j] for j in keep]
            feed = [[int(tokens[j])] for j in keep]
            for i in rows:
                self.states[seqs[i].request_id].fed_drafts += 1
            starts = [len(seqs[i].token_ids) + len(proposals[i].tokens) - 1 for i in rows]
            batch = ForwardBatch.causal(feed, [seqs[i].slot for i in rows], starts,
                                        self.runner.dtype, self.runner.device)
            logits = self.runner.forward(batch).logits[:, 0]
        return proposals

    def _propose_trees(self, seqs, rows, num_tokens, root_logits, proposals):
        slots = [seqs[i].slot for i in rows]
        runner = self.runner

        def step(tokens, feats, positions, write, visible):
            batch = ForwardBatch.build(tokens, positions, write, slots, visible, runner.dtype, runner.device,
                                       [tokens.shape[1]] * len(slots))
            return runner.forward(batch).logits, None

        lengths = torch.tensor([len(seqs[i].token_ids) for i in rows])
        base = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # the committed tokens
        trees = grow_trees(step, root_logits, None, base, region_start=lengths.tolist(),
                           root_position=(lengths - 1).tolist(), settings=self.tree,
                           max_depth=[num_tokens[i] for i in rows])
        for i, tree in zip(rows, trees):
            proposals[i] = Proposal(tree.tokens, parents=tree.parents) if tree.tokens else Proposal([])
        return proposals

    def on_verified(self, seq, num_accepted: int, aux=None) -> None:
        st = self.states[seq.request_id]
        if st.base:  # this sequence drafted in the last round
            st.num_cached = st.base + min(num_accepted, st.fed_drafts)
            st.base = 0
