"""The EAGLE-3 head as a chain drafter fed by the target's aux hidden states (Li et al. 2025, EAGLE-3).

Position i of the head pairs a feature with the *next* token: ``(f_i, x_{i+1})``, and its output predicts
``x_{i+2}``. While the target's features exist (every committed position but the last), ``f_i = fc(aux_i)``; while
drafting, the head feeds back its own output as the next feature. So for a sequence of N committed tokens:

- the head's cache holds pairs ``0 .. N-2`` built from target features (``num_fed = N - 1``);
- drafting step 1 reads the output at pair N-2 (``d_1``); step j > 1 feeds ``(g_{N-3+j}, d_{j-1})`` at
  position ``N-3+j``, so K drafts cost 1 + (K - 1) forwards (the first also carries the pairs not yet fed);
- after the target accepts k drafts, the k + 1 verified positions ``N-1 .. N-1+k`` come with target features, and
  replace the head's self-fed entries there (which are simply overwritten: ``num_fed`` never counted them).

Draft logits live in the head's reduced vocabulary; they are mapped to the target's (-inf elsewhere) before
sampling, so q is a distribution over target ids with zeros outside the draft vocabulary.

With ``tree`` settings the drafter proposes EAGLE-2 dynamic trees (:mod:`ssd_eagle.drafters.tree`) instead of
chains; tree nodes are fed their parent's output as the feature, and after verification the head's cache is
rebuilt for the accepted branch from the target's features exactly as for a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_eagle.drafters.base import Drafter, Proposal, SaguaroSampling, sample_draft_tokens
from ssd_eagle.drafters.tree import TreeSettings, grow_trees
from ssd_eagle.kv_cache import ForwardBatch, KVCache


@dataclass
class _HeadState:
    num_fed: int = 0  # pairs in the head's cache built from target features
    pending: torch.Tensor | None = None  # fused target features [m, H] of pairs num_fed .. num_fed + m - 1


class Eagle3Drafter(Drafter):
    """Chain drafting with an :class:`~ssd_eagle.models.eagle3.Eagle3DraftModel`.

    Args:
        head: the EAGLE-3 head, with the target's embeddings attached (``set_embeddings``).
        num_slots: engine's max concurrent sequences (cache rows; a sequence uses its target slot).
        max_len: positions per slot (sequence plus draft positions).
        saguaro: optional Saguaro sampling of q (chains only).
        tree: propose dynamic trees of this shape instead of chains.
    """

    name = "eagle3"
    needs_aux_hidden = True

    def __init__(self, head, num_slots: int, max_len: int, saguaro: SaguaroSampling | None = None,
                 tree: TreeSettings | None = None):
        self.head = head.eval()
        cfg = head.config
        param = head.lm_head.weight
        self.dtype, self.device = param.dtype, param.device
        self.kv = KVCache(1, num_slots, cfg.num_key_value_heads, cfg.head_dim, max_len, self.dtype, self.device)
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)
        self.saguaro = saguaro
        self.tree = tree
        self.states: dict[str, _HeadState] = {}

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

    def add_sequence(self, seq, prompt_aux: torch.Tensor | None) -> None:
        if prompt_aux is None:
            raise ValueError("the EAGLE-3 drafter needs the target's aux hidden states of the prompt")
        state = self.states[seq.request_id] = _HeadState()
        with torch.inference_mode():
            fused = self.head.fuse(prompt_aux.to(self.dtype))  # pairs 0 .. P-1 (P = prompt length)
        if fused.shape[0] > 1:  # feed all but the last pair now; propose() feeds it and reads draft 1 from it
            self._feed([seq], [fused[:-1]], [0], logits=False)
            state.num_fed = fused.shape[0] - 1
        state.pending = fused[-1:]

    def remove_sequence(self, seq) -> None:
        self.states.pop(seq.request_id, None)

    def on_verified(self, seq, num_accepted: int, aux: torch.Tensor | None) -> None:
        state = self.states[seq.request_id]
        with torch.inference_mode():
            fused = self.head.fuse(aux.to(self.dtype))
        state.pending = fused if state.pending is None else torch.cat([state.pending, fused])

    @torch.inference_mode()
    def _feed(self, seqs: list, features: list[torch.Tensor], starts: list[int], logits: bool = True):
        """Run pairs ``(features[b][i], token_ids[starts[b] + i + 1])`` at positions ``starts[b] + i``.
        Returns (logits of each row's last pair [B, V_target] or None, each row's last output [B, H])."""
        tokens = [seq.token_ids[s + 1: s + 1 + f.shape[0]] for seq, f, s in zip(seqs, features, starts)]
        batch = ForwardBatch.causal(tokens, [s.slot for s in seqs], starts, self.dtype, self.device)
        n = batch.input_ids.shape[1]
        hidden = torch.zeros(len(seqs), n, features[0].shape[-1], dtype=self.dtype, device=self.device)
        for row, f in enumerate(features):
            hidden[row, : f.shape[0]] = f
        out = self.head(batch.input_ids, hidden, batch.position_ids, batch.attn_mask, self.kv.bind(batch))
        last = out[torch.arange(len(seqs)), torch.tensor([f.shape[0] - 1 for f in features])]
        return (self.head.to_target_logits(self.head.compute_logits(last)) if logits else None), last

    @torch.inference_mode()
    def propose(self, seqs: list, num_tokens: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        rows = [i for i, k in enumerate(num_tokens) if k > 0]
        if not rows:
            return proposals
        states = [self.states[seqs[i].request_id] for i in rows]
        logits, last = self._feed([seqs[i] for i in rows], [st.pending for st in states],
                                  [st.num_fed for st in states])
        for i, st in zip(rows, states):
            st.num_fed += st.pending.shape[0]
            st.pending = None
        if self.tree is not None:
            return self._propose_trees(seqs, rows, num_tokens, logits, last, proposals)
        qs_per_row: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        for position in range(max(num_tokens[i] for i in rows)):
            tokens, qs = sample_draft_tokens(logits, [seqs[i] for i in rows], position, self.saguaro)
            for j, i in enumerate(rows):
                proposals[i].tokens.append(int(tokens[j]))
                if qs[j] is not None:
                    qs_per_row[i].append(qs[j])
            keep = [j for j, i in enumerate(rows) if len(proposals[i].tokens) < num_tokens[i]]
            if not keep:
                break
            rows, tokens, last = [rows[j] for j in keep], tokens[keep], last[keep]
            starts = [len(seqs[i].token_ids) - 2 + len(proposals[i].tokens) for i in rows]
            batch = ForwardBatch.causal([[int(t)] for t in tokens], [seqs[i].slot for i in rows], starts,
                                        self.dtype, self.device)
            out = self.head(batch.input_ids, last[:, None], batch.position_ids, batch.attn_mask,
                            self.kv.bind(batch))
            last = out[:, 0]
            logits = self.head.to_target_logits(self.head.compute_logits(last))
        for i, qs in qs_per_row.items():
            if qs:
                proposals[i].q = torch.stack(qs)
        return proposals

    def _propose_trees(self, seqs, rows, num_tokens, root_logits, root_hidden, proposals):
        slots = [seqs[i].slot for i in rows]

        def step(tokens, feats, positions, write, visible):
            batch = ForwardBatch.build(tokens, positions, write, slots, visible, self.dtype, self.device,
                                       [tokens.shape[1]] * len(slots))
            out = self.head(batch.input_ids, feats, batch.position_ids, batch.attn_mask, self.kv.bind(batch))
            return self.head.to_target_logits(self.head.compute_logits(out)), out

        lengths = torch.tensor([len(seqs[i].token_ids) for i in rows])
        # pairs 0 .. N-2 hold target features; the tree's region starts right after them
        base = torch.arange(int(lengths.max()) - 1)[None, :] < (lengths - 1)[:, None]
        trees = grow_trees(step, root_logits, root_hidden, base, region_start=(lengths - 1).tolist(),
                           root_position=(lengths - 2).tolist(), settings=self.tree,
                           max_depth=[num_tokens[i] for i in rows])
        for i, tree in zip(rows, trees):
            proposals[i] = Proposal(tree.tokens, parents=tree.parents) if tree.tokens else Proposal([])
        return proposals
