"""Draft training: TTT unroll and mask against a naive chain-drafting loop, the loss against a per-position
reference, acceptance simulation, config parsing, vocabulary kept on resume, aux ids of training equal to serving,
and one end-to-end ``deepspeed`` launch (loss decrease, resume, export)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from helpers import make_tiny_llama
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel, build_vocab_mapping
from ssd_eagle.platform import resolve_dtype
from train.config import ConfigError, config_from_dict, deepspeed_config, load_config, parse_args
from train.ttt import (
    chain_masks,
    draft_lm_hits,
    draft_targets,
    eagle3_hits,
    feature_fed_hits,
    simulate_acceptance,
    soft_cross_entropy,
    ttt_attention_mask,
    ttt_loss,
    ttt_unroll,
)
from train_helpers import H, REPO, VOCAB, make_head, run_trainer, tiny_config, write_tiny_setup


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return write_tiny_setup(tmp_path_factory.mktemp("tiny"))


# ----------------------------------------------------------------------------------------------------------------
# TTT unroll and mask

def test_attention_mask_is_causal_block_then_diagonals():
    m = ttt_attention_mask(4, 2, torch.float32)
    assert m.shape == (1, 1, 4, 12)
    visible = (m[0, 0] == 0)
    assert torch.equal(visible[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    for block in (1, 2):
        assert torch.equal(visible[:, 4 * block: 4 * block + 4], torch.eye(4, dtype=torch.bool))
    assert (m[0, 0][~visible] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_unroll_equals_naive_chain_drafting(attn):
    """Step i at position t equals drafting a chain after x_{t+1}: a fresh causal forward over the context pairs
    (x_{s+1}, fc(f_s)), s <= t, followed by the chain's own pairs (x_{t+1+j}, h^{j-1}) at positions t+j."""
    head, _ = make_head(attn=attn)
    tol = 1e-9 if attn == "sdpa" else 1e-5  # eager attention: softmax in float32 (1.2e-6 apart on an AVX2 EPYC)
    torch.manual_seed(1)
    n, k = 9, 4
    ids = torch.randint(0, VOCAB, (2, n))
    aux = torch.randn(2, n, 3 * H, dtype=torch.float64)
    with torch.no_grad():
        outs = [o.hidden for o in ttt_unroll(head, ids, aux, k)]
        fused = head.fuse(aux)
        padded = torch.cat([ids, torch.zeros(2, k + 1, dtype=torch.long)], dim=1)
        for b in range(2):
            for t in range(n):
                tokens = list(padded[b, 1: t + 2])
                hidden = [fused[b, s] for s in range(t + 1)]
                for j in range(k):
                    if j > 0:
                        tokens.append(padded[b, t + 1 + j])
                        hidden.append(prev)
                    m = len(tokens)
                    out = head(torch.stack(tokens)[None], torch.stack(hidden)[None], torch.arange(m)[None])
                    prev = out[0, -1]
                    torch.testing.assert_close(outs[j][b, t], prev, rtol=tol, atol=tol)


def test_compacted_unroll_equals_full_unroll_at_kept_rows():
    head, _ = make_head(seed=5)
    torch.manual_seed(6)
    n, k = 11, 4
    ids = torch.randint(0, VOCAB, (3, n))
    aux = torch.randn(3, n, 3 * H, dtype=torch.float64)
    keep = torch.rand(3, n) < 0.5
    keep[2] = False  # a row without any kept position
    with torch.no_grad():
        full = ttt_unroll(head, ids, aux, k)
        compact = ttt_unroll(head, ids, aux, k, keep=keep)
    assert compact[1].hidden.shape[1] == int(keep.sum(1).max())
    for i in range(1, k):
        out = compact[i]
        b_idx, l_idx = out.valid.nonzero(as_tuple=True)
        t_idx = out.positions[b_idx, l_idx]
        assert torch.equal(keep[b_idx, t_idx], torch.ones_like(t_idx, dtype=torch.bool))
        assert len(t_idx) == int(keep.sum())
        torch.testing.assert_close(out.hidden[b_idx, l_idx], full[i].hidden[b_idx, t_idx], rtol=1e-9, atol=1e-9)


