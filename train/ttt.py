"""Training-time test (TTT) of EAGLE-3 heads, its loss, and the teacher-forced acceptance estimate.

Coordinates (the same as serving, :mod:`ssd_eagle.drafters.eagle3`): position ``t`` of the head pairs the target
feature ``f_t`` with the next token ``x_{t+1}`` and predicts ``x_{t+2}``. The target's next-token distribution at
position ``s`` is ``p_s`` (it predicts ``x_{s+1}``). Unrolling ``K`` steps (``docs/design.md`` section 4):

    step 0:  h^0_t = head(x_{t+1}, fc(f_t)),      rotary position t,      predicts x_{t+2}, target p_{t+1}
    step i:  h^i_t = head(x_{t+1+i}, h^{i-1}_t),  rotary position t + i,  predicts x_{t+2+i}, target p_{t+1+i}

Step ``i`` at position ``t`` simulates the ``i``-th draft of a chain started after ``x_{t+1}``: it attends to the
step-0 keys of positions ``<= t`` (the context the head built from target features) and to its own earlier-step
keys at position ``t`` (the drafts before it in the chain): a causal block followed by ``i`` diagonal blocks
(:func:`ttt_attention_mask`). The keys of step ``j`` carry rotary position ``t + j``, exactly as in chain drafting.
The unroll calls :class:`~ssd_eagle.models.eagle3.Eagle3DraftModel` ``forward`` -- the serving code -- with a
:class:`StepCache` that concatenates the steps' keys/values.

Loss: ``sum_i decay**i * CE_i`` with ``CE_i`` the mean soft cross-entropy between ``p_{t+1+i}`` restricted to the
draft vocabulary (renormalised) and the head's distribution, over the valid positions of step ``i``: the chain's
predicted tokens ``x_{t+2} .. x_{t+2+i}`` all lie in one assistant span (``loss_mask``) and the target's argmax at
``t+1+i`` is in the draft vocabulary.

Saguaro-aware objective (:class:`SaguaroObjective`, issue 7). Serving with Saguaro sampling ``(C, F)``, a round
stalls at a drafted position when the draft token is rejected and the bonus token drawn from the residual
``norm(max(p - q_C, 0))`` is not among the top-F candidates the speculator cached. The probability that it does not
stall, ``P_ns(p, q; C, F)``, has a closed form that is differentiable in q
(:func:`ssd_eagle.ssd.fanout.nonstall_probability`, derivation there). The objective adds, at every valid position of
step ``i``, ``weight * decay**i * -log P_ns(p_T, q_T; C, F)`` with ``p_T``, ``q_T`` the target's and the head's
distributions over the draft vocabulary at the serving temperature ``T`` (``p_T = norm(p^(1/T))`` is the tempered
target restricted to the draft vocabulary, exactly). The cross-entropy term keeps q close to p (tau), the non-stall
term shapes where q's top-(F+1) and its residual fall (cache hits). Approximation: the target's mass outside the
draft vocabulary (a few percent) is left out of ``p``, as in the cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


# ----------------------------------------------------------------------------------------------------------------
# shifting and masks

def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """``out[:, t] = x[:, t + k]``, ``fill`` past the end. ``x`` is [B, n, ...]."""
    if k == 0:
        return x
    n = x.shape[1]
    out = torch.full_like(x, fill)
    if k < n:
        out[:, : n - k] = x[:, k:]
    return out


def ttt_attention_mask(n: int, step: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive mask of TTT step ``step`` (0-based): [1, 1, n, (step + 1) * n].

    Keys are ordered by step, then position: block 0 is causal (query t sees step-0 keys s <= t), blocks 1..step are
    diagonal (query t sees only its own position's key of that step). 0 = visible, ``finfo(dtype).min`` = hidden.
    """
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    visible = torch.cat([causal] + [eye] * step, dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def chain_masks(loss_mask: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``m[i][:, t] = prod_{j <= i} loss_mask[:, t + 2 + j]``: the first ``i + 1`` drafts of a chain started after
    ``x_{t+1}`` are all assistant tokens. ``loss_mask`` [B, n] 0/1 -> bool [num_steps, B, n]."""
    masks = []
    running = torch.ones_like(loss_mask, dtype=torch.bool)
    for i in range(num_steps):
        running = running & shift_left(loss_mask.bool(), 2 + i, False)
        masks.append(running)
    return torch.stack(masks)


class StepCache:
    """Keys/values of the TTT steps so far, handed to transformers' ``LlamaAttention`` as its ``cache``.

    ``update`` appends the step's ``[B, kv_heads, n, head_dim]`` keys/values and returns all steps concatenated
    along the key axis (step-major), the layout :func:`ttt_attention_mask` describes.
    """

    is_compileable = False

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx: int = 0, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(k.shape[2] for k in self.keys)


@dataclass
class StepOutput:
    """One TTT step's outputs.

    Attributes:
        hidden: [B, L, H] pre-norm outputs (``head.compute_logits`` gives the logits).
        positions: int64 [B, L], the sequence position ``t`` of each row (the chain started after ``x_{t+1}``).
        valid: bool [B, L], False on padding rows of a compacted step.
    """

    hidden: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


def _compact_rows(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions where ``keep`` [B, n] is True, left-aligned per row and padded with 0: ``(pos [B, m], valid)``."""
    counts = keep.sum(1)
    m = max(int(counts.max()), 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :m]
    valid = torch.arange(m, device=keep.device)[None] < counts[:, None]
    return torch.where(valid, order, 0), valid


def ttt_unroll(head, input_ids: torch.Tensor, aux_hidden: torch.Tensor, num_steps: int,
               keep: torch.Tensor | None = None) -> list[StepOutput]:
    """Run the head's TTT unroll.

    Args:
        head: an :class:`~ssd_eagle.models.eagle3.Eagle3DraftModel` with embeddings attached (the target's, or
            its own table for a head of another width: nothing here assumes H == H_target).
        input_ids: int64 [B, n], the sequence ``x``.
        aux_hidden: [B, n, 3 * H_target], the target's aux hidden states ``f`` (low, mid, high).
        num_steps: K >= 1.
        keep: bool [B, n], the positions whose chains matter after step 0 (e.g. ``chain_masks(...)[1]``). Steps
            >= 1 then run only there: a query at position t still sees every step-0 key ``s <= t`` and its own
            earlier-step keys, so the kept rows are computed exactly as without ``keep`` (fewer rows, same
            values). None computes every position at every step.

    Returns:
        K :class:`StepOutput`; step 0 always covers all n positions.
    """
    b, n = input_ids.shape
    device = input_ids.device
    dtype = head.lm_head.weight.dtype
    positions = torch.arange(n, device=device)[None].expand(b, n)
    cache = StepCache()
    mask = ttt_attention_mask(n, 0, dtype, device).expand(b, 1, n, n)
    hidden = head(shift_left(input_ids, 1), head.fuse(aux_hidden.to(dtype)), positions, mask, cache)
    everywhere = torch.ones(b, n, dtype=torch.bool, device=device)
    outs = [StepOutput(hidden, positions, everywhere)]
    if num_steps == 1:
        return outs
    if keep is None:
        rows, valid = positions, everywhere
    else:
        rows, valid = _compact_rows(keep)
        hidden = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
    m = rows.shape[1]
    minimum = torch.finfo(dtype).min
    context = (torch.arange(n, device=device)[None, None, :] <= rows[:, :, None])  # [B, m, n]: step-0 keys s <= t
    eye = torch.eye(m, dtype=torch.bool, device=device)[None].expand(b, m, m)
    padded_ids = torch.cat([input_ids, input_ids.new_zeros(b, num_steps + 1)], dim=1)
    for i in range(1, num_steps):
        visible = torch.cat([context] + [eye] * i, dim=2)
        step_mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, minimum)[:, None]
        ids = padded_ids.gather(1, rows + 1 + i)
        hidden = head(ids, hidden, rows + i, step_mask, cache)
        outs.append(StepOutput(hidden, rows, valid))
    return outs


# ----------------------------------------------------------------------------------------------------------------
# target distribution restricted to the draft vocabulary

@dataclass
class DraftTargets:
    """The target's next-token distributions restricted to the draft vocabulary, per position s.

    Attributes:
        p: float32 [B, n, D], ``softmax`` of the target logits over the draft vocabulary (renormalised).
        in_vocab: bool [B, n], the target's argmax (over its full vocabulary) is in the draft vocabulary.
        argmax_draft: int64 [B, n], the draft id of that argmax (meaningful where ``in_vocab``).
    """

    p: torch.Tensor
    in_vocab: torch.Tensor
    argmax_draft: torch.Tensor


@torch.no_grad()
def draft_targets(last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, draft_target_ids: torch.Tensor,
                  t2d: torch.Tensor, argmax: torch.Tensor | None = None, chunk: int = 1024) -> DraftTargets:
    """Recompute ``p`` through the target's frozen output layer.

    Args:
        last_hidden: [B, n, H_target], the target's final-normed hidden states.
        lm_head_weight: [V, H_target], the target's output layer.
        draft_target_ids: int64 [D], target id of every draft id (``arange + d2t``, ascending).
        t2d: bool [V].
        argmax: int64 [B, n], the target's greedy next token when already known (offline features store it);
            None computes it from full logits, ``chunk`` positions at a time.
    """
    h = last_hidden.float()
    w = lm_head_weight.float()
    logits = h @ w[draft_target_ids].T
    p = torch.softmax(logits, dim=-1)
    if argmax is None:
        flat = h.reshape(-1, h.shape[-1])
        argmax = torch.cat([(flat[i:i + chunk] @ w.T).argmax(-1) for i in range(0, flat.shape[0], chunk)])
        argmax = argmax.view(h.shape[:-1])
    argmax = argmax.long()
    in_vocab = t2d[argmax]
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1
    return DraftTargets(p=p, in_vocab=in_vocab, argmax_draft=target_to_draft[argmax].clamp_min(0))


# ----------------------------------------------------------------------------------------------------------------
# loss

@dataclass(frozen=True)
class SaguaroObjective:
    """The Saguaro-aware term of the TTT loss (module docstring).

    Attributes:
        c: Saguaro's scale C in (0, 1]; fanout: F >= 0, the cached bonus candidates per position.
        weight: multiplier of ``-log P_ns`` against the cross-entropy; temperature: the serving temperature T > 0.
    """

    c: float
    fanout: int
    weight: float = 1.0
    temperature: float = 1.0

    def stall_loss(self, logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(-log P_ns [m], P_ns [m] detached)`` for head logits [m, D] and the target's p [m, D] (T = 1)."""
        from ssd_eagle.ssd.fanout import nonstall_probability

        t = self.temperature
        q = torch.softmax(logits / t, dim=-1)
        p_t = p if t == 1.0 else torch.softmax(torch.log(p.clamp_min(1e-30)) / t, dim=-1)
        ns = nonstall_probability(p_t, q, self.c, self.fanout)
        return -torch.log(ns.clamp_min(1e-6)), ns.detach()


@dataclass
class TTTOutput:
    """What one TTT forward returns.

    Attributes:
        loss: scalar, ``sum_i decay**i * step_loss[i]`` (differentiable).
        step_loss: float [K], mean soft cross-entropy per step (detached).
        step_correct: float [K], valid positions whose draft argmax equals the target's argmax.
        step_count: float [K], valid positions per step.
        draft_argmax: int64 [K, B, n] draft ids of each step's argmax (for acceptance estimates); -1 where no
            logits were computed.
        step_nonstall: float [K], summed ``P_ns`` over the valid positions of each step (with a
            :class:`SaguaroObjective`; None without).
    """

    loss: torch.Tensor
    step_loss: torch.Tensor
    step_correct: torch.Tensor
    step_count: torch.Tensor
    draft_argmax: torch.Tensor = field(repr=False)
    step_nonstall: torch.Tensor | None = None


class _SoftCrossEntropy(torch.autograd.Function):
    """``logsumexp(z) - sum(p * z)`` per row (= soft cross-entropy when ``p`` sums to 1), with the fused gradient
    ``(softmax(z) - p) * g``; cheaper than ``F.cross_entropy`` with probability targets on CPU."""

    @staticmethod
    def forward(ctx, logits, p):
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(logits, p, lse)
        return lse - (p * logits).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, p, lse = ctx.saved_tensors
        out = torch.exp(logits - lse[:, None])
        out.sub_(p).mul_(grad[:, None])
        return out, None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Row-wise ``-sum(p * log_softmax(logits))`` for float32 [m, D] logits and a distribution ``p`` [m, D]."""
    return _SoftCrossEntropy.apply(logits, p)


def ttt_loss(head, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor,
             targets: DraftTargets, num_steps: int, decay: float,
             saguaro: SaguaroObjective | None = None) -> TTTOutput:
    """Unroll ``num_steps`` and compute the weighted loss and per-step accuracy (module docstring).

    Steps >= 1 run only at positions whose chain of two or more drafts lies in an assistant span, and logits are
    computed only where step i's chain does (the others never reach the loss or the acceptance estimate);
    ``draft_argmax`` is -1 elsewhere.

    Args:
        input_ids: int64 [B, n]; loss_mask: [B, n] 0/1 (``loss_mask[t] = 1``: ``x_t`` is an assistant token);
        aux_hidden: [B, n, 3 * H_target]; targets: :func:`draft_targets` of the same sequence.
        saguaro: add the Saguaro-aware non-stall term (module docstring).
    """
    chains = chain_masks(loss_mask, num_steps)
    outs = ttt_unroll(head, input_ids, aux_hidden, num_steps, keep=chains[1] if num_steps > 1 else None)
    total = aux_hidden.new_zeros((), dtype=torch.float32)
    step_loss, step_correct, step_count, argmaxes, step_nonstall = [], [], [], [], []
    for i, out in enumerate(outs):
        b_idx, l_idx = (out.valid & chains[i].gather(1, out.positions)).nonzero(as_tuple=True)
        t_idx = out.positions[b_idx, l_idx]
        s_idx = t_idx + 1 + i  # the target position whose distribution step i learns (< n by the chain mask)
        logits = head.compute_logits(out.hidden[b_idx, l_idx]).float()
        valid = targets.in_vocab[b_idx, s_idx]
        count = valid.sum()
        ce = soft_cross_entropy(logits, targets.p[b_idx, s_idx])
        mean = (ce * valid).sum() / count.clamp_min(1)
        total = total + (decay ** i) * mean
        if saguaro is not None:
            stall, ns = saguaro.stall_loss(logits, targets.p[b_idx, s_idx])
            total = total + (decay ** i) * saguaro.weight * (stall * valid).sum() / count.clamp_min(1)
            step_nonstall.append((ns * valid).sum())
        pred = logits.detach().argmax(-1)
        full = torch.full_like(input_ids, -1)
        full[b_idx, t_idx] = pred
        argmaxes.append(full)
        step_loss.append(mean.detach())
        step_correct.append(((pred == targets.argmax_draft[b_idx, s_idx]) & valid).sum().float())
        step_count.append(count.float())
    return TTTOutput(loss=total, step_loss=torch.stack(step_loss), step_correct=torch.stack(step_correct),
                     step_count=torch.stack(step_count), draft_argmax=torch.stack(argmaxes),
                     step_nonstall=torch.stack(step_nonstall) if saguaro is not None else None)


# ----------------------------------------------------------------------------------------------------------------
# teacher-forced acceptance

def eagle3_hits(draft_argmax: torch.Tensor, draft_target_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``hits[b, t, i]``: the i-th draft of the chain started after ``x_{t+1}`` is ``x_{t+2+i}``.

    Args:
        draft_argmax: int64 [K, B, n] draft ids (:class:`TTTOutput`); draft_target_ids: int64 [D];
        input_ids: int64 [B, n].

    Returns:
        bool [B, n, K].

    Teacher forcing is exact here: along an accepted prefix the drafts equal the text, so a chain fed with the
    text's tokens computes what the head computes feeding back its own drafts.
    """
    k = draft_argmax.shape[0]
    tokens = torch.where(draft_argmax >= 0, draft_target_ids[draft_argmax.clamp_min(0)], -2)
    return torch.stack([tokens[i] == shift_left(input_ids, 2 + i, -1) for i in range(k)], dim=-1)


def feature_fed_hits(hits: torch.Tensor) -> torch.Tensor:
    """``out[b, t, i] = hits[b, t + i, 0]``: the chain an EAGLE-3 head would draft if every step got the target's
    feature instead of the head's own output (step 0 at rows ``t .. t + K - 1``): its tau against the real chain's
    is what self-feeding costs. ``hits`` bool [B, n, K] (:func:`eagle3_hits`) -> bool [B, n, K]; False past the end."""
    first = hits[..., 0]
    return torch.stack([shift_left(first, i, False) for i in range(hits.shape[-1])], dim=-1)


def draft_lm_hits(argmax: torch.Tensor, input_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
    """``hits[b, t, i]`` for a draft LM: its prediction at position ``t + 1 + i`` is ``x_{t+2+i}``.

    Args:
        argmax: int64 [B, n], the draft LM's greedy prediction at each position (for ``x_{s+1}``; -1 where none
            was computed).

    Returns:
        bool [B, n, num_steps], the same layout as :func:`eagle3_hits`.
    """
    correct = (argmax == shift_left(input_ids, 1, -1)) & (argmax >= 0)
    return torch.stack([shift_left(correct, 1 + i, False) for i in range(num_steps)], dim=-1)


@dataclass
class AcceptanceStats:
    """Greedy chain-drafting rounds simulated on text the target generated.

    Attributes:
        rounds: verification rounds; emitted: tokens emitted by them (accepted drafts + the target's token).
        accepted_hist: ``accepted_hist[a]`` = rounds with ``a`` accepted drafts (0..K), counted like the engine's
            ``num_accepted``: before a span's end cuts the round short.
        accepted_lengths: the accepted drafts of every round, in order.
    """

    rounds: int = 0
    emitted: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list, repr=False)

    @property
    def tau(self) -> float:
        """Mean tokens per round (acceptance length)."""
        return self.emitted / self.rounds if self.rounds else math.nan

    def merge(self, other: AcceptanceStats) -> None:
        self.rounds += other.rounds
        self.emitted += other.emitted
        self.accepted_lengths += other.accepted_lengths
        if len(self.accepted_hist) < len(other.accepted_hist):
            self.accepted_hist += [0] * (len(other.accepted_hist) - len(self.accepted_hist))
        for a, c in enumerate(other.accepted_hist):
            self.accepted_hist[a] += c


def simulate_acceptance(hits: torch.Tensor, loss_mask: torch.Tensor, num_draft: int) -> AcceptanceStats:
    """Walk the assistant spans of one sequence as greedy speculative decoding with ``num_draft`` drafts a round.

    A span ``[r, e]`` (``loss_mask == 1``, ``e`` its end-of-turn token) starts after the prompt: ``x_r`` comes from
    the target's prefill, so the first round drafts after ``x_r`` (row ``t = r - 1`` of ``hits``). A round at row
    ``t`` accepts the leading run of hits (at most ``num_draft``), emits that plus the target's own token, capped by
    the tokens left in the span, and the next round starts after the last emitted token. Only emitted tokens are
    counted (``docs/design.md`` section 7).

    Args:
        hits: bool [n, K] (:func:`eagle3_hits` / :func:`draft_lm_hits` of one sequence), K >= ``num_draft``.
        loss_mask: [n] 0/1.
    """
    mask = loss_mask.bool().tolist()
    rows = hits[:, :num_draft].tolist()
    stats = AcceptanceStats(accepted_hist=[0] * (num_draft + 1))
    n = len(mask)
    r = 0
    while r < n:
        if not mask[r]:
            r += 1
            continue
        e = r
        while e + 1 < n and mask[e + 1]:
            e += 1
        last = r  # index of the last token known to the target
        while last < e and last >= 1:
            row = rows[last - 1]
            accepted = 0
            while accepted < num_draft and row[accepted]:
                accepted += 1
            emitted = min(accepted + 1, e - last)
            stats.rounds += 1
            stats.emitted += emitted
            stats.accepted_hist[accepted] += 1
            stats.accepted_lengths.append(accepted)
            last += emitted
        r = e + 1
    return stats
