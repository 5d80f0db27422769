"""Plans chosen from measured costs: how many draft tokens to verify each round, or none at all.

A round that verifies K draft tokens costs ``T(K) = V(K + 1, B) + D(K)`` seconds: the target's forward over K + 1
new tokens for a batch of B rows, plus the drafter's time for K steps (zero for autoregressive decoding, K = 0). It
emits on average

    E(K) = 1 + sum_{j=1..K} prod_{i=1..j} a_i                                        (Leviathan et al., Eq. 1)

tokens per row, where ``a_i`` is the probability that draft position i is accepted given positions 1..i-1 were
(measured on the running request). The planner picks the K that maximises the batch's expected tokens per second
``sum_rows E_row(K) / T(K)``; K = 0 (plain decoding) competes on the same footing, so a drafter that does not pay
is switched off. While off, a request *probes* (a short draft now and then, less often while probes fail) so that
speculation comes back when drafts start to pay; while it drafts fewer than K tokens, a round now and then drafts K
(*explores*) so that the positions it no longer drafts are measured again. SSD engines are planned the same way,
their ``D(K)`` being the verifier's wait for the speculator (see :func:`planner_for`). A tree round verifies all
its nodes, and its ``a_i`` is the chance that its accepted path reaches depth i; an SSD tree is planned on or off,
an SD tree drafter's rounds are its tree, the tree's best half, quarter... (a narrower verification of the same
drafting), or chains, whichever shape is expected to run faster from what each measured (:class:`PlannerConfig`
``chains``, ``tree_sizes``; every smaller size is learnt exactly from each larger round, :func:`tree_record`).
Sampled rows teach each tried position's chance of acceptance, not the draw.

Costs: :func:`measure_verify_costs` times ``V(n, B)`` for n = 1..N new tokens per batch-size bucket in a few
forwards at start-up, and :func:`measure_draft_costs` an SD neural drafter's ``D(K)`` for K = 1..N (one row; a
tree: its whole depth); both are cached on disk per (model, dtype, threads and CPU affinity, torch version, code
version) under :func:`ssd_eagle.assets.cache_dir`. The drafter's ``D(K)`` starts from that measure and is learnt
online from the rounds the engine runs (a least-squares line ``d0 + d1 * K`` with forgetting), as are corrections
to ``V``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ssd_eagle.stats import SpecStats

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# a measured verify table whose entries had to be lowered by more than this factor to be consistent (a forward over
# more tokens or rows never costs less, CostTable) was disturbed while it was timed: it is used but not cached
DISTURBED = 1.5
# PlannerConfig.min_rounds of the engines' planners (planner_for). Measured 2026-12-03 (2-core Intel Xeon with AMX,
# bf16, 2 held-out prompts x 64 tokens, 3 interleaved passes, x AR at T = 0 / 0.5 / 1, 0 -> 6): planned EAGLE-3
# chain 1.23 / 1.25 / 0.98 -> 1.28 / 1.16 / 1.17 (its worst pass 0.92 -> 1.14), planned tree 1.33 / 1.21 / 1.16 ->
# 1.33 / 1.31 / 1.14, planned draft LM 1.04 / 0.99 / 0.95 -> 1.02 / 1.00 / 0.96.
MIN_ROUNDS = 6
# PlannerConfig.explore_every of a planner whose chains compete with a tree (planner_for): each shape is learnt only
# from its own rounds, so the one not planned needs exploring sooner than a longer chain does. Simulated with
# SmolLM2-like rates and costs (greedy rows learn chains from every tree round, greedy_chain_record), 2 requests x
# 64 tokens, 150 seeds, x AR at T = 0 / 0.5 / 1, 8 -> 4: 1.663 / 1.466 / 1.246 -> 1.664 / 1.483 / 1.327 (the better
# shape alone: 1.747 / 1.489 / 1.392).
SHAPE_EXPLORE_EVERY = 4


# ----------------------------------------------------------------------------------------------------------- costs
@dataclass
class CostTable:
    """Seconds of one target forward over n new tokens (n = 1..len) per batch-size bucket.

    Attributes:
        verify: ``{bucket: [V(1), V(2), ..., V(N)]}`` in seconds; a batch uses the smallest bucket >= its size
            (the largest bucket beyond it, scaled linearly in B), n past N extrapolates the last slope.
        key: what the table was measured for (see :func:`cost_key`).
        corrected: the largest factor by which an entry was lowered to keep the table consistent (1: none); a
            measured table corrected by more than ``DISTURBED`` is not cached (:func:`measure_verify_costs`).
    """

    verify: dict[int, list[float]]
    key: str = ""

    def __post_init__(self):
        # a forward over more new tokens never costs less: a V(n) above a later V(m) was slowed by something else
        # (a table measured on a shared 2-core Xeon read V(4) = 60.5 ms between V(3) = 48.2 and V(5) = 47.9, and
        # the planner avoided K = 3 for good), so each entry is the least of itself and every later one
        raw = self.verify
        self.verify = {b: [min(row[n:]) for n in range(len(row))] for b, row in sorted(self.verify.items())}
        # nor a forward over more rows: a server started while another process held the second core measured
        # bucket 1 at V(1..7) = 680-1602 ms and bucket 4 at 47-62 ms, cached it, and never drafted again (a 7-token
        # verification read 2.4x a step), so each entry is also the least of the larger buckets' at that n
        larger: list[float] = []
        for b in sorted(self.verify, reverse=True):
            row = self.verify[b]
            self.verify[b] = larger = [min(t, larger[n]) if n < len(larger) else t for n, t in enumerate(row)]
        self.corrected = max((t / c for b, row in raw.items() for t, c in zip(row, self.verify[b]) if c > 0),
                             default=1.0)

    def verify_time(self, n: int, batch: int = 1) -> float:
        """Seconds of a forward over ``n >= 1`` new tokens for ``batch`` rows."""
        buckets = sorted(self.verify)
        bucket = next((b for b in buckets if b >= batch), buckets[-1])
        row = self.verify[bucket]
        t = row[n - 1] if n <= len(row) else row[-1] + (n - len(row)) * max(row[-1] - row[-2], 0.0) \
            if len(row) > 1 else row[-1] * n
        return t * (batch / bucket if batch > bucket else 1.0)

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "verify": {str(b): v for b, v in self.verify.items()}})

    @classmethod
    def from_json(cls, text: str) -> CostTable:
        raw = json.loads(text)
        return cls({int(b): [float(x) for x in v] for b, v in raw["verify"].items()}, raw.get("key", ""))


RUNNER_CODE = ("model_runner.py", "kv_cache.py", "packed_linear.py")  # what a target forward runs
DRAFT_CODE = RUNNER_CODE + ("drafters/backends.py", "drafters/chain.py", "drafters/neural.py", "drafters/tree.py",
                            "models/eagle3.py", "cuda_graphs.py", "sampling.py")  # what an SD drafter's round runs


def cost_key(model, *extent, code: tuple[str, ...] = RUNNER_CODE) -> str:
    """A digest of what a forward's cost depends on: the model's config and dtype, how many of its linear layers run
    packed (a float32 model with float16 weights runs FBGEMM's kernels, :mod:`ssd_eagle.packed_linear`), torch's
    thread count and the CPU affinity of this process, the torch version, this project's ``code`` (files under
    ``ssd_eagle/``), and the table's ``extent``."""
    from ssd_eagle.packed_linear import PackedForward

    param = next(model.parameters())
    packed = sum(isinstance(m.__dict__.get("forward"), PackedForward) for m in model.modules())
    source = b"".join((Path(__file__).parent / name).read_bytes() for name in code)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") \
        else repr(model.config)  # (an EAGLE-3 head's config is a dataclass)
    parts = [config, str(param.dtype), f"packed {packed}", str(param.device), str(torch.get_num_threads()),
             str(affinity), torch.__version__, hashlib.sha256(source).hexdigest(), *map(str, extent)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _cached(key: str, measure, encode, decode, cache: bool, keep=lambda value: True):
    """``decode`` of the file ``cache_dir()/costs/<key>.json`` when ``cache`` and it exists, else ``measure()``,
    written there atomically when ``cache`` and ``keep(value)`` (a measure that looks disturbed is used, not kept:
    the next start measures again)."""
    from ssd_eagle.assets import cache_dir
    from ssd_eagle.io import atomic_write

    path = cache_dir() / "costs" / f"{key}.json"
    if cache and path.exists():
        return decode(path.read_text())
    value = measure()
    if cache and keep(value):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as tmp:
            tmp.write_text(encode(value))
    return value


@torch.inference_mode()
def measure_verify_costs(runner, max_new: int, max_batch: int = 1, context: int = 128, repeats: int = 3,
                         cache: bool = True, forward=None) -> CostTable:
    """Time the target's forward over n = 1..``max_new`` new tokens after a ``context``-token prefix, for every
    batch bucket up to ``max_batch`` (the least of ``repeats`` passes over every n, after one warm-up pass:
    interference from other work only adds time; timed n after n, a table measured in a float16 SSD engine on an
    AVX2 EPYC read V(5..7) = 90-113 ms against 56-70 measured alone, and was cached so).

    Args:
        runner: a :class:`~ssd_eagle.model_runner.ModelRunner` with at least ``max_batch`` free slots (their cache
            contents are overwritten: call this before any request is admitted).
        context: prefix length, capped so that ``context + max_new`` fits the runner's cache.
        cache: read and write the table under ``cache_dir()/costs`` keyed by :func:`cost_key`.
        forward: what a round's verification runs on a :class:`~ssd_eagle.kv_cache.ForwardBatch` (default:
            ``runner.forward``): an engine that replays CUDA graphs passes its own, since a width padded to a
            captured one costs what the padded graph costs, not what an eager forward of that width would.

    Returns:
        The :class:`CostTable`.
    """
    from ssd_eagle.kv_cache import ForwardBatch

    buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
    context = max(1, min(context, runner.kv.max_len - max_new))  # a short max_model_len still fits the probe
    key = cost_key(runner.model, max_new, buckets, *(("own forward",) if forward is not None else ()))
    forward = forward or runner.forward

    def measure() -> CostTable:
        verify: dict[int, list[float]] = {}
        for b in buckets:
            slots = list(range(b))
            runner.forward(ForwardBatch.causal([[0] * context] * b, slots, [0] * b, runner.dtype, runner.device),
                           logits_index=torch.zeros(b, 1, dtype=torch.long, device=runner.device))
            batches = [ForwardBatch.causal([[0] * n] * b, slots, [context] * b, runner.dtype, runner.device)
                       for n in range(1, max_new + 1)]
            verify[b] = least_of_passes([lambda batch=batch: forward(batch) for batch in batches], repeats,
                                        runner.device)
        return CostTable(verify, key)

    return _cached(key, measure, CostTable.to_json, CostTable.from_json, cache,
                   keep=lambda table: table.corrected <= DISTURBED)


def least_of_passes(calls: list, repeats: int, device: torch.device | str | None = None) -> list[float]:
    """Seconds of each call: the least of ``repeats`` timed passes over all of them, after one warm-up pass. Passes
    over every call, not call after call: a disturbance of a few hundred ms spoils one pass's entries, which the
    least drops, not every entry of a range of calls. On a CUDA ``device`` each call is timed from an idle device
    to its kernels' end (they run asynchronously: without the syncs it times their launch)."""
    sync = torch.cuda.synchronize if device is not None and torch.device(device).type == "cuda" else (lambda: None)
    times = [[] for _ in calls]
    for _ in range(repeats + 1):
        for i, call in enumerate(calls):
            sync()
            start = time.perf_counter()
            call()
            sync()
            times[i].append(time.perf_counter() - start)
    return [min(t[1:]) for t in times]


@torch.inference_mode()
def measure_draft_costs(backend, max_k: int, tree=None, context: int = 128, repeats: int = 3,
                        cache: bool = True) -> dict[int, float]:
    """Seconds an SD round's drafting takes for one row, ``{k: D(k)}``: what
    :meth:`~ssd_eagle.drafters.neural.NeuralDrafter.propose` runs after a round that accepted one draft
    (:func:`~ssd_eagle.drafters.neural.draft_from_committed`: one extend over the two new committed tokens, then a
    greedy chain of k tokens, or the tree), after a ``context``-token prefix, the least of ``repeats`` passes
    (:func:`least_of_passes`). The planner starts its ``D(K)`` line from it, so that a request's first rounds are
    planned at what drafting costs, not as if it were free: SmolLM2's 4-layer draft LM drafted 5 tokens (~31 ms) in
    the first round of every engine, 4 in the second (bf16, Intel Xeon with AMX). Sampled rows, Saguaro scaling
    and batches of several rows cost more than this; the rounds served correct the line.

    Args:
        backend: the drafter's :class:`~ssd_eagle.drafters.backends.DraftBackend`; its slot 0 is overwritten (call
            this before any request is admitted).
        max_k: the longest chain (k = 1..max_k are timed), or a tree's depth (only the whole tree is timed).
        tree: the drafter's :class:`~ssd_eagle.drafters.tree.TreeSettings`, or None for chains.
        context: prefix length, capped so that the prefix, the two new tokens and the draft fit the draft's cache.
        repeats: timed passes over every k (after one warm-up pass).
        cache: read and write the result under ``cache_dir()/costs``, keyed by :func:`cost_key` of the draft model
            and whether it runs in fixed shapes.

    Returns:
        ``{k: seconds}``; empty when the cache is too short to hold a prefix and the draft (nothing is timed: the
        line is learnt online only).
    """
    from types import SimpleNamespace

    from ssd_eagle.drafters.neural import draft_from_committed
    from ssd_eagle.sampling_params import SamplingParams

    room = tree.depth * tree.topk if tree is not None else max_k  # a tree's levels write topk positions each
    context = min(context, backend.kv.max_len - room - 3)
    if context < 2:
        return {}
    ks = [max_k] if tree is not None else list(range(1, max_k + 1))
    key = cost_key(backend.model, "draft", ks, tree, context, f"fixed shapes {backend.static is not None}",
                   code=DRAFT_CODE)
    seq = SimpleNamespace(slot=0, token_ids=[0] * (context + 2), params=SamplingParams(temperature=0.0),
                          draft_generator=None)
    features = torch.zeros(context + 2, backend.hidden_size, dtype=backend.dtype, device=backend.device) \
        if backend.needs_aux else None

    def measure() -> dict[int, float]:
        first = backend.offset  # (an EAGLE-3 head caches the pair (f_{t-1}, x_t) from token position 1 on)
        backend.write(0, seq.token_ids[first:context], 0, None if features is None else features[: context - first])
        pending = [None if features is None else features[:2]]
        calls = [lambda k=k: draft_from_committed(backend, [seq], [context], pending, [k], None, tree) for k in ks]
        return dict(zip(ks, least_of_passes(calls, repeats, backend.device)))

    return _cached(key, measure, lambda costs: json.dumps({str(k): v for k, v in costs.items()}),
                   lambda text: {int(k): float(v) for k, v in json.loads(text).items()}, cache)


class OnlineLine:
    """Least-squares fit of ``y = intercept + slope * x`` with exponential forgetting (weight ``decay`` per
    update), for costs that drift (caches warming, context growing)."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def update(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def predict(self, x: float, default: float = 0.0) -> float:
        if self.n < 1e-9:
            return default
        var = self.sxx * self.n - self.sx ** 2
        if var <= 1e-12 * max(self.n, 1.0):  # one distinct x so far: proportional through the mean
            mean_x, mean_y = self.sx / self.n, self.sy / self.n
            return mean_y * x / mean_x if mean_x > 0 else mean_y
        slope = (self.sxy * self.n - self.sx * self.sy) / var
        intercept = (self.sy - slope * self.sx) / self.n
        return max(intercept + slope * x, 0.0)


# ------------------------------------------------------------------------------------------------------ acceptance
@dataclass
class Acceptance:
    """Per-position conditional acceptance ``a_i`` of one request, as decayed counts with a prior.

    After a chain of n drafts accepted k, positions 1..min(k + 1, n) were tried and 1..k accepted; later positions
    were not observed. ``a_i = (accepted_i + w * prior_i) / (tried_i + w)`` with the engine-wide estimate as prior.
    """

    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    decay: float = 0.9

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        need = num_drafted - len(self.tried)
        if need > 0:
            self.tried += [0.0] * need
            self.accepted += [0.0] * need
        for i in range(min(num_accepted + 1, num_drafted)):
            self.tried[i] = self.decay * self.tried[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + (1.0 if i < num_accepted else 0.0)

    def record_chances(self, chances: list[float]) -> None:
        """Record a round by the chance each tried position had to be accepted (positions ``1..len(chances)``
        tried), not by what was drawn: the same expectation, with less variance (a sampled row's rejection test,
        :func:`~ssd_eagle.verify.chain_acceptance_probs`)."""
        need = len(chances) - len(self.tried)
        if need > 0:
            self.tried += [0.0] * need
            self.accepted += [0.0] * need
        for i, chance in enumerate(chances):
            self.tried[i] = self.decay * self.tried[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + chance

    def rates(self, k: int, prior: list[float] | None = None, weight: float = 2.0, default: float = 0.5) -> list[float]:
        """``[a_1 .. a_k]``; positions never tried take the prior (or the last known rate, or ``default``)."""
        out = []
        for i in range(k):
            p = prior[i] if prior is not None and i < len(prior) else (out[-1] if out else default)
            if i < len(self.tried) and self.tried[i] > 0:
                out.append((self.accepted[i] + weight * p) / (self.tried[i] + weight))
            else:
                out.append(p)
        return out


def expected_tokens(rates: list[float]) -> float:
    """E(K) = 1 + sum_j prod_{i<=j} a_i: tokens emitted by a chain round with per-position acceptance ``rates``."""
    total, reach = 1.0, 1.0
    for a in rates:
        reach *= a
        total += reach
    return total


def greedy_chain_record(parents: list[int], path: list[int]) -> tuple[int, int]:
    """Of a tree proposal verified greedily, what a greedy chain would have shown, as ``(tried, accepted)`` for
    :meth:`Acceptance.record`: its drafts are the best child of each node (the first node with that parent in the
    proposal's order: :func:`~ssd_eagle.drafters.tree.grow_trees` orders each depth by descending score, and
    siblings differ only in their own log-probability), so it would have had accepted the leading nodes of the
    accepted ``path`` that are best children, and been rejected at the next position if the node there has
    children (its best child is not the target's token). A node without children (the tree's depth, or a best child
    cut by the tree's budget) says nothing of the chain's next draft: that position counts as not tried.

    Args:
        parents: each node's parent (0 = the root), nodes in the proposal's order.
        path: the accepted nodes (1-based ids), root to leaf.
    """
    best: dict[int, int] = {}
    for node, parent in enumerate(parents, start=1):
        best.setdefault(parent, node)
    accepted, last = 0, 0
    for node in path:
        if best.get(parents[node - 1]) != node:
            return accepted + 1, accepted  # the chain drafted the best child: the target's token differs
        accepted, last = accepted + 1, node
    return (accepted + 1 if last in best else accepted), accepted


def tree_record(proposal, path: list[int], nodes: int, depth: int,
                child_probs: list[dict[int, float]] | None = None) -> tuple[int, int] | list[float]:
    """What a verified tree round teaches of the sub-tree of its ``nodes`` best nodes
    (:meth:`Proposal.top <ssd_eagle.drafters.base.Proposal.top>`), as if that sub-tree had been drafted and verified
    alone: for greedy rows ``(depth, accepted)`` for :meth:`Acceptance.record`, for sampled rows (``child_probs``)
    the chance of going on past each depth tried for :meth:`Acceptance.record_chances`. Exact, not estimated: a
    sub-tree costs no other drafting (the same levels grow), and :func:`~ssd_eagle.verify.tree_verify`'s walk over it
    with the same target draws accepts the leading nodes of the whole tree's ``path`` that it holds (at a node whose
    drawn token's child is cut, the sub-tree has no child with that token: siblings differ), so every smaller size
    of a round's tree is learnt from that round.

    Depths are tried up to the ``depth`` the tree was grown to, not just the sub-tree's own: a tree whose best nodes
    stop short of it has no chance to go on there (a 2-node tree of two siblings never reaches depth 2), which a
    per-depth rate must count, or it reads the rate of the sub-trees that do reach it and overrates a narrow tree.

    Args:
        proposal: the round's tree :class:`~ssd_eagle.drafters.base.Proposal` (without ``ranks`` only the whole
            tree can be recorded).
        path: the accepted nodes (1-based ids), root to leaf.
        nodes: the sub-tree's size (the whole tree when it has no more nodes).
        depth: the levels the tree was grown to.
        child_probs: :func:`~ssd_eagle.verify.tree_child_probs` of the round (sampled rows), or None.

    Raises:
        ValueError: a sub-tree smaller than the tree without ``ranks``
            (:meth:`~ssd_eagle.drafters.base.Proposal.best_nodes`).
    """
    keep = proposal.best_nodes(nodes)
    accepted = next((j for j, node in enumerate(path) if node not in keep), len(path))
    if child_probs is None:
        return depth, accepted
    return [sum(p for child, p in kids.items() if child in keep) for kids in child_probs[: min(accepted + 1, depth)]]


# --------------------------------------------------------------------------------------------------------- planner
@dataclass
class PlannerConfig:
    """Attributes:
        max_k: the longest chain considered (the engine's K).
        choose_k: pick K in 0..max_k (True) or only between 0 and max_k (an explicit K).
        adaptive: False always drafts max_k (the cost model is not consulted).
        probe_every: while not speculating, a request drafts ``probe_k`` tokens after this many rounds; every probe
            that leaves speculation off doubles the interval, up to ``max_probe_every`` rounds (a probe costs a
            draft and a wider verification, paid in full while the drafter stays useless); it starts again from
            ``probe_every`` once the request speculates.
        max_probe_every: the longest interval between probes (unless ``probe_overhead`` asks for more).
        probe_overhead: probes are spaced so that they cost at most this fraction of plain decoding's time: at
            least ``(T(probe_k) - T(0)) / (probe_overhead * T(0))`` rounds apart, from the measured costs (in
            float32 on a 2-core EPYC a useless draft LM's probe cost ~1.4 plain rounds: ~0.7 its drafting, catch-up
            forward included, ~0.7 the wider verification); exploring rounds (``explore_every``) likewise, against
            the planned K's rounds.
        probe_k: length of a probe.
        learn_costs: False takes the cost table as it is and drafting as free (no online correction of ``V``, no
            learnt ``D(K)``): for a table made by hand (tests, what-if runs).
        off_margin: speculation is switched off only where plain decoding's expected rate beats the best draft
            length's by this share (near a tie the engine keeps speculating, and needs no probes to come back;
            a small share of the 3% the planner may lose to AR).
        warm_rounds: the drafter's first this-many drafting rounds are not learnt as drafting cost (one-off
            warm-up). :func:`planner_for` sets 3 for SSD: an SSD tree's first three rounds made the verifier wait
            36, 101 and 74 ms (an AVX2 EPYC, float16), its later hits 1.3 ms; learnt, they made its rounds look
            43 ms dearer, and it was switched off after its fifth drafted round for the rest of the prompt, since
            a request that does not speculate teaches no new drafting cost.
        min_cost_rounds: drafting counts as free until its cost was learnt from this many rounds (faded count;
            :func:`planner_for` sets 3.5, four rounds, for SSD: the verifier's first waits for a speculator include
            its warm-up and an empty cache, 34 ms against ~3 ms later for an SSD tree, and one such round switched
            speculation off for a whole prompt; an SD drafter's rounds after its first cost what they will cost,
            and four free rounds of a useless draft LM cost ~4% of AR's speed at T = 1).
        explore_every: while the plan drafts a middle length (0 < K < ``max_k``), one round in this many drafts
            ``max_k`` instead, so that the positions past K and the longer draft's cost are measured again (an
            estimate made from a handful of early rounds is otherwise never revisited: an SSD planner that saw
            position 2 accepted in 0 of its first 3 tries kept K = 1 for a whole prompt, 1.09x AR against 1.26x for
            a fixed K = 5); the interval doubles, up to ``max_explore_every``, while the plan stays the same, and
            is at least what keeps the exploring rounds' extra time within ``probe_overhead``. 0: never.
        max_explore_every: the longest interval between two exploring rounds.
        min_rounds: speculation is not switched off on the evidence of fewer drafted rounds than this (engine-wide,
            since the planner started), as long as the prior alone (every ``a_i`` = 0.5) says drafting pays: a
            request's first rounds are a handful of draws, and the engine-wide prior they shrink toward is made of
            the same draws. A tree at T = 0.5 whose first two rounds accepted nothing read ``a_1`` = 0.13 and was
            switched off for 118 of its 125 rounds (probes spaced 21+ rounds apart, each one draw): 0.97x AR, where
            the same tree unplanned ran at 1.44x. A drafter that does not pay even at the prior (most float32
            cases) is still switched off at once. 0: no such rule.
        tree_nodes: the nodes of a tree round (0: chains). A tree round drafts the whole tree (K is its depth,
            ``tree_depth``), verifies ``tree_nodes + 1`` tokens, and its ``a_i`` is the chance that the accepted
            path reaches depth i given it reached i - 1 (so ``E`` is the tree's tokens per round); a tree is
            planned on or off, never shallower.
        tree_sizes: the sizes (nodes) a tree round may take, each verifying its ``n`` best nodes of the same grown
            tree (:meth:`Proposal.top <ssd_eagle.drafters.base.Proposal.top>`; empty: ``tree_nodes`` only). Each is a
            shape of its own (its acceptance learnt apart; drafting costs the same); a round of n nodes teaches every
            smaller size exactly (:func:`tree_record`), a larger one is learnt on exploring rounds, like a longer
            chain. A tree is expected to accept at least what its smaller trees do (:meth:`Planner.expected`), and
            a smaller tree is planned only once ``min_rounds`` rounds measured it (:meth:`Planner.measured`).
        chains: with ``tree_nodes``, chains (of 1..max_k tokens, or max_k with an explicit K) compete with the tree
            round by round: each shape's acceptance and drafting cost are learnt from its own rounds (and a
            greedy row's chain acceptance from its tree rounds too, :func:`greedy_chain_record`), the plan is the
            shape and length of the highest expected rate, and the other shape runs on exploring rounds
            (``explore_every``; chains are not explored while tree rounds teach them). A shape is planned only once
            it has been measured (until then: the tree). Measured
            2026-12-07 (2-core Intel Xeon with AMX, bf16, SmolLM2's EAGLE-3 head, a 6-node tree against a planned
            chain, x AR at T = 0 / 0.5 / 1): tree 1.42 / 1.34 / 1.09, chain 1.26 / 1.32 / 1.24 (sampled rows
            accept a tree's deterministic children less often than a chain's drafts sampled from q).
        tree_depth: the tree's depth (0: ``max_k``).
    """

    max_k: int
    choose_k: bool = True
    adaptive: bool = True
    probe_every: int = 8
    max_probe_every: int = 64
    probe_overhead: float = 0.02
    probe_k: int = 2
    learn_costs: bool = True
    off_margin: float = 0.01
    warm_rounds: int = 1
    min_cost_rounds: float = 0.0
    explore_every: int = 8
    max_explore_every: int = 64
    min_rounds: int = 0
    tree_nodes: int = 0
    chains: bool = False
    tree_depth: int = 0
    tree_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 < n <= self.tree_nodes for n in self.tree_sizes):
            raise ValueError(f"tree_sizes must lie in 1..tree_nodes ({self.tree_nodes}), got {self.tree_sizes}")


@dataclass
class Learnt:
    """What the planner learns of one proposal shape (chains, or a tree size) from the rounds that drafted it.

    Attributes:
        acceptance: per request id, its per-position acceptance.
        engine_wide: the same over all requests.
        by_kind: the same over the greedy (True) or the sampled (False) requests: a request's prior is its kind's,
            once that kind was measured (else ``engine_wide``). Drafts accept far more at T = 0 than at T = 1: a
            server's greedy request after a T = 1 one started from the T = 1 rates, planned 1-token chains for 38
            of its 48 rounds and reached tau 1.31 (SmolLM2's EAGLE-3 tree, bf16).
        draft_cost: seconds of a round's drafting against its draft length (a tree's: its depth; one line for
            all tree sizes, which grow the same levels).
    """

    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    engine_wide: Acceptance = field(default_factory=lambda: Acceptance(decay=0.98))
    by_kind: dict[bool, Acceptance] = field(default_factory=dict)
    draft_cost: OnlineLine = field(default_factory=OnlineLine)

    @property
    def rounds(self) -> float:
        """Rounds of this shape verified engine-wide (a faded count)."""
        return self.engine_wide.tried[0] if self.engine_wide.tried else 0.0

    def prior(self, greedy: bool | None) -> Acceptance:
        """The acceptance a request of this kind (None: unknown) shrinks toward."""
        kind = self.by_kind.get(greedy)
        return kind if kind is not None and kind.tried and kind.tried[0] > 0 else self.engine_wide

    def records(self, request_id: str, greedy: bool | None) -> list[Acceptance]:
        """Where a round of this request is recorded: its own, the engine-wide and its kind's acceptance."""
        out = [self.acceptance.setdefault(request_id, Acceptance()), self.engine_wide]
        if greedy is not None:
            out.append(self.by_kind.setdefault(greedy, Acceptance(decay=0.98)))
        return out


class Planner:
    """Chooses each round's draft length, and for a tree drafter whether the round drafts a tree (of which size) or a
    chain, from the cost table and the running requests' acceptance.

    Call :meth:`choose` (or :meth:`decide`) before drafting a round, :meth:`observe` after verifying it,
    :meth:`forget` when a request ends; the engine calls :meth:`plan` and :meth:`observe_round`. ``tree_round``
    is the planned round's shape: 0 for a chain, else the tree's nodes (a shape is an int throughout: 0 chains,
    n > 0 a tree of n nodes). ``decisions`` counts the batch's K over rounds (``tree_rounds``
    the rounds planned as trees); :meth:`plan` also records every request's draft length, shape and probes in its
    :class:`~ssd_eagle.stats.SpecStats` (the server's ``spec_stats``) and the engine's totals (``/metrics``).

    Args:
        config: the planner's settings.
        costs: the target's verify times.
        draft_costs: a chain drafter's ``{k: seconds}`` measured at start-up (:func:`measure_draft_costs`).
        tree_draft_costs: the same for the tree (``{depth: seconds}``).
    """

    def __init__(self, config: PlannerConfig, costs: CostTable, draft_costs: dict[int, float] | None = None,
                 tree_draft_costs: dict[int, float] | None = None):
        self.config = config
        self.costs = costs
        self.draft_costs = {False: dict(draft_costs or {}), True: dict(tree_draft_costs or {})}
        self.chain = Learnt()
        self.trees = {n: Learnt() for n in self.shapes() if n}
        self._reset_draft_costs()
        self.tree_round = self.shapes()[-1]  # the planned round's shape
        self.warm_rounds_left = config.warm_rounds  # the drafter's warm-up rounds, not learnt
        self.probing = False  # the planned round is a probe (its drafting time is not learnt)
        self.budgets: dict[str, int] = {}  # each request's draft budget this round (plan)
        self.greedy: dict[str, bool] = {}  # each planned request's kind (plan): its acceptance prior's
        self.verify_scale = 1.0  # measured verify time / table prediction (EMA)
        self.catch_up_cost = 0.0  # seconds a drafter spends catching up on the rounds it skipped (EMA over probes)
        self.idle_rounds: dict[str, int] = {}
        self.probe_interval: dict[str, int] = {}
        self.decisions: dict[int, int] = {}
        self.tree_sizes: dict[int, int] = {}  # rounds planned as trees of each size (exploring rounds included)
        self.explored = 0  # exploring rounds run (:meth:`explore`)
        self.drafted_rounds = 0  # verified rounds that drafted (the evidence :meth:`learning` counts)
        self.chains_inferred = False  # the last tree round taught chains' acceptance too (greedy rows)
        self._plain = (0, self.tree_round)  # the last plan before exploration
        self._since_explore = 0
        self._explore_interval = config.explore_every

    @property
    def tree(self) -> Learnt:
        """What was learnt of the whole tree (``tree_nodes``)."""
        return self.trees[self.config.tree_nodes]

    @property
    def tree_rounds(self) -> int:
        """Rounds planned as trees, of any size (exploring rounds included)."""
        return sum(self.tree_sizes.values())

    def learnt(self, shape: int) -> Learnt:
        """What was learnt of a tree of ``shape`` nodes, or of chains (0)."""
        return self.trees[shape] if shape else self.chain

    def shapes(self) -> tuple[int, ...]:
        """The shapes a round may take, the whole tree last: chains (0), tree sizes (ascending), or both
        (:class:`PlannerConfig`)."""
        cfg = self.config
        if not cfg.tree_nodes:
            return (0,)
        sizes = tuple(sorted(set(cfg.tree_sizes) | {cfg.tree_nodes}))
        return (0, *sizes) if cfg.chains else sizes

    def _reset_draft_costs(self) -> None:
        """Drafting-cost lines as the start-up measures give them: the chains' and one shared by every tree size."""
        self.chain.draft_cost = self._measured_line(False)
        line = self._measured_line(True)
        for learnt in self.trees.values():
            learnt.draft_cost = line

    def lengths(self, tree: int) -> list[int]:
        """The draft lengths a round of this shape may plan (a tree: its depth only)."""
        cfg = self.config
        if tree:
            return [cfg.tree_depth or cfg.max_k]
        return list(range(1, cfg.max_k + 1)) if cfg.choose_k else [cfg.max_k]

    def _measured_line(self, tree: bool) -> OnlineLine:
        """The drafting-cost line as the start-up measure gives it (empty without one); rounds then update it."""
        line = OnlineLine()
        for k, seconds in sorted(self.draft_costs[tree].items()):
            line.update(k, seconds)
        return line

    def round_time(self, k: int, batch: int, tree: int = 0) -> float:
        """Predicted seconds of a round drafting ``k`` tokens (a tree of ``tree`` nodes: ``k`` levels) for
        ``batch`` rows."""
        line = self.learnt(tree).draft_cost
        draft = line.predict(k, default=0.0) if k and line.n >= self.config.min_cost_rounds else 0.0
        width = tree + 1 if k and tree else k + 1
        return self.verify_scale * self.costs.verify_time(width, batch) + draft

    def probe_length(self, tree: int) -> int:
        """Draft length of a probe of this shape (a tree's: its whole depth)."""
        return self.lengths(tree)[0] if tree else min(self.config.probe_k, self.config.max_k)

    def rate(self, k: int, request_ids: list[str], tree: int = 0) -> float:
        """Expected emitted tokens per second for the batch at draft length ``k`` (of a tree of ``tree`` nodes)."""
        tokens = sum(self.expected(k, r, tree) for r in request_ids)
        return tokens / self.round_time(k, len(request_ids), tree)

    def expected(self, k: int, request_id: str, tree: int = 0) -> float:
        """A request's expected tokens per round at draft length ``k`` (of a tree of ``tree`` nodes): at least a
        smaller tree's, whose nodes it holds. (A size is learnt from fewer rounds than the smaller ones, which every
        larger round teaches too: a 12-node tree's two unlucky rounds made it look worse than its own best 3 nodes,
        measured over five rounds, and the planner dropped it.)"""
        sizes = [n for n in self.shapes() if 0 < n <= tree] if tree else [0]
        best = 0.0
        for n in sizes:
            learnt = self.learnt(n)
            prior = learnt.prior(self.greedy.get(request_id)).rates(max(k, 1), weight=2.0)
            best = max(best, expected_tokens(learnt.acceptance.get(request_id, Acceptance()).rates(k, prior)))
        return best

    def choose(self, request_ids: list[str]) -> dict[str, int]:
        """Draft length per request for the next round (0 = plain decoding for that request)."""
        return {r: k for r, (k, _) in self.decide(request_ids).items()}

    def decide(self, request_ids: list[str]) -> dict[str, tuple[int, bool]]:
        """``{request_id: (draft length, probe)}`` for the next round: the batch's K (0 = plain decoding), or for a
        request whose speculation is off a probe now and then (``probe`` True; see :class:`PlannerConfig`).
        ``tree_round`` is set to the round's shape."""
        cfg = self.config
        shapes = self.shapes()
        if not cfg.adaptive or cfg.max_k == 0 or not request_ids:
            tree = shapes[-1]
            k = self.lengths(tree)[-1]
        else:
            measured = [t for t in shapes if self.measured(t)]
            (k, tree), best = self._best(request_ids, measured or [shapes[-1]])  # (until measured: the whole tree)
            if self.rate(0, request_ids) > (1.0 + cfg.off_margin) * best and not self.learning(k, request_ids, tree):
                k, tree = self._best(request_ids, shapes)[0] if not measured else (0, tree)
                if not self.learning(k, request_ids, tree):  # (nothing measured: a shape paying at the prior)
                    k = 0  # (probes try a shape never measured, the tree first: a tree off at once hid chains)
                    tree = next((t for t in reversed(shapes) if self.learnt(t).rounds == 0), tree)
            k, tree = self.explore(k, tree, len(request_ids))
        self.tree_round = tree
        self.decisions[k] = self.decisions.get(k, 0) + 1
        out = {}
        spacing = self.probe_spacing(len(request_ids), tree) if k == 0 and cfg.adaptive else 1
        for r in request_ids:
            if k == 0 and cfg.adaptive:
                backoff = self.probe_interval.get(r, cfg.probe_every)
                idle = self.idle_rounds.get(r, 0) + 1
                probe = idle >= max(backoff, spacing)
                if probe:
                    self.probe_interval[r] = min(2 * backoff, max(cfg.max_probe_every, cfg.probe_every))
                self.idle_rounds[r] = 0 if probe else idle
                out[r] = (self.probe_length(tree), True) if probe else (0, False)
            else:
                self.idle_rounds[r] = 0
                self.probe_interval.pop(r, None)
                out[r] = (k, False)
        if tree and any(n for n, _ in out.values()):
            self.tree_sizes[tree] = self.tree_sizes.get(tree, 0) + 1
        return out

    def _best(self, request_ids: list[str], shapes: list[int]) -> tuple[tuple[int, int], float]:
        """The ``(k, shape)`` of the highest expected rate among ``shapes`` (a tie: the shorter draft, the smaller
        tree), and that rate."""
        rates = {(c, t): self.rate(c, request_ids, t) for t in shapes for c in self.lengths(t)}
        best = max(rates, key=lambda c: (rates[c], -c[0], -c[1]))
        return best, rates[best]

    def measured(self, shape: int) -> bool:
        """Whether a shape may be planned: it was measured, and a tree smaller than the whole one over at least
        ``min_rounds`` rounds (each larger round teaches it, :func:`tree_record`: on one round's evidence all sizes
        look alike and the cheapest wins, then a few unlucky rounds of each size in turn switched a SmolLM2 EAGLE-3
        tree of 12 nodes to chains at T = 0 for the rest of the prompt, tau 1.6 against 2.1 for the whole tree)."""
        rounds = self.learnt(shape).rounds
        small = 0 < shape < self.shapes()[-1]
        return rounds > 0 and (not small or rounds >= self.config.min_rounds)

    def learning(self, k: int, request_ids: list[str], tree: int = 0) -> bool:
        """Whether the planner is still learning: fewer than ``min_rounds`` drafted rounds were verified, and drafting
        ``k`` tokens (of a tree, when ``tree``) pays at the prior acceptance (every ``a_i`` = 0.5). Speculation then
        stays on (:class:`PlannerConfig`)."""
        if self.drafted_rounds >= self.config.min_rounds:
            return False
        batch = len(request_ids)
        prior = expected_tokens(Acceptance().rates(k)) / self.round_time(k, batch, tree)
        return prior > (1.0 + self.config.off_margin) / self.round_time(0, batch)

    def explore(self, k: int, tree: int, batch: int = 1) -> tuple[int, int]:
        """The planned ``(k, tree)``, or on an exploring round (:class:`PlannerConfig` ``explore_every``) what the
        plan does not measure: the longest chain after a shorter one, the whole tree after chains or a smaller tree,
        and chains after a tree (the plan's unmeasured shapes take turns), spaced like probes so that their extra
        time is at most ``probe_overhead`` of the plan's."""
        cfg = self.config
        if (k, tree) != self._plain:  # a new plan: explore soon again
            self._plain, self._since_explore, self._explore_interval = (k, tree), 0, cfg.explore_every
        others = []  # what the plan leaves unmeasured
        whole = self.shapes()[-1]
        if k and not tree and k < cfg.max_k:
            others.append((cfg.max_k, 0))
        if k and tree != whole and whole:
            others.append((self.lengths(whole)[0], whole))
        if k and tree and 0 in self.shapes() and not self.chains_inferred:
            others.append((cfg.max_k, 0))
        if not cfg.explore_every or not others:
            return k, tree
        self._since_explore += 1
        if self._since_explore < self._explore_interval:
            return k, tree
        other = others[self.explored % len(others)]
        planned = self.round_time(k, batch, tree)
        extra = self.round_time(other[0], batch, other[1]) - planned
        if planned > 0 and self._since_explore < extra / (cfg.probe_overhead * planned) - 1e-9:
            return k, tree
        self._since_explore = 0
        self._explore_interval = min(2 * self._explore_interval, max(cfg.max_explore_every, cfg.explore_every))
        self.explored += 1
        return other

    def new_drafter(self) -> None:
        """A restarted drafter (a respawned SSD speculator): forget the drafting cost learnt from the old one, whose
        last rounds waited on a dead or hung process, and probe every request again soon (acceptance is kept: the
        draft model is the same)."""
        self._reset_draft_costs()
        self.warm_rounds_left = self.config.warm_rounds
        self.probe_interval.clear()
        self.idle_rounds.clear()

    def probe_spacing(self, batch: int, tree: int | None = None) -> int:
        """Fewest rounds between a request's probes (of this shape; default: the planned round's) for them to cost
        at most ``probe_overhead`` of the time of plain decoding (from the cost table and the learnt drafting
        cost)."""
        tree = self.tree_round if tree is None else tree
        plain = self.round_time(0, batch)
        extra = self.round_time(self.probe_length(tree), batch, tree) - plain + self.catch_up_cost
        return max(1, math.ceil(extra / (self.config.probe_overhead * plain) - 1e-9)) if plain > 0 else 1

    def observe(self, drafted: dict[str, tuple[int, int]], draft_seconds: float, verify_seconds: float,
                width: int, catch_up_seconds: float = 0.0, probe: bool = False, tree: int | None = None,
                chances: dict[str, list[float]] | None = None) -> None:
        """Learn from a verified round.

        Args:
            drafted: ``{request_id: (num_drafted, num_accepted)}`` for the round's rows (a tree's depth as
                ``num_drafted``, its accepted path's length as ``num_accepted``).
            draft_seconds / verify_seconds: the round's measured drafting and verification time.
            width: new tokens per row in the verify forward (longest draft + 1).
            catch_up_seconds: the part of ``draft_seconds`` the drafter spent feeding the tokens of rounds it
                skipped (:meth:`NeuralDrafter.catch_up <ssd_eagle.drafters.neural.NeuralDrafter.catch_up>`): paid
                by a probe or the first round back, not by drafting, so it is learnt apart from ``D(K)`` and
                counted in the probes' spacing.
            probe: the round was a probe: its acceptance is learnt, its drafting time is not (an SSD probe is
                drafted by the backup after idle rounds, and a stale cost of it kept speculation off for good).
            tree: the round's shape as planned (default: ``tree_round``); what it teaches goes to that shape's
                :class:`Learnt` (an SSD tree's miss answered by an n-gram chain teaches the tree's mean wait).
            chances: for sampled rows, the chance each tried position had to be accepted
                (:meth:`Acceptance.record_chances`), learnt instead of ``drafted``'s draw. Simulated with
                SmolLM2-like rates, 2 requests x 64 tokens at T = 1 (0.5): a planned chain 1.392 -> 1.431 (1.489 ->
                1.517) x AR, chains competing with a tree 1.327 -> 1.401 (1.483 -> 1.507).
        """
        if not drafted:
            return
        tree = self.tree_round if tree is None else tree
        learnt = self.learnt(tree)
        if catch_up_seconds > 0 and self.config.learn_costs:
            self.catch_up_cost = 0.7 * self.catch_up_cost + 0.3 * catch_up_seconds if self.catch_up_cost \
                else catch_up_seconds
            draft_seconds -= catch_up_seconds
        chances = chances or {}
        for r, (n, k) in drafted.items():
            for acceptance in learnt.records(r, self.greedy.get(r)):
                if r in chances:
                    acceptance.record_chances(chances[r])
                else:
                    acceptance.record(n, k)
        self.drafted_rounds += any(n > 0 for n, _ in drafted.values())
        if not self.config.learn_costs:
            return
        longest = max(n for n, _ in drafted.values())
        if longest and tree:  # a tree grows all its levels whatever depth its best nodes reach
            longest = self.lengths(tree)[0]
        if longest and not self.warm_rounds_left and not probe:
            learnt.draft_cost.update(longest, draft_seconds)
        if longest:
            self.warm_rounds_left = max(self.warm_rounds_left - 1, 0)
        predicted = self.costs.verify_time(width, len(drafted))
        if predicted > 0 and math.isfinite(verify_seconds):
            self.verify_scale = 0.9 * self.verify_scale + 0.1 * (verify_seconds / predicted)

    def plan(self, seqs: list, budgets: list[int], totals: SpecStats | None = None) -> list[int]:
        """The engine's hook before drafting: each sequence's draft budget cut to the planned length. The decision
        is recorded in every sequence's ``stats`` and in ``totals`` (the engine's aggregate), as
        :meth:`SpecStats.record_plan <ssd_eagle.stats.SpecStats.record_plan>`. Rows with no room to draft (a
        zero budget: at their max_tokens) decode plainly and take no part in the decision (nor in its probes and
        exploring rounds, which they would spend on nothing)."""
        self.greedy.update((s.request_id, bool(s.params.greedy)) for s in seqs)
        active = [s.request_id for s, b in zip(seqs, budgets) if b > 0]
        plan = self.decide(active) if active else {}
        self.probing = any(probe for _, probe in plan.values())
        for seq in seqs:
            k, probe = plan.get(seq.request_id, (0, False))
            for stats in (seq.stats, totals) if totals is not None else (seq.stats,):
                stats.record_plan(k, probe, tree=self.tree_round if k else 0)
        out = [min(b, plan[s.request_id][0]) if b > 0 else 0 for s, b in zip(seqs, budgets)]
        self.budgets = {s.request_id: b for s, b in zip(seqs, out)}
        return out

    def observe_round(self, seqs: list, proposals: list, paths: list[list[int]], draft_seconds: float,
                      verify_seconds: float, catch_up_seconds: float = 0.0,
                      chances: dict[str, list] | None = None) -> None:
        """The engine's hook after verifying: learn from the round (a tree row as its depth and accepted path, and
        every smaller tree size from the same row, :func:`tree_record`). ``chances``: for sampled rows, a chain's
        chance of acceptance per tried position (see :meth:`observe`), a tree's
        :func:`~ssd_eagle.verify.tree_child_probs`."""
        chances = dict(chances or {})
        shape = self.tree_round
        trees = [(s.request_id, p, path) for s, p, path in zip(seqs, proposals, paths) if p.parents is not None]
        child_probs = {r: chances[r] for r, _, _ in trees if r in chances}
        # the levels each tree grew: the planned depth within the row's budget (a row near its max_tokens grows
        # fewer); a tree without ranks (an SSD speculator's, whose build may stop early) as deep as it is
        planned = self.lengths(shape)[0] if shape else 0
        grown = {r: min(planned, self.budgets.get(r, planned)) if p.ranks is not None else p.depth
                 for r, p, _ in trees}
        for r, p, path in trees:
            if r in child_probs:
                chances[r] = tree_record(p, path, len(p.tokens), grown[r], child_probs[r])
        drafted = {s.request_id: (grown[s.request_id] if p.parents is not None else p.depth, len(path))
                   for s, p, path in zip(seqs, proposals, paths)}
        width = 1 + max((len(p.tokens) for p in proposals), default=0)
        self.observe(drafted, draft_seconds, verify_seconds, width, catch_up_seconds, self.probing, chances=chances)
        for size in (n for n in self.shapes() if 0 < n < shape):  # smaller trees: what the round's would have done
            learnt = self.trees[size]
            for r, p, path in trees:
                if p.ranks is None and size < len(p.tokens):
                    continue
                record = tree_record(p, path, size, grown[r], child_probs.get(r))
                for acceptance in learnt.records(r, self.greedy.get(r)):
                    acceptance.record_chances(record) if r in child_probs else acceptance.record(*record)
        self.chains_inferred = False
        if shape and 0 in self.shapes():  # greedy rows: what a chain would have accepted, for free
            inferred = {s.request_id: greedy_chain_record(p.parents, path)
                        for s, p, path in zip(seqs, proposals, paths) if s.params.greedy and p.parents is not None}
            for r, (n, k) in inferred.items():
                for acceptance in self.chain.records(r, True):
                    acceptance.record(n, k)
            # (chains past a shallower tree's depth are still explored)
            self.chains_inferred = len(inferred) == len(seqs) and self.lengths(shape)[0] >= self.config.max_k

    def forget(self, request_id: str) -> None:
        for learnt in (self.chain, *self.trees.values()):
            learnt.acceptance.pop(request_id, None)
        self.idle_rounds.pop(request_id, None)
        self.probe_interval.pop(request_id, None)
        self.greedy.pop(request_id, None)

    def summary(self) -> dict:
        """JSON-ready planner state: rounds per chosen K (exploring rounds included), the rounds planned as trees
        (and per tree size, when there are several), the exploring rounds and the engine-wide acceptance per
        position of chains and of the whole tree (the chance that its accepted path reaches each depth)."""
        out = {"k_decisions": dict(sorted(self.decisions.items())), "tree_rounds": self.tree_rounds,
               "explored": self.explored}
        shapes = self.shapes()
        if len([n for n in shapes if n]) > 1:
            out["tree_size_rounds"] = dict(sorted(self.tree_sizes.items()))
        for shape in (n for n in shapes if n in (0, shapes[-1])):
            name = "tree_acceptance_per_depth" if shape else "acceptance_per_position"
            out[name] = [round(a, 4) for a in self.learnt(shape).engine_wide.rates(self.lengths(shape)[-1])]
        return out


def tree_size_ladder(nodes: int) -> tuple[int, ...]:
    """The tree sizes an SD tree drafter's rounds choose among: ``nodes`` halved (rounded up) down to 2, e.g.
    12 -> (2, 3, 6, 12): every size is learnt from the larger rounds (:func:`tree_record`), so a size's first
    estimate needs no round of its own, and a verification over fewer nodes is what it saves."""
    sizes = {nodes}
    while nodes > 2:
        nodes = (nodes + 1) // 2
        sizes.add(nodes)
    return tuple(sorted(sizes))


def planner_for(engine, spec) -> Planner | None:
    """The planner of an engine built from a speculative config whose ``adaptive`` is on, on a single-device target
    (None otherwise: a tensor-parallel target, ``adaptive: false``). Measures (or reads back) the verify cost table,
    and for an SD neural drafter its drafting costs (:func:`measure_draft_costs`), so call it before any request is
    admitted.

    K in 0..K is the planner's to choose unless ``num_speculative_tokens`` was given explicitly (then only 0 or K),
    for SD and SSD alike; a tree (``tree_budget``) is planned on or off (:class:`PlannerConfig`), so that a tree
    whose drafts do not pay falls back to plain decoding too, and in SD chains and smaller trees (its best nodes,
    :func:`tree_size_ladder`) also compete with it round by round (``chains``, ``tree_sizes``; the drafter is told
    each round's shape, :meth:`~ssd_eagle.drafters.base.Drafter.set_shape`). For
    SSD the round's ``draft_seconds`` is the verifier's wait for the speculator: about nothing on a cache hit and a
    backup drafting k tokens on a miss, so the learnt line ``d0 + d1 k`` is the mean wait ``(1 - p) D_backup(k)`` at
    the measured hit rate p, and the planner picks the k that maximises ``E(k) / (V(k + 1) + wait(k))``, which is
    SD's rule with SD's draft time replaced by SSD's wait: wherever a
    hit saves drafting, SSD's plan is at least SD's. The speculator still builds K-chains (its fan-out and time
    budget are sized for K); a reply is cut to the planned k (a prefix of a cached chain is still a proposal).
    While off, the verifier sends the speculator nothing (the outcomes go, merged, with the next request) and the
    speculator builds nothing, so a round off costs what an AR step costs; a probe is drafted from the committed
    text, as in SD (:mod:`ssd_eagle.ssd.speculator`). An in-line speculator (``speculator: local``, for tests
    and debugging: its builds run on the verifier's time) is not planned, so that it runs exactly what its config
    says.
    """
    from ssd_eagle.drafters.backends import DraftBackend
    from ssd_eagle.model_runner import ModelRunner
    from ssd_eagle.ssd.client import LocalSpeculator

    mode = getattr(engine.drafter, "mode", "sd")
    if not spec.adaptive or mode not in ("sd", "ssd") or not isinstance(engine.target, ModelRunner):
        return None
    if isinstance(getattr(engine.drafter, "speculator", None), LocalSpeculator):
        return None
    tree = spec.tree_settings()
    chains = tree is None or mode == "sd"  # (an SD tree drafter drafts chains too; an SSD speculator builds trees)
    k = spec.num_speculative_tokens if chains else tree.depth
    static = getattr(engine, "static", None) is not None  # (CUDA graphs: a round's widths pad to captured ones)
    costs = measure_verify_costs(engine.target, spec.max_draft_tokens + 1, engine.max_num_seqs,
                                 forward=engine._verify_forward if static else None)
    backend = getattr(engine.drafter, "backend", None)  # (an SD neural drafter's; SSD's wait is learnt online)
    measure = mode == "sd" and isinstance(backend, DraftBackend)
    draft_costs = measure_draft_costs(backend, k) if measure and chains else None
    tree_costs = measure_draft_costs(backend, tree.depth, tree) if measure and tree is not None else None
    choose_k = "num_speculative_tokens" not in spec.model_fields_set
    mixed = tree is not None and chains
    return Planner(PlannerConfig(max_k=k, choose_k=choose_k, tree_nodes=tree.budget if tree else 0,
                                 chains=mixed, tree_depth=tree.depth if tree else 0,
                                 tree_sizes=tree_size_ladder(tree.budget) if mixed else (),
                                 explore_every=SHAPE_EXPLORE_EVERY if mixed else PlannerConfig.explore_every,
                                 warm_rounds=3 if mode == "ssd" else 1, min_cost_rounds=3.5 if mode == "ssd" else 0.0,
                                 min_rounds=MIN_ROUNDS), costs, draft_costs, tree_costs)