def test_loss_and_accuracy_equal_per_position_reference():
    head, _ = make_head(seed=3)
    torch.manual_seed(4)
    n, k, decay = 12, 3, 0.8
    ids = torch.randint(0, VOCAB, (2, n))
    aux = torch.randn(2, n, 3 * H, dtype=torch.float64)
    loss_mask = torch.zeros(2, n, dtype=torch.long)
    loss_mask[0, 3:8] = 1
    loss_mask[0, 9:12] = 1
    loss_mask[1, 2:11] = 1
    w = torch.randn(VOCAB, H, dtype=torch.float64)
    last = torch.randn(2, n, H, dtype=torch.float64) * 2
    targets = draft_targets(last, w, head.draft_target_ids, head.t2d)
    assert (~targets.in_vocab).any() and targets.in_vocab.any()
    out = ttt_loss(head, ids, loss_mask, aux, targets, k, decay)

    outs = [o.hidden for o in ttt_unroll(head, ids, aux, k)]
    full_logits = last @ w.T
    used = head.draft_target_ids
    total = 0.0
    for i in range(k):
        losses, correct = [], 0
        for b in range(2):
            for t in range(n):
                chain = all(t + 2 + j < n and loss_mask[b, t + 2 + j] for j in range(i + 1))
                s = t + 1 + i
                if not chain or not bool(head.t2d[full_logits[b, s].argmax()]):
                    continue
                q = F.log_softmax(head.compute_logits(outs[i][b, t]), -1)
                p = torch.softmax(full_logits[b, s, used], -1)
                losses.append(-(p * q).sum())
                correct += int(used[q.argmax()] == full_logits[b, s].argmax())
        mean = torch.stack(losses).mean()
        total = total + decay ** i * mean
        torch.testing.assert_close(out.step_loss[i].double(), mean.detach(), rtol=1e-6, atol=1e-6)
        assert int(out.step_count[i]) == len(losses)
        assert int(out.step_correct[i]) == correct
    torch.testing.assert_close(out.loss.double(), total, rtol=1e-6, atol=1e-6)


def test_soft_cross_entropy_value_and_gradient():
    torch.manual_seed(0)
    z = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(5, 7, dtype=torch.float64), -1)
    g = torch.randn(5, dtype=torch.float64)
    ref = F.cross_entropy(z, p, reduction="none")
    (ref * g).sum().backward()
    grad_ref = z.grad.clone()
    z.grad = None
    ours = soft_cross_entropy(z, p)
    (ours * g).sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(z.grad, grad_ref)


def test_fused_kl_equals_autograd_reference():
    from train.draft_lm import kl_loss

    torch.manual_seed(0)
    h = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    th = torch.randn(2, 6, 8, dtype=torch.float64)
    w = torch.randn(30, 8, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1], [1, 1, 1, 1, 0, 0]])
    loss, argmax, valid = kl_loss(h, th, w, mask, chunk=3)
    loss.backward()
    grad = h.grad.clone()
    h.grad = None
    logq, logp = F.log_softmax(h.float() @ w.float().T, -1), F.log_softmax(th.float() @ w.float().T, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    rows = torch.zeros(2, 6, dtype=torch.bool)
    rows[:, :-1] = mask[:, 1:].bool()
    ref = kl[rows].mean()
    ref.backward()
    assert torch.equal(valid, rows)
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(argmax[rows], logq.argmax(-1)[rows]) and (argmax[~rows] == -1).all()


# ----------------------------------------------------------------------------------------------------------------
# acceptance simulation

def test_chain_masks_and_hits_layout():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    m = chain_masks(mask, 2)
    assert m[0, 0].tolist() == [1, 1, 1, 0, 0, 0]  # x_{t+2} is an assistant token
    assert m[1, 0].tolist() == [1, 1, 0, 0, 0, 0]  # x_{t+2}, x_{t+3} both
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    argmax = torch.tensor([[6, 0, 8, 9, 0, 1]])  # the draft LM predicts x_{s+1} at s
    hits = draft_lm_hits(argmax, ids, 2)
    assert hits[0, 0].tolist() == [False, True]  # chain after x_1: predictions at s=1 (wrong), s=2 (right)
    assert hits[0, 1].tolist() == [True, True]
    d2t_ids = torch.arange(12)
    draft_argmax = torch.full((2, 1, 6), -1)
    draft_argmax[0, 0, 1] = 8
    draft_argmax[1, 0, 1] = 9
    assert eagle3_hits(draft_argmax, d2t_ids, ids)[0, 1].tolist() == [True, True]
    assert not eagle3_hits(draft_argmax, d2t_ids, ids)[0, 2].any()


def test_feature_fed_hits_take_step_zero_of_the_later_rows():
    hits = torch.zeros(1, 5, 3, dtype=torch.bool)
    hits[0, :, 0] = torch.tensor([True, False, True, True, False])
    hits[0, 0, 1:] = True  # the self-fed steps of row 0 are ignored
    fed = feature_fed_hits(hits)[0]
    assert fed[0].tolist() == [True, False, True]  # row 0: step 0 at rows 0, 1, 2
    assert fed[2].tolist() == [True, True, False]
    assert fed[4].tolist() == [False, False, False]  # past the end


def test_simulate_acceptance_walk():
    # prompt 0..2, assistant span 3..12 (12 = end of turn); hits row t = chain after x_{t+1}
    n, k = 14, 3
    mask = torch.zeros(n, dtype=torch.long)
    mask[3:13] = 1
    hits = torch.zeros(n, k, dtype=torch.bool)
    hits[2] = torch.tensor([True, True, False])  # after x_3: accept 2, emit 3 -> last = 6
    hits[5] = torch.tensor([True, True, True])   # after x_6: accept 3, emit 4 -> last = 10
    hits[9] = torch.tensor([True, True, True])   # after x_10: 2 tokens left -> emit 2
    stats = simulate_acceptance(hits, mask, k)
    assert (stats.rounds, stats.emitted) == (3, 9)
    assert stats.tau == 3.0
    assert stats.accepted_hist == [0, 0, 1, 2] and stats.accepted_lengths == [2, 3, 3]  # before the end's cut
    none = simulate_acceptance(torch.zeros(n, k, dtype=torch.bool), mask, k)
    assert (none.rounds, none.emitted, none.tau) == (9, 9, 1.0)


def test_step_accuracy_counts_score_only_response_predictions():
    from train.heldout import step_accuracy_counts

    n = 14
    mask = torch.zeros(1, n, dtype=torch.long)
    mask[0, 3:13] = 1  # prompt 0..2, assistant span 3..12
    hits = torch.zeros(1, n, 2, dtype=torch.bool)
    hits[0, 2] = torch.tensor([True, True])
    hits[0, 5] = torch.tensor([True, False])
    hits[0, 11] = torch.tensor([True, True])  # predicts x_13, past the span: not scored
    correct, scored = step_accuracy_counts(hits, mask)
    assert correct.tolist() == [2, 1]
    assert scored.tolist() == [9, 8]  # rows 2..10 for step 0, 2..9 for step 1


# ----------------------------------------------------------------------------------------------------------------
# config

def test_yaml_and_command_line_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"draft": "eagle3", "lr": 1e-4, "aux_layer_ids": [2, 15, 27], "max_steps": 10}))
    cfg = parse_args(["--config", str(path), "--lr", "3e-4", "--ttt-steps=5", "--max_steps", "none",
                      "--resume", "false", "--local_rank=0", "--aux_layer_ids", "1,2,3"])
    assert cfg.lr == 3e-4 and cfg.ttt_steps == 5 and cfg.max_steps is None and cfg.resume is False
    assert cfg.aux_layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match="unknown config key 'lrr'.*did you mean lr"):
        parse_args(["--config", str(path), "--lrr", "1"])
    path.write_text(yaml.safe_dump({"ttt_step": 3}))
    with pytest.raises(ConfigError, match="unknown config key 'ttt_step'"):
        load_config(path)
    with pytest.raises(ConfigError, match="expects"):
        load_config(None, ["--max_steps", "ten"])
    with pytest.raises(ConfigError, match="features_dir"):
        load_config(None, ["--mode", "offline"])


