"""The speculator of speculative speculative decoding (SSD; Kumar, Dao, May 2026, Alg. 1 "Saguaro").

For every sequence the speculator keeps the committed text, its draft cache, the proposal it last returned and the
*speculation cache*: a map ``(accepted tokens, bonus) -> next proposal`` built while the target verifies. For a
chain the accepted tokens are ``s_1..s_k``, so the key is the paper's ``(k, bonus)``. A round:

1. ``propose``: the verifier reports the outcome of its last verification; the speculator commits it, looks it up
   (a *hit* returns the cached proposal at once, with no draft work: the round is *seeded* from the cache; EAGLE-3's
   fuse of the outcome's aux states waits for the build) and otherwise runs the backup: ``neural`` (the draft drafts
   now, from the fresh target features for EAGLE-3) or ``fast`` (n-gram lookup). A miss in one row never redrafts
   the others. The reply goes out first; a hit runs no torch op before it (the spent cache is freed by the build),
   and a round whose every row is a plain hit (:meth:`Speculator.peek`) is answered even before it is committed.
2. ``build`` (while the target verifies that reply): one forward over the uncached committed tokens and the
   proposal's nodes gives the draft distribution after every node u. Outcome "the accepted path ends at u"
   gets the top-F_u tokens there as bonus candidates, excluding u's children (an equal bonus would have been an
   acceptance). Every branch ``(path to u, b)`` then drafts its next proposal, all branches of all rows together
   in tree-masked forwards: K forwards for chains, 1 + (depth - 1) for dynamic trees, whatever the fan-out.
   The branches, and a chain's length (L <= K tokens: a draft LM's step can cost a fifth of a verification), are
   capped so that the build fits in a verification (:mod:`ssd_eagle.ssd.budget`); a build still
   running when the next outcome arrives stops before its next forward, and that outcome is answered at once
   from what is complete (a branch enters the cache only once drafted to the end), else by the backup.

Rounds the verifier's planner runs without speculation (:mod:`ssd_eagle.planner`) reach the speculator merged into
the next request (``SpecRequest.rounds > 1``: no lookup), or as a request with budget 0 (committed, answered with an
empty proposal, nothing built). Either way the speculator idles meanwhile, and the tokens committed are fed by the
next backup draft (a probe, or speculation back on; under ``backup: auto`` the neural one), as
:meth:`~ssd_eagle.drafters.neural.NeuralDrafter.catch_up` does in SD. Their aux states are fused every ``FUSE_ROWS``
rows (bounded memory).

Fan-out: chains use F_0..F_K by depth (uniform or geometric, :mod:`ssd_eagle.ssd.fanout`); trees spread the budget
B over nodes by the measured P(the outcome lands at u) x P(bonus rank f there) (:mod:`ssd_eagle.ssd.branch_trees`,
which also drafts the branches: chains and trees).

Every proposal, cached or backup, carries the q it was sampled from (None for greedy rows, trees and n-gram
proposals, which are deterministic), so the verifier's test keeps the output law the target's at any temperature,
Saguaro scaling and fan-out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ssd_eagle.drafters.backends import DraftBackend
from ssd_eagle.drafters.base import Proposal, SaguaroSampling
from ssd_eagle.drafters.neural import FUSE_ROWS, draft_from_committed
from ssd_eagle.drafters.ngram import NgramDrafter
from ssd_eagle.drafters.tree import TreeSettings
from ssd_eagle.kv_cache import ForwardBatch
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.ssd.backup import BackupChoice, worth_finishing
from ssd_eagle.ssd.branch_trees import (NodeHitTable, NodeLayout, branch_batch, draft_branch_chains,
                                        draft_branch_trees, draft_land_probabilities, outcome_branches,
                                        ranked_candidates, tree_fanout)
from ssd_eagle.ssd.budget import BuildBudget, BuildInterrupted, BuildStop
from ssd_eagle.ssd.fanout import AutoFanout
from ssd_eagle.ssd.lookup import SpecRequest, SpeculatorStats

__all__ = ["Speculator", "SpecRequest", "SpeculatorStats"]


@dataclass
class _Seq:
    slot: int
    token_ids: list[int]
    params: SamplingParams
    draft_generator: torch.Generator
    num_cached: int = 0  # first token position whose draft cache entry is not valid for the committed text
    pending: torch.Tensor | None = None  # EAGLE-3 features of token positions num_cached .. (then raw's)
    raw: list[torch.Tensor] = field(default_factory=list)  # EAGLE-3 aux states after pending's, not fused yet
    proposal: Proposal | None = None  # the last reply, with the draft's outputs (EAGLE-3)
    path_base: int = 0  # len(token_ids) when the proposal was made
    fed: bool = False  # whether a build's forward has cached the proposal (an interrupted build may not have)
    built: bool = False  # whether the last build ran to its end
    cache: dict[tuple[tuple[int, ...], int], Proposal] = field(default_factory=dict)
    candidates: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # per accepted path, best first
    nodes: tuple[NodeLayout, list[list[int]], list[float]] | None = None  # the proposal's, ranks, draft's P(land)
    source: str | None = None  # who made the proposal: "hit", "neural" or "fast" (None: none, or a budget of 0)
    after: str | None = None  # the source of the proposal before it (a hit's tokens depend on it: backup.py)


class Speculator:
    """Speculation cache, outcome prediction, branch drafting and backups for many sequences.

    Args:
        backend: the draft (:mod:`ssd_eagle.drafters.backends`, the SD drafters' own).
        num_speculative_tokens: K (chain length, or the depth cap of trees).
        fanout: F_0..F_K used after a hit (and after the first round); for trees its sum is the budget B.
        fanout_miss: F_0..F_K used after a miss (default: ``fanout``).
        backup: ``neural``, ``fast`` or ``auto``: per round the one with the higher measured expected tokens/s,
            fast from ``fast_backup_batch`` rows up (:mod:`ssd_eagle.ssd.backup`).
        saguaro: Saguaro sampling (C and the fan-out it scales with); None = plain sampling.
        prompt_lookup: (min_n, max_n) of the fast backup.
        tree: propose dynamic trees of this shape instead of chains.
        power: r of the hit-rate power law (the tree fan-out), or ``"auto"``: r fitted from the observed bonus ranks
            and a chain's fan-out re-made geometric (same budget) every 50 lookups
            (:class:`~ssd_eagle.ssd.fanout.AutoFanout`).

    Raises:
        ValueError: fan-out lists of the wrong length or an unknown backup.
    """

    def __init__(self, backend: DraftBackend, num_speculative_tokens: int, fanout: list[int],
                 fanout_miss: list[int] | None = None, backup: str = "neural", fast_backup_batch: int = 8,
                 saguaro: SaguaroSampling | None = None, prompt_lookup: tuple[int, int] = (1, 4),
                 tree: TreeSettings | None = None, power: float | str = 1.0):
        K = num_speculative_tokens
        for name, f in (("fanout", fanout), ("fanout_miss", fanout_miss)):
            if f is not None and len(f) != K + 1:
                raise ValueError(f"{name} needs K + 1 = {K + 1} entries (F_0..F_K), got {len(f)}")
        if backup not in ("neural", "fast", "auto"):
            raise ValueError(f"backup must be 'neural', 'fast' or 'auto', got {backup!r}")
        self.backend = backend
        self.K = K
        self.backup = backup
        self.choice = BackupChoice(fast_batch=fast_backup_batch)  # measured in every mode, decides under auto
        self.saguaro = saguaro
        self._own_miss = fanout_miss is not None
        self._set_fanout(list(fanout), list(fanout_miss) if fanout_miss is not None else None)
        self.lookup = NgramDrafter(*prompt_lookup)  # the fast backup
        self.tree = tree
        self.auto = AutoFanout(sum(fanout), K) if power == "auto" else None
        self.power = 1.0 if self.auto is not None else float(power)
        self.seqs: dict[int, _Seq] = {}
        self.stats = SpeculatorStats()
        self.node_table = NodeHitTable(max(sum(self.fanout), sum(self.fanout_miss), 1))  # where outcomes land
        self.budget = BuildBudget()  # caps the branches so that a build fits in one verification
        self._stop = BuildStop()  # when the running build stops early (set by build)
        self._to_build: list[tuple[_Seq, bool]] = []
        self._replied: set[str] = set()  # who made the last round's proposals (hit, neural, fast)
        self._spent: list[dict] = []  # the last round's speculation caches, freed by the build (after the reply)

    def _set_fanout(self, fanout: list[int], fanout_miss: list[int] | None = None) -> None:
        self.fanout = fanout
        self.fanout_miss = fanout_miss if fanout_miss is not None else list(fanout)
        if self.saguaro is not None:
            self.saguaro = SaguaroSampling(self.saguaro.c, tuple(fanout))
        # a backup drafts what is cached with fanout_miss, so its Saguaro scaling uses that fan-out too
        self.saguaro_miss = SaguaroSampling(self.saguaro.c, tuple(self.fanout_miss)) if self.saguaro else None

    # sequence lifetime
    def add(self, slot: int, token_ids: list[int], params: SamplingParams, seed: int,
            aux: torch.Tensor | None = None, start: int = 0, done: bool = True) -> None:
        """Start a sequence (``start = 0``) or go on with its prompt, prefilled chunk by chunk as it arrives:
        ``token_ids`` are its token positions ``start ..``, ``aux`` their target aux states (EAGLE-3); ``done``: the
        last token is the first sampled one (no aux state yet). Raises ValueError for a chunk out of order."""
        if start == 0:
            self.seqs[slot] = _Seq(slot, [], params, torch.Generator(self.backend.device).manual_seed(seed))
        seq = self.seqs[slot]
        if start != len(seq.token_ids):
            raise ValueError(f"a prompt chunk of slot {slot} starts at {start}, after {len(seq.token_ids)} tokens")
        seq.token_ids.extend(token_ids)
        if start == 0:  # (a new slot may need a row)
            self._fit_kv()
        end = len(seq.token_ids) - 1 if done else len(seq.token_ids)
        self._fuse([seq])
        seq.pending = self.backend.prefill(slot, seq.token_ids, aux, seq.num_cached, end, seq.pending)
        seq.num_cached = end

    def remove(self, slot: int) -> None:
        self.seqs.pop(slot, None)
        self._fit_kv()

    def _fit_kv(self) -> None:
        """The draft's store follows the live sequences (KVCache.fit): the longest one plus a round's branches."""
        kv = self.backend.kv
        if self.backend.static is not None and self.backend.static.pads:  # padding rows write the last slot
            return
        width = max(sum(self.fanout), sum(self.fanout_miss)) + 1
        branches = width * (self.K + 1 + (self.tree.depth * self.tree.topk if self.tree is not None else 0))
        need = max((len(s.token_ids) for s in self.seqs.values()), default=0) + branches
        kv.fit(max(self.seqs, default=0) + 1, -(-need // 256) * 256, limit=kv.max_len)

    # a round
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        """Commit each row's outcome, answer from the speculation cache or the backup, and remember what to
        build. Call :meth:`build` after the reply has gone out.

        A hit runs no torch op (no inference-mode switch either) and frees nothing: the spent speculation caches
        (tensors) are freed by the build, after the reply."""
        replies: list[Proposal | None] = [None] * len(requests)
        lookups: list[dict] = []  # per row, what the reply says of its lookup (none in a sequence's first round)
        misses: list[int] = []
        self._to_build, self._spent = [], []
        for i, req in enumerate(requests):
            seq = self.seqs[req.slot]
            hit = self._commit(seq, req) if req.num_accepted >= 0 else None
            lookups.append({} if hit is None else {"cache_hit": hit, "lookup_k": req.num_accepted,
                                                   "fanout": len(seq.cache), "fanout_power": self.stats.fanout_power})
            if hit:
                replies[i] = self._reply(seq, seq.cache[self._key(seq, req)].cut(req.budget), lookups[i], "hit",
                                         req.budget)
            else:
                misses.append(i)
            self._spent += (seq.cache, seq.candidates)
            seq.cache, seq.candidates, seq.built, seq.nodes = {}, {}, False, None
            if req.budget > 0:  # a planned-off round builds nothing (module docstring)
                self._to_build.append((seq, hit is False))
            elif sum(a.shape[0] for a in seq.raw) >= FUSE_ROWS:
                self._fuse([seq])
        if misses:
            rows = [self.seqs[requests[i].slot] for i in misses]
            looked_up = any(lookups[i] for i in misses)
            backup, drafts = self._backup(rows, [requests[i].budget for i in misses], len(requests) - len(misses),
                                          looked_up)
            for i, seq, draft in zip(misses, rows, drafts):
                replies[i] = self._reply(seq, draft, lookups[i], backup, requests[i].budget)
        self._replied = {self.seqs[req.slot].source for req in requests} - {None}
        return replies

    def observe_verify(self, seconds: float) -> None:
        """The verifier's round after the last replies took ``seconds`` (measured by the worker): the build
        budget's V, and auto's V per proposal source (:mod:`ssd_eagle.ssd.backup`)."""
        self.budget.observe_verify(seconds)
        self.choice.observe_verify(self._replied, seconds)

    def _key(self, seq: _Seq, req: SpecRequest) -> tuple[tuple[int, ...], int]:
        accepted = req.accepted if req.accepted is not None else seq.proposal.tokens[: req.num_accepted]
        return tuple(accepted), req.bonus

    def _commit(self, seq: _Seq, req: SpecRequest) -> bool | None:
        """Apply the verifier's outcome; return whether the speculation cache holds it (None: nothing was built to
        look up: no proposal yet, a proposal for a planned-off round, or an outcome merged over several rounds)."""
        path, bonus = self._key(seq, req)
        proposal = seq.proposal
        seq.token_ids.extend(list(path) + [bonus])
        if self.backend.needs_aux:  # fused later (_fuse), off the hit path: a hit replies with no draft work
            seq.raw.append(req.aux)
        elif proposal is not None and seq.fed and req.rounds == 1:
            # the accepted path is cached where it lies only for a chain (trees are fed again)
            seq.num_cached = seq.path_base + (len(path) if proposal.parents is None else 0)
        if req.rounds > 1:  # (rounds in between: the next proposal has no predecessor to name)
            seq.source = None
        if proposal is None or seq.source is None:
            return None
        self.choice.observe_tokens(seq.source, len(path) + 1, after=seq.after)
        cands = seq.candidates.get(path)
        if cands is not None:
            self.stats.bonus_ranks.append(cands.index(bonus) if bonus in cands else -1)
        if self.auto is not None and proposal is not None:
            chain = proposal.parents is None
            self.auto.record(cands.index(bonus) if cands and bonus in cands else -1, len(cands or ()),
                             len(path) if chain else None, len(proposal.tokens) if chain else None)
        if seq.nodes is not None and path in seq.nodes[0].path:  # the node the outcome landed on, and the bonus's
            nodes, ranked, land = seq.nodes                         # rank there whatever was stored
            u = nodes.path.index(path)
            self.node_table.observe_proposal(nodes.key, land)
            self.node_table.observe_outcome(nodes.key[u], ranked[u].index(bonus) if bonus in ranked[u] else -1,
                                            len(cands or []))
        self.stats.lookups += 1
        hit = (path, bonus) in seq.cache
        self.stats.hits += hit
        self.choice.observe_next_hit(seq.source, hit)
        if seq.built:
            self.budget.observe_lookup(hit)
        return hit

    def peek(self, requests: list[SpecRequest]) -> list[Proposal] | None:
        """The replies :meth:`propose` will return for ``requests`` if every row hits a cached chain or tree that
        fits its budget (a chain with its q at T > 0, as cached): computing them changes nothing and runs no torch
        op, so the reply can go out before the round's bookkeeping (:func:`ssd_eagle.ssd.worker.serve`). None
        otherwise."""
        replies = []
        for req in requests:
            seq = self.seqs.get(req.slot)
            if seq is None or req.num_accepted < 0 or (seq.proposal is None and req.accepted is None):
                return None
            cached = seq.cache.get(self._key(seq, req))
            if cached is None or cached.depth > req.budget:
                return None
            replies.append(self._reply_copy(cached, {"cache_hit": True, "lookup_k": req.num_accepted,
                                                     "fanout": len(seq.cache),
                                                     "fanout_power": self.stats.fanout_power}))
        return replies

    def _reply(self, seq: _Seq, draft: Proposal, lookup: dict, source: str, budget: int) -> Proposal:
        """Remember ``draft`` as the row's proposal, made by ``source`` (hit, neural or fast) for ``budget`` tokens;
        the reply is :meth:`_reply_copy`, naming the backup when one drafted it."""
        seq.proposal, seq.fed = draft, False
        seq.after, seq.source = seq.source, source if budget > 0 else None
        seq.path_base = len(seq.token_ids)
        return self._reply_copy(draft, lookup, None if source == "hit" else source)

    @staticmethod
    def _reply_copy(draft: Proposal, lookup: dict, backup: str | None = None) -> Proposal:
        """A copy of ``draft`` without the draft's outputs, with ``lookup``'s fields (cache_hit, lookup_k, fanout,
        fanout_power; none without a lookup) and ``backup``, the backup that drafted it (None: a cache hit)."""
        none = {"cache_hit": None, "lookup_k": None, "fanout": None, "fanout_power": None}
        return replace(draft, tokens=list(draft.tokens), hidden=None, backup=backup, **{**none, **lookup})

    def _fuse(self, seqs: list[_Seq]) -> None:
        """EAGLE-3: fuse the aux states the rows' outcomes brought (``raw``) into their ``pending`` features, all
        rows' in one call (after the reply on a hit: in the build; on a miss: before the backup drafts)."""
        if not (rows := [s for s in seqs if s.raw]):
            return
        sizes = [sum(a.shape[0] for a in s.raw) for s in rows]
        for seq, new in zip(rows, self.backend.fuse(torch.cat([a for s in rows for a in s.raw])).split(sizes)):
            seq.pending = new if seq.pending is None else torch.cat([seq.pending, new])
            seq.raw = []

    # backups
    def _backup(self, rows: list[_Seq], budgets: list[int], hits: int,
                looked_up: bool = True) -> tuple[str, list[Proposal]]:
        """The backup (under auto: chosen for ``hits`` cached rows and these misses) and its drafts for ``rows``,
        timed. A planned-off round (budgets 0) drafts nothing: no choice, no timing. Under auto, rows none of which
        looked anything up (a sequence's first round, or a probe after planned-off rounds) are drafted by the
        neural draft: the planner's probe measures the draft, not the n-gram lookup."""
        if not any(b > 0 for b in budgets):
            return ("fast" if self.backup == "auto" else self.backup), [Proposal([]) for _ in rows]
        backup = self.backup
        if backup == "auto":
            backup = self.choice.choose(self.budget.verify_s, hits, len(rows)) if looked_up else "neural"
        before = time.perf_counter()
        drafts = self.lookup.propose(rows, budgets) if backup == "fast" else self._neural_backup(rows, budgets)
        seconds = time.perf_counter() - before
        if looked_up:  # (a draft that first catches up on skipped rounds is not what a miss costs)
            self.choice.observe_backup(backup, seconds)
            if backup == "neural":
                self.budget.observe_backup(seconds)
        return backup, drafts

    def _neural_backup(self, rows: list[_Seq], budgets: list[int]) -> list[Proposal]:
        """Draft from the committed text now: one forward over the uncached tokens (fresh target features for
        EAGLE-3), then a chain (one forward per token) or a dynamic tree. Writes only past the committed cache."""
        drafts = [Proposal([]) for _ in rows]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return drafts
        seqs = [rows[i] for i in active]
        self._fuse(seqs)
        before = self.backend.forwards
        out = draft_from_committed(self.backend, seqs, [s.num_cached for s in seqs], [s.pending for s in seqs],
                                   [budgets[i] for i in active], self.saguaro_miss, self.tree)
        self.stats.backup_forwards += self.backend.forwards - before
        for seq in seqs:  # (the build's forward then feeds only the root again, not the committed text twice)
            self._cached_to_root(seq)
        for i, draft in zip(active, out):
            drafts[i] = draft
        return drafts

    # building the speculation cache
    @torch.inference_mode()
    def build(self, poll=None, deadline: float | None = None) -> bool:
        """Pre-draft the next proposal for every predicted outcome of the rows of the last :meth:`propose`, at most
        ``self.budget.cap()`` branches (the padded rows x branches per row; best candidates kept first).

        It stops before its next draft forward once ``poll()`` returns True (the verifier's next message arrived,
        unless finishing answers sooner on average: ``BuildBudget.worth_finishing``) or ``time.perf_counter()``
        passes ``deadline`` (seconds). Unfinished branches are dropped: only a branch drafted to its end enters the
        cache; what the dropped ones wrote lies past the committed text, where no later forward looks. Returns
        whether the build ran to its end."""
        start = time.perf_counter()
        self._stop = BuildStop(poll, deadline)
        rows = [(s, missed) for s, missed in self._to_build if s.slot in self.seqs and s.proposal is not None]
        self._to_build, self._spent = [], []
        if self.auto is not None and (fanout := self.auto.refit()) is not None:
            self._set_fanout(fanout, self.fanout_miss if self._own_miss else None)
            self.power = self.stats.fanout_power = self.auto.power
        try:
            if rows:
                self._build_rows(rows, start)
                for seq, _ in rows:
                    seq.built = True
        except BuildInterrupted:
            self.stats.interrupted += 1
            return False
        finally:
            self._stop = BuildStop()
            self.stats.build_time += time.perf_counter() - start
            self.stats.builds += bool(rows)
        return True

    def _build_rows(self, rows: list[tuple[_Seq, bool]], start: float) -> None:
        seqs = [s for s, _ in rows]
        steps = self.tree.depth if self.tree is not None else \
            self.budget.chain_depth(self.K, len(rows) * -(-sum(self.fanout) // 2))  # branch forwards (trees: about)
        auto = self.choice if self.backup == "auto" else None  # (finishing weighs tokens too under auto)
        self._stop.finish = lambda: worth_finishing(self.budget, auto, self.budget.remaining_s(steps, fixed=True),
                                                    len(rows))
        self._stop.check()
        self._fuse(seqs)
        node_logits, node_hidden, node_kv = self._proposal_forward(seqs)
        for seq in seqs:
            seq.fed = True
            self._cached_to_root(seq)
        cap = self.budget.cap() if self.tree is not None else self.budget.cap(steps)
        per_row = None if cap is None else max(cap // len(rows), cap > 0)
        branches: list[list[dict]] = []
        for r, (seq, missed) in enumerate(rows):
            branches.append(self._outcomes(seq, node_logits[r], node_kv[r], missed,
                                           node_hidden[r] if node_hidden is not None else None, per_row))
        if per_row is not None:  # best first: every node's best candidate, then every node's second, ...
            branches = [sorted(row, key=lambda br: br["rank"])[:per_row] for row in branches]
        if any(branches):
            fixed, before, complete = time.perf_counter() - start, self.backend.forwards, False
            n = len(rows) * max(map(len, branches))
            self._stop.finish = lambda: worth_finishing(
                self.budget, auto, self.budget.remaining_s(steps - (self.backend.forwards - before), n), len(rows))
            try:
                if self.tree is not None:
                    self._draft_branch_trees(seqs, branches)
                else:
                    chains = draft_branch_chains(self.backend, seqs, branches, steps, self._pad_width(), self.saguaro,
                                                 self._stop.check)
                    for seq, row, row_chains in zip(seqs, branches, chains):
                        seq.cache.update((br["key"], chain) for br, chain in zip(row, row_chains))
                complete = True
            finally:
                self.budget.observe_build(fixed, n, self.backend.forwards - before, time.perf_counter() - start - fixed,
                                          complete)

    def _cached_to_root(self, seq: _Seq) -> None:
        """After a forward over the row's uncached committed tokens: all but the root (the last one) are cached for
        good (EAGLE-3: their keys come from the target's features, final), so they leave ``pending``; the root is
        fed again as the next chunk's first token, whose draft output the next forward needs."""
        if self.backend.needs_aux:
            seq.pending = seq.pending[len(seq.token_ids) - 1 - seq.num_cached:]
        seq.num_cached = len(seq.token_ids) - 1

    def _proposal_forward(self, seqs: list[_Seq]):
        """One tree-masked forward per row over the uncached committed tokens (a chain ending at the root, the
        last committed token) and the proposal's nodes. Returns, per row, the draft logits [1 + T, D] and outputs
        after the root and after each node, and each of those positions in the cache."""
        b = self.backend
        roots, nodes, parents, starts, feats = [], [], [], [], []
        firsts, counts = [], []  # per row: the root's index in the chunk; the root and the nodes
        for seq in seqs:
            chunk = seq.token_ids[seq.num_cached:]
            c = len(chunk)
            firsts.append(c - 1)
            counts.append(1 + len(seq.proposal.tokens))
            roots.append(chunk[0])
            nodes.append(chunk[1:] + seq.proposal.tokens)
            parents.append(list(range(c - 1)) + [p + c - 1 for p in seq.proposal.parent_list()])
            starts.append(seq.num_cached - b.offset)
            if b.needs_aux:
                m = len(seq.proposal.tokens)
                hid = seq.proposal.hidden
                if hid is None or hid.shape[0] < m:  # an n-gram proposal: no outputs to feed back, reuse the last
                    hid = seq.pending[-1:].expand(m, -1)
                feats.append(torch.cat([seq.pending, hid[:m]]))
        batch = ForwardBatch.tree(roots, nodes, parents, [s.slot for s in seqs], starts, b.dtype, b.device)
        # logits after the root and the nodes only (not after the other committed tokens: a catch-up chunk after
        # planned-off rounds can be long), a row's short list padded with its last index
        width = max(counts)
        index = torch.tensor([[f + min(i, n - 1) for i in range(width)] for f, n in zip(firsts, counts)],
                             device=b.device)
        logits, hidden = b.forward(batch, b.pad_features(feats, batch.input_ids.shape[1]) if b.needs_aux else None,
                                   index)
        out_logits, out_hidden, out_kv = [], [] if hidden is not None else None, []
        for r, (first, n) in enumerate(zip(firsts, counts)):
            out_logits.append(logits[r, :n])
            if hidden is not None:
                out_hidden.append(hidden[r, first:first + n])
            out_kv.append(list(range(starts[r] + first, starts[r] + first + n)))
        return out_logits, out_hidden, out_kv

    def _outcomes(self, seq: _Seq, logits: torch.Tensor, kv: list[int], missed: bool,
                  hidden: torch.Tensor | None, limit: int | None = None) -> list[dict]:
        """The branches to pre-draft for one row: for every node u (0 = root) the top-F_u tokens after it,
        excluding u's children, each with the path to u, its cache positions and the draft's output at u. A tree
        spreads at most ``limit`` (the time budget's branches per row) over its nodes."""
        proposal = seq.proposal
        nodes = NodeLayout.of(proposal)
        vocab = self.backend.vocab
        ranked = ranked_candidates(logits, nodes, proposal.tokens, self.node_table.max_rank, vocab)
        land = draft_land_probabilities(logits, nodes, proposal.tokens, vocab)
        fan = self.fanout_miss if missed else self.fanout
        if proposal.parents is None:  # a chain: F by depth, the all-accepted outcome gets F_K
            m = len(proposal.tokens)
            fan = [fan[d] if d < m else fan[self.K] for d in nodes.depth]
        else:
            fan = tree_fanout(land, nodes, self.node_table, sum(fan) if limit is None else min(sum(fan), limit),
                              self.power)
        seq.nodes = (nodes, ranked, land)
        branches, seq.candidates = outcome_branches(nodes, ranked, fan, kv, hidden)
        return branches

    def _pad_width(self) -> int:
        """Fewest branches per row in a build's forwards: the fan-out budget in padded fixed shapes, else 1."""
        pads = self.backend.static is not None and self.backend.static.pads
        return max(sum(self.fanout), sum(self.fanout_miss)) if pads else 1

    def _draft_branch_trees(self, seqs: list[_Seq], branches: list[list[dict]]) -> None:
        """Trees grown from every branch root (:func:`~ssd_eagle.ssd.branch_trees.draft_branch_trees`); a build due
        to stop (``self._stop``) stops growing them, and the levels grown so far are kept: a shallower tree is still a
        proposal."""
        tokens, positions, base, feats, _, _ = batch = branch_batch(self.backend, seqs, branches, self._pad_width())
        trees = draft_branch_trees(self.backend, [s.slot for s in seqs], tokens, positions, base, feats, batch[4],
                                   [len(row) for row in branches], self.tree, self.K, self._stop.due)
        for seq, row, row_trees in zip(seqs, branches, trees):
            for br, tree in zip(row, row_trees):
                seq.cache[br["key"]] = tree

