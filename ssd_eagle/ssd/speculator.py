"""The speculator of speculative speculative decoding (SSD; Kumar, Dao, May 2026, Alg. 1 "Saguaro").

For every sequence the speculator keeps the committed text, its draft cache, the proposal it last returned and the
*speculation cache*: a map ``(k, bonus) -> next proposal`` built while the target verifies. A round:

1. ``propose``: the verifier reports the outcome ``(k, bonus)`` of its last verification; the speculator commits
   ``s_1..s_k, bonus``, looks the outcome up (a *hit* returns the cached proposal at once) and otherwise runs the
   backup: ``neural`` (the draft drafts K tokens now) or ``fast`` (n-gram lookup). A miss in one row never redrafts
   the others. The reply goes out first.
2. ``build`` (while the target verifies that reply): one forward over ``[last committed, s_1..s_K]`` gives the
   draft distribution after each prefix ``s_1..s_j``; outcome k's bonus candidates are the top-F_k tokens there,
   excluding ``s_{k+1}`` (an equal bonus would have been an acceptance). Then all ``sum_k F_k`` branches
   ``(k, b)`` draft K tokens together, one batched tree-masked forward per step: K + 1 forwards per round whatever
   the fan-out.

Every proposal, cached or backup, carries the q it was sampled from (None for greedy rows and for n-gram
proposals, which are point masses), so the verifier's ratio test keeps the output law the target's at any
temperature, Saguaro scaling and fan-out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ssd_eagle.drafters.base import SaguaroSampling, sample_draft_tokens
from ssd_eagle.drafters.ngram import lookup_continuation
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.backends import DraftBackend


@dataclass
class SpecRequest:
    """One row of a propose call (what the verifier sends).

    Attributes:
        slot: the sequence's slot.
        num_accepted: k of the verifier's last round, or -1 for the first round after ``add`` (no lookup).
        bonus: the bonus token of that round (ignored when ``num_accepted == -1``).
        budget: most tokens to propose (0..K).
        aux: float [k + 1, 3 * H_target], aux states of the verified inputs now committed (EAGLE-3), else None.
    """

    slot: int
    num_accepted: int
    bonus: int
    budget: int
    aux: torch.Tensor | None = None


@dataclass
class SpecReply:
    """A proposal for one row: tokens, the q they were sampled from (None: point masses), and whether the
    speculation cache answered (None when there was no lookup)."""

    tokens: list[int]
    q: torch.Tensor | None = None
    hit: bool | None = None
    lookup_k: int | None = None


@dataclass
class _Draft:
    tokens: list[int]
    q: torch.Tensor | None  # [m, V] or None
    hidden: torch.Tensor | None  # EAGLE-3: [m, H], hidden[j] = the output whose logits gave tokens[j]


@dataclass
class _Seq:
    slot: int
    token_ids: list[int]
    params: SamplingParams
    draft_generator: torch.Generator
    num_cached: int = 0  # first token position whose draft cache entry is not valid for the committed text
    pending: torch.Tensor | None = None  # EAGLE-3 features of token positions num_cached .. len(token_ids) - 1
    proposal: _Draft | None = None
    path_base: int = 0  # len(token_ids) when the proposal was made
    cache: dict[tuple[int, int], _Draft] = field(default_factory=dict)
    candidates: list[list[int]] = field(default_factory=list)  # per k, best first (bonus-rank statistics)


@dataclass
class SpeculatorStats:
    """What the speculator measured: hits/lookups per k and the rank of every true bonus among its candidates
    at that position (-1: not among them), the input of the fan-out fitter."""

    lookups: int = 0
    hits: int = 0
    bonus_ranks: list[int] = field(default_factory=list)
    build_time: float = 0.0
    builds: int = 0


class Speculator:
    """Speculation cache, outcome prediction, branch drafting and backups for many sequences.

    Args:
        backend: the draft (:mod:`ssd_eagle.ssd.backends`).
        num_speculative_tokens: K.
        fanout: F_0..F_K used after a hit (and after the first round).
        fanout_miss: F_0..F_K used after a miss (default: ``fanout``).
        backup: ``neural``, ``fast`` or ``auto`` (fast from ``fast_backup_batch`` rows up, as the paper suggests).
        saguaro: Saguaro sampling (C and the fan-out it scales with); None = plain sampling.
        prompt_lookup: (min_n, max_n) of the fast backup.

    Raises:
        ValueError: fan-out lists of the wrong length or an unknown backup.
    """

    def __init__(self, backend: DraftBackend, num_speculative_tokens: int, fanout: list[int],
                 fanout_miss: list[int] | None = None, backup: str = "neural", fast_backup_batch: int = 8,
                 saguaro: SaguaroSampling | None = None, prompt_lookup: tuple[int, int] = (1, 4)):
        K = num_speculative_tokens
        for name, f in (("fanout", fanout), ("fanout_miss", fanout_miss)):
            if f is not None and len(f) != K + 1:
                raise ValueError(f"{name} needs K + 1 = {K + 1} entries (F_0..F_K), got {len(f)}")
        if backup not in ("neural", "fast", "auto"):
            raise ValueError(f"backup must be 'neural', 'fast' or 'auto', got {backup!r}")
        self.backend = backend
        self.K = K
        self.fanout = list(fanout)
        self.fanout_miss = list(fanout_miss) if fanout_miss is not None else list(fanout)
        self.backup = backup
        self.fast_backup_batch = fast_backup_batch
        self.saguaro = saguaro
        self.prompt_lookup = prompt_lookup
        self.seqs: dict[int, _Seq] = {}
        self.stats = SpeculatorStats()
        self._to_build: list[tuple[_Seq, bool]] = []

    # sequence lifetime
    def add(self, slot: int, token_ids: list[int], params: SamplingParams, seed: int,
            aux: torch.Tensor | None = None) -> None:
        """Start a sequence: ``token_ids`` = prompt + first sampled token; ``aux`` = the target's aux states of the
        prompt (EAGLE-3)."""
        device = self.backend.device
        seq = _Seq(slot, list(token_ids), params, torch.Generator(device).manual_seed(seed))
        seq.pending = self.backend.prefill(slot, seq.token_ids, aux)
        seq.num_cached = len(token_ids) - 1
        self.seqs[slot] = seq

    def remove(self, slot: int) -> None:
        self.seqs.pop(slot, None)

    # a round
    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[SpecReply]:
        """Commit each row's outcome, answer from the speculation cache or the backup, and remember what to
        build. Call :meth:`build` after the reply has gone out."""
        replies: list[SpecReply | None] = [None] * len(requests)
        misses: list[int] = []
        self._to_build = []
        for i, req in enumerate(requests):
            seq = self.seqs[req.slot]
            hit = None
            if req.num_accepted >= 0:
                hit = self._commit(seq, req)
            if hit is not None and hit:
                entry = seq.cache[(req.num_accepted, req.bonus)]
                m = min(req.budget, len(entry.tokens))
                draft = _Draft(entry.tokens[:m], None if entry.q is None else entry.q[:m],
                               None if entry.hidden is None else entry.hidden[:m])
                replies[i] = self._reply(seq, draft, hit=True, lookup_k=req.num_accepted)
            else:
                misses.append(i)
                replies[i] = SpecReply([], hit=hit, lookup_k=req.num_accepted if hit is not None else None)
            seq.cache = {}
            self._to_build.append((seq, hit is not None and not hit))
        if misses:
            fast = self.backup == "fast" or (self.backup == "auto" and len(requests) >= self.fast_backup_batch)
            rows = [self.seqs[requests[i].slot] for i in misses]
            budgets = [requests[i].budget for i in misses]
            drafts = self._fast_backup(rows, budgets) if fast else self._neural_backup(rows, budgets)
            for i, seq, draft in zip(misses, rows, drafts):
                replies[i] = self._reply(seq, draft, hit=replies[i].hit, lookup_k=replies[i].lookup_k)
        return replies

    def _commit(self, seq: _Seq, req: SpecRequest) -> bool:
        """Apply the verifier's outcome; return whether the speculation cache holds it."""
        k, bonus = req.num_accepted, req.bonus
        proposal = seq.proposal
        accepted = proposal.tokens[:k] if proposal is not None else []
        seq.token_ids.extend(accepted + [bonus])
        if self.backend.needs_aux:
            new = self.backend.fuse(req.aux)
            seq.pending = new if seq.pending is None else torch.cat([seq.pending, new])
        elif proposal is not None:
            seq.num_cached = seq.path_base + k
        if k < len(seq.candidates):
            cands = seq.candidates[k]
            self.stats.bonus_ranks.append(cands.index(bonus) if bonus in cands else -1)
        self.stats.lookups += 1
        hit = (k, bonus) in seq.cache
        self.stats.hits += hit
        return hit

    def _reply(self, seq: _Seq, draft: _Draft, hit: bool | None, lookup_k: int | None) -> SpecReply:
        seq.proposal = draft
        seq.path_base = len(seq.token_ids)
        return SpecReply(list(draft.tokens), draft.q, hit, lookup_k)

    # backups
    def _fast_backup(self, rows: list[_Seq], budgets: list[int]) -> list[_Draft]:
        min_n, max_n = self.prompt_lookup
        return [_Draft(lookup_continuation(np.asarray(s.token_ids, dtype=np.int64), b, min_n, max_n), None, None)
                for s, b in zip(rows, budgets)]

    def _neural_backup(self, rows: list[_Seq], budgets: list[int]) -> list[_Draft]:
        """Draft up to ``budgets[i]`` tokens from the committed text: one forward over the uncached tokens, then
        one per further token. Writes only past ``num_cached`` (the build step rewrites that region)."""
        drafts = [_Draft([], None, None) for _ in rows]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return drafts
        b = self.backend
        chunks = [rows[i].token_ids[rows[i].num_cached:] for i in active]
        feats = [rows[i].pending for i in active] if b.needs_aux else None
        logits, hidden = self._run([rows[i] for i in active], chunks, [rows[i].num_cached for i in active], feats,
                                   last_only=True)
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        hs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for position in range(max(budgets[i] for i in active)):
            tokens, q = sample_draft_tokens(logits, [rows[i] for i in active], position, self.saguaro)
            for j, i in enumerate(active):
                drafts[i].tokens.append(int(tokens[j]))
                if q[j] is not None:
                    qs[i].append(q[j])
                if hidden is not None:
                    hs[i].append(hidden[j])
            keep = [j for j, i in enumerate(active) if len(drafts[i].tokens) < budgets[i]]
            if not keep:
                break
            active = [active[j] for j in keep]
            starts = [len(rows[i].token_ids) - 1 + len(drafts[i].tokens) for i in active]
            feats = [hidden[j: j + 1] for j in keep] if hidden is not None else None
            logits, hidden = self._run([rows[i] for i in active], [[drafts[i].tokens[-1]] for i in active], starts,
                                       feats, last_only=True)
        for i, d in enumerate(drafts):
            d.q = torch.stack(qs[i]) if qs.get(i) else None
            d.hidden = torch.stack(hs[i]) if hs.get(i) else None
        return drafts

    def _run(self, rows: list[_Seq], tokens: list[list[int]], starts: list[int], features: list | None,
             last_only: bool):
        """Causal forward of ``tokens[b]`` at token positions ``starts[b]..``; returns logits (and outputs) at
        every position, or at each row's last position when ``last_only``."""
        b = self.backend
        kv_starts = [s - b.offset for s in starts]
        batch = ForwardBatch.causal(tokens, [r.slot for r in rows], kv_starts, b.dtype, b.device)
        feats = None
        if b.needs_aux:
            n = batch.input_ids.shape[1]
            feats = torch.zeros(len(rows), n, b.hidden_size, dtype=b.dtype, device=b.device)
            for row, f in enumerate(features):
                feats[row, : f.shape[0]] = f
        logits, hidden = b.forward(batch, feats)
        if not last_only:
            return logits, hidden
        last = torch.tensor([len(t) - 1 for t in tokens], device=logits.device)
        rows_idx = torch.arange(len(rows), device=logits.device)
        return logits[rows_idx, last], (hidden[rows_idx, last] if hidden is not None else None)

    # building the speculation cache
    @torch.inference_mode()
    def build(self) -> None:
        """Pre-draft the next proposal for every predicted outcome of the rows of the last :meth:`propose`."""
        import time

        start = time.perf_counter()
        rows = [(seq, missed) for seq, missed in self._to_build if seq.slot in self.seqs and seq.proposal is not None]
        self._to_build = []
        if not rows:
            return
        seqs = [s for s, _ in rows]
        path_logits, path_hidden = self._path_forward(seqs)
        branches = []  # per row: list of (k, bonus)
        for r, (seq, missed) in enumerate(rows):
            m = len(seq.proposal.tokens)
            fan = self.fanout_miss if missed else self.fanout
            seq.candidates = []
            row_branches = []
            for k in range(m + 1):
                f = fan[k] if k < m else fan[self.K]
                order = path_logits[r][k].topk(min(f + 1, path_logits[r].shape[-1])).indices.tolist()
                if k < m:
                    order = [t for t in order if t != seq.proposal.tokens[k]]
                cands = order[:f]
                seq.candidates.append(cands)
                row_branches.extend((k, t) for t in cands)
            branches.append(row_branches)
        self._draft_branches(seqs, branches, path_hidden)
        self.stats.build_time += time.perf_counter() - start
        self.stats.builds += 1

    def _path_forward(self, seqs: list[_Seq]):
        """One forward over ``[uncached committed tokens, s_1..s_m]`` per row: the draft distributions after the
        last committed token and after each ``s_j`` (m + 1 per row, as lists of [m+1, V]) and, for EAGLE-3, the
        outputs at those positions (the parents of the branches)."""
        b = self.backend
        tokens, starts, feats = [], [], []
        for seq in seqs:
            tokens.append(seq.token_ids[seq.num_cached:] + seq.proposal.tokens)
            starts.append(seq.num_cached)
            if b.needs_aux:
                hid = seq.proposal.hidden
                m = len(seq.proposal.tokens)
                if hid is None or hid.shape[0] < m:  # an n-gram proposal: no outputs to feed back, reuse the last
                    hid = seq.pending[-1:].expand(m, -1)
                feats.append(torch.cat([seq.pending, hid[:m]]))
        logits, hidden = self._run(seqs, tokens, starts, feats if b.needs_aux else None, last_only=False)
        out_logits, out_hidden = [], []
        for r, seq in enumerate(seqs):
            m = len(seq.proposal.tokens)
            first = len(seq.token_ids) - 1 - seq.num_cached  # index of the last committed token in the chunk
            out_logits.append(logits[r, first: first + m + 1])
            out_hidden.append(hidden[r, first: first + m + 1] if hidden is not None else None)
        return out_logits, out_hidden

    def _draft_branches(self, seqs: list[_Seq], branches: list[list[tuple[int, int]]],
                        path_hidden: list[torch.Tensor | None]) -> None:
        """Draft K tokens for every branch of every row: K tree-masked forwards over all branches at once."""
        b = self.backend
        B, F = len(seqs), max(len(br) for br in branches)
        if F == 0:
            return
        device = b.device
        N = torch.tensor([len(s.token_ids) for s in seqs])
        m = torch.tensor([len(s.proposal.tokens) for s in seqs])
        k = torch.zeros(B, F, dtype=torch.long)
        tokens = torch.zeros(B, F, dtype=torch.long)
        real = torch.zeros(B, F, dtype=torch.bool)
        for r, br in enumerate(branches):
            if br:
                k[r, : len(br)] = torch.tensor([kk for kk, _ in br])
                tokens[r, : len(br)] = torch.tensor([t for _, t in br])
                real[r, : len(br)] = True
        tree_start = (N + m - b.offset)[:, None]  # first cache position past the path
        prefix_len = N[:, None] + k - b.offset  # path cache positions each branch sees
        feats = None
        if b.needs_aux:
            feats = torch.zeros(B, F, b.hidden_size, dtype=b.dtype, device=device)
            for r, br in enumerate(branches):
                for i, (kk, _) in enumerate(br):
                    feats[r, i] = path_hidden[r][kk]
        gen_seqs = [seqs[r] for r in range(B) for _ in range(F)]
        out_tokens = torch.zeros(B, F, self.K, dtype=torch.long)
        out_q: list[list[torch.Tensor]] = [[] for _ in range(B * F)]
        out_h: list[list[torch.Tensor]] = [[] for _ in range(B * F)]
        branch_idx = torch.arange(F)[None, :]
        for t in range(self.K):
            write = tree_start + t * F + branch_idx  # [B, F]
            kv_len = int(write.max()) + 1
            cols = torch.arange(kv_len)[None, None, :]
            own = (cols >= tree_start[..., None]) & ((cols - tree_start[..., None]) % F == branch_idx[..., None]) & \
                (cols <= write[..., None])
            visible = (cols < prefix_len[..., None]) | own
            positions = N[:, None] + k + t - b.offset
            batch = ForwardBatch.build(tokens, positions, write, [s.slot for s in seqs], visible, b.dtype, device,
                                       [len(br) for br in branches])
            logits, hidden = b.forward(batch, feats)
            flat = logits.reshape(B * F, -1)
            nxt, qs = sample_draft_tokens(flat, gen_seqs, t, self.saguaro)
            tokens = nxt.view(B, F).cpu()
            out_tokens[:, :, t] = tokens
            for i, q in enumerate(qs):
                if q is not None:
                    out_q[i].append(q)
            if hidden is not None:
                for i in range(B * F):
                    out_h[i].append(hidden.reshape(B * F, -1)[i])
                feats = hidden
        for r, (seq, br) in enumerate(zip(seqs, branches)):
            for i, key in enumerate(br):
                flat = r * F + i
                seq.cache[key] = _Draft(out_tokens[r, i].tolist(),
                                        torch.stack(out_q[flat]) if out_q[flat] else None,
                                        torch.stack(out_h[flat]) if out_h[flat] else None)