def test_shipped_configs_parse():
    for name in ("smollm2-135m-eagle3.yaml", "smollm2-135m-draftlm.yaml", "smollm2-135m-eagle3-saguaro.yaml"):
        cfg = load_config(REPO / "configs" / name)
        assert cfg.data and cfg.output_dir
    eagle = load_config(REPO / "configs" / "smollm2-135m-eagle3.yaml")
    assert eagle.draft == "eagle3" and eagle.ttt_steps == 7 and eagle.ttt_decay == 0.8
    native_bf16 = resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu") == torch.bfloat16
    assert (eagle.adam_beta1, eagle.adam_beta2, eagle.grad_clip) == (0.9, 0.95, 0.5)
    assert eagle.dtype == ("bfloat16" if native_bf16 else "float32")  # dtype: auto, decided when the config is read
    saguaro = load_config(REPO / "configs" / "smollm2-135m-eagle3-saguaro.yaml")
    same = {k: v for k, v in saguaro.to_dict().items() if not k.startswith("saguaro") and k != "output_dir"}
    assert same == {k: v for k, v in eagle.to_dict().items() if not k.startswith("saguaro") and k != "output_dir"}
    assert (saguaro.saguaro_c, saguaro.saguaro_fanout, eagle.saguaro_c) == (0.7, 3, None)


