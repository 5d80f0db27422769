"""Saguaro-aware draft training (issue 7): the TTT loss term equals ``-log P_ns`` of the head's own q, training
with it raises the non-stall probability, and sampling with a Saguaro-aware draft stays lossless. (That the trained
(C, F) travel with the exported head and serving with other values warns is tested with the other trainer runs in
``test_train_draft.py``: the trainer leaves a default process group, which must come after the SSD tests.)"""

from __future__ import annotations

import pytest
import torch

from ssd_eagle.sampling import sample
from ssd_eagle.ssd.fanout import nonstall_probability
from ssd_eagle.verify import rejection_verify, saguaro_scale
from train.config import ConfigError, config_from_dict
from train.ttt import SaguaroObjective, draft_targets, ttt_loss, ttt_unroll
from train_helpers import H, VOCAB, make_head


def _batch(head, seed=4, n=12):
    torch.manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, n))
    aux = torch.randn(2, n, 3 * H, dtype=torch.float64)
    loss_mask = torch.zeros(2, n, dtype=torch.long)
    loss_mask[0, 3:11] = 1
    loss_mask[1, 2:12] = 1
    w = torch.randn(VOCAB, H, dtype=torch.float64)
    last = torch.randn(2, n, H, dtype=torch.float64) * 2
    return ids, loss_mask, aux, draft_targets(last, w, head.draft_target_ids, head.t2d)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_loss_term_is_minus_log_nonstall_of_the_heads_q(temperature):
    head, _ = make_head(seed=3)
    ids, loss_mask, aux, targets = _batch(head)
    k, decay, objective = 2, 0.8, SaguaroObjective(c=0.6, fanout=2, weight=0.5, temperature=temperature)
    plain = ttt_loss(head, ids, loss_mask, aux, targets, k, decay)
    aware = ttt_loss(head, ids, loss_mask, aux, targets, k, decay, objective)
    assert plain.step_nonstall is None
    hidden = [o.hidden for o in ttt_unroll(head, ids, aux, k)]
    extra, n = 0.0, loss_mask.shape[1]
    for i in range(k):
        values = []
        for b in range(2):
            for t in range(n):
                s = t + 1 + i
                if not all(t + 2 + j < n and loss_mask[b, t + 2 + j] for j in range(i + 1)) \
                        or not bool(targets.in_vocab[b, s]):
                    continue
                q = torch.softmax(head.compute_logits(hidden[i][b, t]) / temperature, -1)
                p = targets.p[b, s] ** (1 / temperature)
                values.append(nonstall_probability(p / p.sum(), q, 0.6, 2))
        ns = torch.stack(values)
        torch.testing.assert_close(aware.step_nonstall[i].double(), ns.sum().double(), rtol=1e-6, atol=1e-8)
        extra = extra + decay ** i * 0.5 * (-torch.log(ns)).mean()
    torch.testing.assert_close(aware.loss.double(), plain.loss.double() + extra, rtol=1e-6, atol=1e-8)


def test_training_with_the_term_raises_nonstall_probability():
    """Same head, data and steps: the Saguaro-aware loss stalls less (1 - P_ns) than the plain one, at a small cost
    in cross-entropy (random targets the tiny head cannot fit exactly, as a real head cannot)."""
    results = {}
    for name, objective in [("plain", None), ("aware", SaguaroObjective(c=0.5, fanout=1))]:
        head, _ = make_head(seed=5)
        torch.manual_seed(6)
        ids = torch.randint(0, VOCAB, (6, 40))
        aux = torch.randn(6, 40, 3 * H, dtype=torch.float64)
        loss_mask = torch.ones(6, 40, dtype=torch.long)
        targets = draft_targets(torch.randn(6, 40, H, dtype=torch.float64), torch.randn(VOCAB, H, dtype=torch.float64),
                                head.draft_target_ids, head.t2d)
        opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
        for _ in range(40):
            opt.zero_grad()
            ttt_loss(head, ids, loss_mask, aux, targets, 1, 1.0, objective).loss.backward()
            opt.step()
        probe = ttt_loss(head, ids, loss_mask, aux, targets, 1, 1.0, SaguaroObjective(c=0.5, fanout=1))
        results[name] = (1 - float(probe.step_nonstall[0] / probe.step_count[0]), float(probe.step_loss[0]))
    (stall_plain, ce_plain), (stall_aware, ce_aware) = results["plain"], results["aware"]
    assert stall_aware < 0.85 * stall_plain, results
    assert ce_aware < 1.1 * ce_plain, results


def test_config_checks_name_the_fields():
    with pytest.raises(ConfigError, match="saguaro_c"):
        config_from_dict({"saguaro_c": 1.5})
    with pytest.raises(ConfigError, match="saguaro_c.*eagle3"):
        config_from_dict({"saguaro_c": 0.5, "draft": "draft_lm"})
    with pytest.raises(ConfigError, match="saguaro_fanout"):
        config_from_dict({"saguaro_c": 0.5, "saguaro_fanout": -1})
    with pytest.raises(ConfigError, match="saguaro_temperature"):
        config_from_dict({"saguaro_c": 0.5, "saguaro_temperature": 0})


def test_sampling_with_a_saguaro_aware_draft_stays_lossless():
    """A toy q trained for P_ns (not close to p) served with Saguaro scaling: the verified token's law is p."""
    v, c, fanout, n = 8, 0.5, 2, 60_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, -1)
    logits = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(40):
        opt.zero_grad()
        (-torch.log(nonstall_probability(p, torch.softmax(logits, -1), c, fanout))).backward()
        opt.step()
    q_c = saguaro_scale(torch.softmax(logits.detach(), -1), c, fanout)
    assert (q_c - p).abs().sum() > 0.1  # the draft differs from the target: the test exercises the residual
    gen = torch.Generator().manual_seed(1)
    drafts = sample(q_c.expand(n, v).clone(), [gen] * n)
    k, bonus = rejection_verify(p.expand(n, 2, v).clone(), q_c.expand(n, 1, v), drafts[:, None],
                                torch.ones(n, dtype=torch.long), [gen] * n)
    first = torch.where(k == 1, drafts, bonus)  # the token emitted at the drafted position
    freq = torch.bincount(first, minlength=v).double() / n
    chi2 = float(((freq - p) ** 2 / p).sum() * n)
    assert chi2 < 30.0, (chi2, freq, p)  # chi-square, 7 dof: p-value ~1e-4 at 30