def test_deepspeed_config_auto_values(tmp_path):
    cfg = config_from_dict({"micro_batch_size": 2, "grad_accum": 3, "grad_clip": 0.5})
    ds = deepspeed_config(cfg, world_size=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (2, 3, 12)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is False
    assert deepspeed_config(config_from_dict({"deepspeed_config": "configs/ds_zero3.json"}), 1)[
        "zero_optimization"]["stage"] == 3
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
    with pytest.raises(ConfigError, match="optimizer"):
        deepspeed_config(config_from_dict({"deepspeed_config": str(bad)}), 1)


# ----------------------------------------------------------------------------------------------------------------
# draft LM

def test_draft_lm_body_reproduces_target_with_all_layers():
    from train.draft_lm import DraftLMBody, draft_lm_config

    target = make_tiny_llama(num_layers=3, dtype=torch.float64, tie=True)
    body = DraftLMBody.from_target(target, 3, torch.float64)
    ids = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        hidden = body(target.get_input_embeddings()(ids))
        ref = target(ids).logits
    torch.testing.assert_close(hidden @ target.lm_head.weight.T, ref)
    assert body.model.embed_tokens is None
    assert not any("embed" in k for k in body.trained_state_dict())
    short = DraftLMBody.from_target(target, 1, torch.float64)
    assert torch.equal(short.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert draft_lm_config(target.config, 1).tie_word_embeddings is True
    assert draft_lm_config(make_tiny_llama(num_layers=2, tie=False).config, 1).tie_word_embeddings is False
    with pytest.raises(ValueError, match="draft_lm_layers"):
        draft_lm_config(target.config, 4)


# ----------------------------------------------------------------------------------------------------------------
# in-process training: vocabulary on resume, aux ids of training == serving

def test_vocab_mapping_kept_on_resume(tiny_setup, tmp_path):
    out = tmp_path / "run"
    trainer, _ = run_trainer(**tiny_config(tiny_setup, out, max_steps=2, save_every=2, eval_every=0))
    saved_d2t = trainer.head.d2t.clone()
    # different data would count a different vocabulary; the resumed head must keep the checkpoint's
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"}, {
        "role": "assistant", "content": "ZYXWVU 0123456789 !?%$#@ " * 3}]}) + "\n" for _ in range(8)))
    from train.vocab import build_draft_vocab, count_token_frequencies
    fresh_d2t, _ = build_draft_vocab(count_token_frequencies(list(trainer.data.token_rows()), 257, progress=False),
                                     24)
    assert torch.equal(fresh_d2t, saved_d2t)  # sanity: this is how the first run chose it
    resumed, _ = run_trainer(**tiny_config(tiny_setup, out, data=str(other), max_steps=3, save_every=3,
                                           eval_every=0))
    other_d2t, _ = build_draft_vocab(count_token_frequencies(list(resumed.data.token_rows()), 257, progress=False),
                                     24)
    assert not torch.equal(other_d2t, saved_d2t)
    assert torch.equal(resumed.head.d2t, saved_d2t)
    assert resumed.state["step"] == 3
    state = json.loads((out / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["micro_step"] == 3



def test_resume_keeps_the_zero_stage_it_was_written_with(tiny_setup, tmp_path):
    """A ZeRO-2 run resumes under ZeRO-2; under ZeRO-3 it stops with an error naming both stages (DeepSpeed's
    partitions differ per stage) and the checkpoint is left as it was."""
    out = tmp_path / "run"
    run_trainer(**tiny_config(tiny_setup, out, max_steps=2, save_every=2, eval_every=0))
    with pytest.raises(ValueError, match="ZeRO stage 2.*is stage 3"):
        run_trainer(**tiny_config(tiny_setup, out, max_steps=3, save_every=3, eval_every=0,
                                  deepspeed_config=str(REPO / "configs" / "ds_zero3.json")))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    resumed, _ = run_trainer(**tiny_config(tiny_setup, out, max_steps=3, save_every=3, eval_every=0))
    assert resumed.state["step"] == 3

def test_aux_ids_fed_in_training_equal_serving(tiny_setup, tmp_path):
    from ssd_eagle.drafters.eagle3 import Eagle3Drafter
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.kv_cache import ForwardBatch
    from train.export import export_checkpoint

    out = tmp_path / "run"
    trainer, _ = run_trainer(**tiny_config(tiny_setup, out, max_steps=1, save_every=1, eval_every=0,
                                           aux_layer_ids=[1, 4, 6]))
    export = export_checkpoint(out, tmp_path / "export", dtype="float32")
    target, tok = trainer.target, trainer.tokenizer
    drafter = Eagle3Drafter.from_pretrained(str(export), target, num_slots=2, max_len=128)
    engine = LLMEngine(target, tok, drafter, num_speculative_tokens=3, max_num_seqs=2)
    assert trainer.data.extractor.aux_layer_ids == (1, 4, 6)
    extractor = trainer.data.extractor
    assert engine.target.aux_layer_ids == extractor.aux_layer_ids == tuple(trainer.head.config.aux_layer_ids)
    # the same tensors: the engine's runner, the trainer's extractor, and transformers' hidden_states[i]
    ids = list(range(40, 60))
    feats = trainer.data.extractor([{"input_ids": ids, "loss_mask": [1] * len(ids)}])
    batch = ForwardBatch.causal([ids], [0], [0], engine.target.dtype, engine.target.device)
    served = engine.target.forward(batch, capture_aux=True, compute_logits=False).aux_hidden
    torch.testing.assert_close(feats.aux_hidden, served)
    with torch.no_grad():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats.aux_hidden, torch.cat([hs[i] for i in (1, 4, 6)], -1), rtol=1e-5, atol=1e-5)


def test_offline_features_are_incremental_and_equal_online(tiny_setup, tmp_path):
    from train.data import load_conversations
    from train.features import FeatureStore, TargetFeatureExtractor, conversation_key
    from ssd_eagle.assets import load_model
    from train.feature_source import load_feature_source
    from train.precompute_features import precompute

    trainer_target, tokenizer = load_model(tiny_setup["target"], dtype=torch.float32)
    feats = tmp_path / "features"
    half = tmp_path / "half.jsonl"
    lines = Path(tiny_setup["data"]).read_text().splitlines(keepends=True)
    half.write_text("".join(lines[:10]))
    values = tiny_config(tiny_setup, tmp_path / "run", mode="offline", features_dir=str(feats),
                         feature_dtype="float32", max_steps=2, save_every=2, eval_every=2)
    first = precompute(config_from_dict(dict(values, data=str(half))), run="a")
    assert first["samples"] == 10 and first["skipped"] == 0
    with pytest.raises(ValueError, match="have no features"):  # what the trainer's own build (train.prepare) fills
        load_feature_source(config_from_dict(values), trainer_target.config.get_text_config(), lambda: trainer_target,
                            tokenizer, None, 0, 1, torch.device("cpu"))
    second = precompute(config_from_dict(values), run="b")
    assert second["skipped"] == 10 and second["samples"] == len(lines) - 10
    assert precompute(config_from_dict(values), run="c")["index"] is None  # nothing left to do
    keys = [conversation_key(c["messages"]) for c in load_conversations(tiny_setup["data"])]
    store = FeatureStore(feats, only=keys)
    assert len(store) == len(lines) and [e["conv"] for e in store.samples] == keys

    trainer, result = run_trainer(**values)
    assert trainer.data.extractor is None and result["step"] == 2 and result["loss"] == result["loss"]
    assert trainer.data.heldout  # held-out features still come from the target
    sample = store[3]
    ex = TargetFeatureExtractor(trainer.target, trainer.aux_layer_ids, 1, 128)
    ref = ex([{"input_ids": sample["input_ids"].tolist(), "loss_mask": sample["loss_mask"].tolist()}])
    torch.testing.assert_close(sample["aux_hidden"], ref.aux_hidden[0])
    torch.testing.assert_close(sample["last_hidden"], ref.last_hidden[0])
    assert torch.equal(sample["argmax"], ref.argmax[0])


def test_offline_training_loads_the_feature_target_only_when_a_forward_needs_it(tiny_setup, tmp_path, monkeypatch):
    """Offline with ``target_dtype: bfloat16``: the trainer always loads the float32 target (embeddings, soft
    labels, draft-LM init); the bfloat16 one only to compute missing features or the held-out set's, and drops it
    once they are made; on precomputed features without a held-out set it never loads it."""
    import ssd_eagle.assets

    loaded = []
    real_load = ssd_eagle.assets.load_model

    def recording_load(name, dtype=torch.float32, **kw):
        loaded.append(dtype)
        return real_load(name, dtype=dtype, **kw)

    monkeypatch.setattr(ssd_eagle.assets, "load_model", recording_load)
    values = tiny_config(tiny_setup, tmp_path / "run", mode="offline", features_dir=str(tmp_path / "features"),
                         feature_dtype="float32", target_dtype="bfloat16", max_steps=1, save_every=1, eval_every=1)
    trainer, _ = run_trainer(**values)  # builds the features and the held-out features
    assert loaded == [torch.float32, torch.bfloat16] and trainer.data.heldout and trainer._feature_model is None
    loaded.clear()
    trainer, result = run_trainer(**dict(values, heldout_samples=0, output_dir=str(tmp_path / "run2")))
    assert loaded == [torch.float32] and result["step"] == 1 and not trainer.data.heldout
    loaded.clear()
    trainer, _ = run_trainer(**dict(values, mode="online", output_dir=str(tmp_path / "run3")))
    assert loaded == [torch.float32, torch.bfloat16] and trainer.data.extractor.runner.model is trainer.feature_target()


def test_transformers_loading_bar_follows_the_trainer_progress(tiny_setup, tmp_path, capsys):
    """transformers prints a "Loading weights" bar on every load; the trainer's ``progress: false`` (and a rank other
    than 0) hides it for both its loads (float32 and target_dtype), and leaves transformers' setting as it was."""
    from transformers.utils import logging as hf_logging

    from ssd_eagle.assets import load_model

    assert hf_logging.is_progress_bar_enabled()
    load_model(tiny_setup["target"])
    assert "Loading weights" in capsys.readouterr().err  # (what would be hidden)
    run_trainer(**tiny_config(tiny_setup, tmp_path / "run", max_steps=1, save_every=1, eval_every=1,
                              target_dtype="bfloat16", progress=False))
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


# ----------------------------------------------------------------------------------------------------------------
# the deepspeed launches

def _world_script(tmp_path):
    """A script printing ``world RANK WORLD_SIZE MASTER_PORT`` after init_distributed, and a launcher's clean env."""
    script = tmp_path / "world.py"
    script.write_text("import os\nfrom train.distributed import init_distributed\n"
                      "print('world', *init_distributed(), os.environ['MASTER_PORT'], flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return script, env


def test_deepspeed_launch_on_a_taken_port_moves_to_a_free_one(tmp_path):
    """``deepspeed --num_gpus 1`` sets ``MASTER_PORT`` to its ``--master_port`` (29500 unless given) even when
    another run holds that port: the one-process world moves to a free port instead of failing to bind."""
    import socket

    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not installed (pip install deepspeed)")
    script, env = _world_script(tmp_path)
    with socket.socket() as other_run:  # a listening socket, like another run's rendezvous store
        other_run.bind(("", 0))
        other_run.listen()
        port = other_run.getsockname()[1]
        proc = subprocess.run(["deepspeed", "--num_gpus", "1", "--master_port", str(port), str(script)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    world = next(line.split() for line in proc.stdout.splitlines() if line.startswith("world "))
    assert world[1:3] == ["0", "1"] and world[3].isdigit() and int(world[3]) != port, world
    assert f"MASTER_PORT {port} is taken" in proc.stdout + proc.stderr


def test_torchrun_one_process_world_keeps_the_agents_port(tmp_path):
    """``torchrun --nproc_per_node 1``: the elastic agent itself listens on ``MASTER_PORT`` (its store, which the
    worker joins: ``TORCHELASTIC_USE_AGENT_STORE``), so that port is taken by design and the one-process world must
    stay on it (moved to a free port, the worker waited for a store nobody serves)."""
    import socket

    if shutil.which("torchrun") is None:
        pytest.fail("torchrun is not installed (it comes with torch)")
    script, env = _world_script(tmp_path)
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["torchrun", "--nproc_per_node", "1", "--master_port", str(port), str(script)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # (its own group: a hung worker is ended with the agent)
    try:
        out, err = proc.communicate(timeout=300)  # ~5 s alone; a CI run next to two training jobs took > 90 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the torchrun world did not start in 300 s (it left the agent's port): {err[-3000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    world = next(line.split() for line in out.splitlines() if line.startswith("world "))
    assert world[1:] == ["0", "1", str(port)], world


def test_deepspeed_launch_trains_resumes_and_exports(tiny_setup, tmp_path, capsys):
    """The README command, ``deepspeed --num_gpus 1 train/train_draft.py --config ...``, on a tiny offline config
    from an empty folder: the trainer builds its features and held-out set itself (``train.prepare``), the loss
    falls below 0.8x its start (fixed seed), TensorBoard gets the curves; the run then resumes from its latest
    checkpoint (in this process), reusing what was built, and exports a loadable head."""
    from ssd_eagle.models.eagle3_formats import load_eagle3
    from train.export import main as export_main

    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not installed (pip install deepspeed)")
    out, feats, held = tmp_path / "run", tmp_path / "features", tmp_path / "heldout" / "mtbench.jsonl"
    values = tiny_config(tiny_setup, out, max_steps=40, save_every=20, eval_every=20, lr=5e-3, seed=0,
                         mode="offline", features_dir=str(feats), feature_dtype="float32", heldout_data=str(held),
                         heldout_samples=1, heldout_max_tokens=8, max_length=256, report_to=["tensorboard"])
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(values))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    port = str(29500 + random.Random().randint(0, 400))
    proc = subprocess.run(["deepspeed", "--num_gpus", "1", "--master_port", port, str(REPO / "train" / "train_draft.py"),
                           "--config", str(cfg_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s (float32, 1 rank(s)" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[0]["step"] == 1 and train[-1]["step"] == 40
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], (train[0]["loss"], train[-1]["loss"])
    assert any("heldout_tau" in r for r in records)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000040"
    indexes = sorted(feats.glob("index-*.json"))
    assert len(indexes) == 1 and len(json.loads(indexes[0].read_text())["samples"]) == 48
    assert len(held.read_text().splitlines()) == 1 and held.with_name(held.name + ".meta.json").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    built = {p: p.stat().st_mtime_ns for p in [*indexes, held]}

    capsys.readouterr()
    trainer, result = run_trainer(**dict(values, max_steps=44))
    assert trainer.state["step"] == 44 and result["step"] == 44
    assert "at step 40 of 44" in capsys.readouterr().err  # the resume is announced
    assert {p: p.stat().st_mtime_ns for p in [*feats.glob("index-*.json"), held]} == built  # reused, not rebuilt
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][40:] == [41, 42, 43, 44]

    export = tmp_path / "export"
    export_main([str(out / "checkpoints" / "latest"), str(export), "--dtype", "float32"])  # the README's form
    head = load_eagle3(export, target_config=trainer.target.config)
    saved = trainer.head.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, saved[name].to(tensor.dtype)), name
    assert (export / "tokenizer.json").exists() and "tau" in (export / "README.md").read_text()


# ----------------------------------------------------------------------------------------------------------------
# the teacher-forced simulation against the engine

def _greedy_rows(target, tokenizer, drafter, prompts, k, max_tokens=40):
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.sampling_params import SamplingParams

    engine = LLMEngine(target, tokenizer, drafter, num_speculative_tokens=k, max_num_seqs=1, max_model_len=512)
    return LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_simulated_tau_equals_engine_tau_for_a_draft_lm(byte_tokenizer):
    from ssd_eagle.drafters import DraftModelDrafter
    from helpers import noisy_copy

    k = 4
    target = make_tiny_llama(num_layers=4, seed=2)
    draft = noisy_copy(target, 0.05)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(2)]
    for prompt in prompts:
        out = _greedy_rows(target, byte_tokenizer, DraftModelDrafter(draft, 257, 1, 512), [prompt], k, 32)[0]
        ids = torch.tensor([prompt + out.token_ids])
        mask = torch.tensor([0] * len(prompt) + [1] * len(out.token_ids))
        with torch.no_grad():
            hits = draft_lm_hits(draft(ids).logits.argmax(-1), ids, k)
        sim = simulate_acceptance(hits[0], mask, k)
        assert (sim.rounds, sim.emitted) == (out.stats.num_rounds, out.stats.num_emitted)
        # every round but the last, which max_tokens cuts (the engine drafts at most the tokens left; the
        # simulation, written for EOS-ended text, counts the drafts that matched up to the end)
        assert sim.accepted_lengths[:-1] == out.stats.accepted_lengths[:-1]
        assert sim.accepted_lengths[-1] >= out.stats.accepted_lengths[-1]
    assert out.stats.num_emitted > out.stats.num_rounds  # drafts were accepted: deep chains were compared


def _recorded_eagle3_rounds(byte_tokenizer, k: int):
    """A random float64 head served by the engine at T = 0 on a tiny target: (head, extractor, the rounds'
    ``(committed token ids, proposal)``, the request's output, the full token ids)."""
    from ssd_eagle.drafters.eagle3 import Eagle3Drafter
    from train.features import TargetFeatureExtractor

    target = make_tiny_llama(num_layers=8, seed=4)
    cfg = Eagle3Config.from_target(target.config, 200, torch_dtype="float64")
    torch.manual_seed(0)
    head = Eagle3DraftModel(cfg).to(torch.float64)
    head.init_weights(std=0.3)
    head.set_vocab_mapping(*build_vocab_mapping(torch.randperm(257)[:200], 257, 200))
    head.set_embeddings(target.get_input_embeddings())
    head.eval()

    class Recording(Eagle3Drafter):
        def propose(self, seqs, num_tokens):
            proposals = super().propose(seqs, num_tokens)
            self.log.append((list(seqs[0].token_ids), list(proposals[0].tokens)))
            return proposals

    extractor = TargetFeatureExtractor(target, cfg.aux_layer_ids, 1, 512)
    prompt = [5, 17, 200, 31, 9, 77]
    drafter = Recording(head, num_slots=1, max_len=512)
    drafter.log = []
    out = _greedy_rows(target, byte_tokenizer, drafter, [prompt], k)[0]
    return head, extractor, drafter.log, out, prompt + out.token_ids, len(prompt)


def test_teacher_forced_eagle3_drafts_equal_the_engine_proposals(byte_tokenizer):
    """Row t of the TTT output is the chain the serving drafter proposes after x_{t+1}: its first draft equals the
    engine's, every round, and the simulated rounds equal the engine's."""
    k = 3
    head, extractor, log, out, ids, prompt_len = _recorded_eagle3_rounds(byte_tokenizer, k)
    batch = extractor([{"input_ids": ids, "loss_mask": [0] * prompt_len + [1] * len(out.token_ids)}])
    with torch.no_grad():
        targets = draft_targets(batch.last_hidden, extractor.lm_head_weight, head.draft_target_ids, head.t2d,
                                argmax=batch.argmax)
        tf = ttt_loss(head, batch.input_ids, batch.loss_mask, batch.aux_hidden, targets, k, 1.0)
    tokens = head.draft_target_ids[tf.draft_argmax.clamp_min(0)]
    for context, proposal in log:  # the round drafts after x_{length-1}: row t = length - 2
        if proposal:  # a round with one token left drafts nothing
            assert int(tokens[0, 0, len(context) - 2]) == proposal[0]
    sim = simulate_acceptance(eagle3_hits(tf.draft_argmax, head.draft_target_ids, batch.input_ids)[0],
                              batch.loss_mask[0], k)
    assert (sim.rounds, sim.emitted) == (out.stats.num_rounds, out.stats.num_emitted)
    assert len(log) == out.stats.num_rounds


def test_every_step_of_the_engine_chain_equals_the_ttt_unroll(byte_tokenizer):
    """Step i of the TTT unroll at row t = len(context) - 2, fed the engine's own drafts as its tokens, is the
    engine's i-th draft, for every step of every round: the fed-back hidden state (pre-norm output), the rotary
    positions t + i, the attention over the earlier drafts (diagonal blocks against the engine's cache of the
    chain) and the feature/token pairing of the committed text are the same in training and serving."""
    k = 4
    head, extractor, log, _, ids, _ = _recorded_eagle3_rounds(byte_tokenizer, k)
    aux = extractor([{"input_ids": ids, "loss_mask": [1] * len(ids)}]).aux_hidden
    compared = 0
    for context, proposal in log:
        if not proposal:
            continue
        n = len(context) + len(proposal)
        chain = torch.tensor([context + proposal])
        padded = torch.cat([aux[:, : len(context)], aux.new_zeros(1, len(proposal), aux.shape[-1])], dim=1)
        with torch.no_grad():  # rows <= len(context) - 2 see only the committed text's features
            outs = ttt_unroll(head, chain, padded[:, :n], len(proposal))
        t = len(context) - 2
        steps = [int(head.draft_to_target(head.compute_logits(o.hidden[0, t]).argmax(-1))) for o in outs]
        assert steps == proposal
        compared += len(proposal) - 1
    assert compared >= 2 * len(log)  # most rounds drafted the full chain: the later steps were compared


def test_teacher_forced_estimate_runs_in_the_requested_dtype(tiny_setup, tmp_path):
    """The held-out estimate runs target and head in the serving dtype (it ran float32 whatever the server used)
    and reports the tau of chains fed the target's features next to the real chains'."""
    from transformers import AutoConfig

    from ssd_eagle.models.eagle3_formats import save_eagle3
    from train.heldout import estimate_tau

    cfg = Eagle3Config.from_target(AutoConfig.from_pretrained(tiny_setup["target"]), 24)
    torch.manual_seed(0)
    save_eagle3(Eagle3DraftModel(cfg), tmp_path / "head")
    results = {dtype: estimate_tau(tmp_path / "head", tiny_setup["heldout"], target=tiny_setup["target"],
                                   num_draft=3, dtype=dtype, progress=False) for dtype in ("float64", "bfloat16")}
    for dtype, r in results.items():
        assert r["dtype"] == dtype and r["kind"] == "eagle3" and r["samples"] == 3
        assert 1.0 <= r["tau"] <= 4.0 and 1.0 <= r["feature_fed_tau"] <= 4.0
    assert results["float64"]["rounds"] > 0


def test_head_init_target_starts_the_output_side_at_the_targets(tiny_setup, tmp_path):
    trainer, _ = run_trainer(**tiny_config(tiny_setup, tmp_path / "run", head_init="target", lr=1e-9, max_steps=1,
                                           save_every=1, eval_every=0))
    head = trainer.head
    rows = trainer.lm_head_weight[head.draft_target_ids].to(head.lm_head.weight)
    torch.testing.assert_close(head.lm_head.weight, rows, rtol=0, atol=1e-6)  # one step at lr 1e-9
    norm = trainer.target.get_decoder().norm.weight.to(head.norm.weight)
    torch.testing.assert_close(head.norm.weight, norm, rtol=0, atol=1e-6)


def test_init_from_warm_starts_an_exported_head_and_refuses_another_geometry(tiny_setup, tmp_path):
    from ssd_eagle.models.eagle3_formats import load_eagle3, save_eagle3

    first, _ = run_trainer(**tiny_config(tiny_setup, tmp_path / "a", max_steps=2, save_every=2, eval_every=0))
    save_eagle3(first.head, tmp_path / "export")
    exported = load_eagle3(tmp_path / "export", dtype=torch.float32)
    warm, _ = run_trainer(**tiny_config(tiny_setup, tmp_path / "b", init_from=str(tmp_path / "export"), lr=1e-9,
                                        max_steps=1, save_every=1, eval_every=0))
    assert torch.equal(warm.head.d2t, exported.d2t)
    for name, value in exported.state_dict().items():  # one step at lr 1e-9 from the export's weights
        torch.testing.assert_close(warm.head.state_dict()[name].float(), value.float(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        run_trainer(**tiny_config(tiny_setup, tmp_path / "c", init_from=str(tmp_path / "export"),
                                  draft_vocab_size=16, max_steps=1))


def test_init_from_a_smaller_vocabulary_widens_it_and_keeps_the_trained_rows(tiny_setup, tmp_path):
    from ssd_eagle.models.eagle3_formats import load_eagle3, save_eagle3

    first, _ = run_trainer(**tiny_config(tiny_setup, tmp_path / "a", max_steps=2, save_every=2, eval_every=0))
    save_eagle3(first.head, tmp_path / "export")
    old = load_eagle3(tmp_path / "export", dtype=torch.float32)
    wide, _ = run_trainer(**tiny_config(tiny_setup, tmp_path / "b", init_from=str(tmp_path / "export"), lr=1e-9,
                                        draft_vocab_size=40, max_steps=1, save_every=1, eval_every=0))
    head = wide.head
    new_ids, old_ids = head.draft_target_ids.cpu(), old.draft_target_ids
    assert head.config.draft_vocab_size == 40 and bool(head.t2d.cpu()[old_ids].all())
    position = {int(t): i for i, t in enumerate(new_ids)}
    carried = torch.tensor([position[int(t)] for t in old_ids])
    weight = head.lm_head.weight.detach().float().cpu()
    torch.testing.assert_close(weight[carried], old.lm_head.weight, rtol=0, atol=1e-6)  # one step at lr 1e-9
    for name, value in old.state_dict().items():  # everything but the output side is the export's
        if name not in ("lm_head.weight", "d2t", "t2d"):
            torch.testing.assert_close(head.state_dict()[name].float().cpu(), value.float(), rtol=0, atol=1e-6)
    added = torch.tensor([i for i in range(40) if i not in set(carried.tolist())])
    assert weight[added].abs().max() < 1e-6  # new tokens start at logit 0
    assert 0.0 < wide.vocab_coverage <= 1.0
    save_eagle3(head, tmp_path / "wide")  # the widened head exports and loads like any other
    assert load_eagle3(tmp_path / "wide", dtype=torch.float32).config.draft_vocab_size == 40


def test_build_draft_vocab_keeps_the_old_tokens_then_adds_the_most_frequent():
    from train.vocab import build_draft_vocab

    counts = torch.tensor([0, 9, 0, 5, 7, 1, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4, keep=torch.tensor([2, 6]))  # 2 and 6 never seen, kept anyway
    assert sorted((torch.arange(4) + d2t).tolist()) == [1, 2, 4, 6]
    assert t2d.tolist() == [False, True, True, False, True, False, True, False]
    with pytest.raises(ValueError, match="widen a draft vocabulary, not narrow"):
        build_draft_vocab(counts, 2, keep=torch.tensor([1, 2, 3]))
