"""The draft's temperature scale s (sampled drafts from ``softmax(z / (T s))``, :mod:`ssd_eagle.drafters.chain`):
its calibration (:mod:`train.calibrate`), where the engine reads it, and the output law with it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import (LAW_TOKENS, LAW_VOCAB, exact_law, make_tiny_llama, noisy_copy, pooled_chisquare)
from ssd_eagle.config import EngineConfig, SpeculativeConfig
from ssd_eagle.drafters.chain import sample_draft_tokens
from ssd_eagle.engine.factory import build
from ssd_eagle.engine.llm import LLM
from ssd_eagle.models.draft_lm import draft_temperature_scale
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel
from ssd_eagle.sampling_params import SamplingParams
from train.calibrate import acceptance_by_scale, calibrate, record
from train_helpers import write_tiny_setup


# ----------------------------------------------------------------------------------------------------------------
# the acceptance chance of each scale

def test_a_draft_equal_to_the_target_is_best_unscaled_and_always_accepted():
    z = torch.randn(40, 30, generator=torch.Generator().manual_seed(0)) * 3
    alpha = acceptance_by_scale(z, z, None, [0.5, 1.0], [0.5, 1.0, 2.0]) / 40
    assert torch.allclose(alpha[:, 1], torch.ones(2, dtype=torch.float64))
    assert (alpha.argmax(dim=1) == 1).all()


def test_an_underconfident_draft_is_best_sharpened_by_its_own_factor():
    """A draft whose logits are the target's halved draws q = p_T at s = 0.5, at every temperature."""
    z = torch.randn(40, 30, generator=torch.Generator().manual_seed(1)) * 3
    scales = [0.3, 0.5, 0.7, 1.0]
    alpha = acceptance_by_scale(z / 2, z, None, [0.5, 1.0], scales) / 40
    assert (alpha.argmax(dim=1) == 1).all()
    assert torch.allclose(alpha[:, 1], torch.ones(2, dtype=torch.float64))
    assert (alpha[:, 3] < 0.99).all()  # unscaled, the flat draft loses acceptance


def test_target_mass_outside_the_draft_vocabulary_is_never_accepted():
    z = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0, 2, 5])
    alpha = acceptance_by_scale(z[:, ids], z, ids, [1.0], [1.0]) / 10
    mass = torch.softmax(z.double(), -1)[:, ids].sum(-1).mean()
    assert alpha.item() == pytest.approx(mass.item(), abs=1e-6)  # q = p renormalised: min is p on the vocabulary
    with pytest.raises(ValueError, match="> 0"):
        acceptance_by_scale(z, z, None, [0.0], [1.0])


# ----------------------------------------------------------------------------------------------------------------
# sampling with the scale, and where the engine reads it

def test_sampled_rows_draw_from_the_scaled_q_and_greedy_rows_take_the_argmax():
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    seqs = [SimpleNamespace(params=SamplingParams(temperature=0.8), draft_generator=torch.Generator()),
            SimpleNamespace(params=SamplingParams(temperature=0.0), draft_generator=torch.Generator())]
    tokens, q = sample_draft_tokens(logits, seqs, 0, temperature_scale=0.5)
    torch.testing.assert_close(q[0], torch.softmax(logits[0] / (0.8 * 0.5), -1))
    assert q[1] is None and tokens[1] == logits[1].argmax()


def test_a_recorded_scale_must_be_a_positive_number():
    assert draft_temperature_scale(None) == 1.0 and draft_temperature_scale({"draft_temperature_scale": 0.7}) == 0.7
    for bad in (0, -1.0, "0.7", True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="draft_temperature_scale"):
            draft_temperature_scale({"draft_temperature_scale": bad})
    with pytest.raises(ValueError, match="draft_temperature_scale"):
        SpeculativeConfig(method="ngram", draft_temperature_scale=0.0)
    with pytest.raises(ValueError, match="draft_temperature_scale"):  # (1e-40: softmax(z / (T s)) overflows)
        SpeculativeConfig(method="ngram", draft_temperature_scale=1e-40)
    cfg = Eagle3Config.from_target(make_tiny_llama(seed=5).config, draft_vocab_size=64)
    for bad in (0.0, -0.5, float("nan")):  # (a head built in code: 0 was read as 1, -0.5 drafted the least likely)
        with pytest.raises(ValueError, match="draft_temperature_scale"):
            Eagle3Config(**{**cfg.__dict__, "draft_temperature_scale": bad})


def test_an_exported_heads_scale_reaches_sd_and_the_config_overrides_it_in_sd_and_ssd(tmp_path, byte_tokenizer):
    from ssd_eagle.models.eagle3_formats import load_eagle3, save_eagle3

    target = make_tiny_llama(seed=5)
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=64, torch_dtype="float32")
    save_eagle3(Eagle3DraftModel(cfg), tmp_path / "plain")
    assert load_eagle3(tmp_path / "plain").config.draft_temperature_scale is None
    record(tmp_path / "plain", 0.65)
    head = load_eagle3(tmp_path / "plain")
    assert head.config.draft_temperature_scale == 0.65
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["ssd_eagle"]["draft_temperature_scale"] = None
    (tmp_path / "again").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "again" / name).write_bytes((tmp_path / "plain" / name).read_bytes())
    (tmp_path / "again" / "config.json").write_text(json.dumps(config))
    assert load_eagle3(tmp_path / "again").config.draft_temperature_scale is None  # (null: none recorded)
    save_eagle3(head, tmp_path / "again")  # (a re-export keeps it)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["ssd_eagle"]["draft_temperature_scale"] == 0.65
    for override, expected in ((None, 0.65), (0.9, 0.9)):
        spec = SpeculativeConfig(method="eagle3", model=str(tmp_path / "plain"), draft_temperature_scale=override)
        engine = build(EngineConfig(model="in-memory", mode="sd", max_num_seqs=1, max_model_len=256,
                                    speculative_config=spec), target, tokenizer=byte_tokenizer)
        assert engine.drafter.backend.temperature_scale == expected
    for override, expected in ((None, 1.0), (0.9, 0.9)):  # SSD: 1 unless told (ssd_eagle.ssd.worker says why)
        ssd = SpeculativeConfig(method="eagle3", model=str(tmp_path / "plain"), draft_temperature_scale=override,
                                speculator="local")
        engine = build(EngineConfig(model="in-memory", mode="ssd", max_num_seqs=1, max_model_len=256,
                                    speculative_config=ssd), target, tokenizer=byte_tokenizer)
        assert engine.drafter.speculator.speculator.backend.temperature_scale == expected


# ----------------------------------------------------------------------------------------------------------------
# the output law at T > 0 (SD; SSD's is tests/test_ssd.py's draft_temperature_scale variant)

def test_sd_output_law_equals_the_targets_with_a_sharpened_draft(byte_tokenizer):
    V, n = LAW_VOCAB, 3000
    target = make_tiny_llama(vocab_size=V, seed=6, init_std=0.15)
    spec = SpeculativeConfig(method="draft_model", model="in-memory", num_speculative_tokens=2,
                             draft_temperature_scale=0.4, adaptive=False)
    engine = build(EngineConfig(model="in-memory", mode="sd", max_num_seqs=128, max_model_len=64,
                                speculative_config=spec), target, tokenizer=byte_tokenizer,
                   draft=noisy_copy(target, 0.5, seed=9))
    prompt, temperature = [1, 3, 0, 2, 2], 0.9
    params = [SamplingParams(temperature=temperature, max_tokens=LAW_TOKENS, ignore_eos=True, seed=i) for i in range(n)]
    outs = LLM(engine=engine).generate([prompt] * n, params)
    flat = np.array([sum(t * V ** (LAW_TOKENS - 1 - j) for j, t in enumerate(o.token_ids)) for o in outs])
    assert engine.stats.num_accepted > n // 4, "the drafts must be accepted often enough to matter"
    assert pooled_chisquare(np.bincount(flat, minlength=V ** LAW_TOKENS), exact_law(target, prompt, temperature)) > 1e-4


# ----------------------------------------------------------------------------------------------------------------
# calibration end to end

def test_eagle3_heads_are_told_from_draft_lms_in_every_layout_the_engine_loads(tmp_path):
    from ssd_eagle.models.eagle3_formats import is_eagle3_head, save_eagle3

    target = make_tiny_llama(seed=5)
    save_eagle3(Eagle3DraftModel(Eagle3Config.from_target(target.config, draft_vocab_size=64)), tmp_path / "head")
    assert is_eagle3_head(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]  # (the reference layout: was calibrated as a draft LM)
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    assert is_eagle3_head(tmp_path / "head")
    target.save_pretrained(tmp_path / "lm")
    assert not is_eagle3_head(tmp_path / "lm") and not is_eagle3_head(tmp_path / "nothing")



def test_calibration_scores_a_grid_on_training_text_and_records_its_best(tmp_path):
    from transformers import AutoConfig

    from ssd_eagle.models.eagle3_formats import load_eagle3, save_eagle3

    setup = write_tiny_setup(tmp_path / "tiny", num_convs=8)
    cfg = Eagle3Config.from_target(AutoConfig.from_pretrained(setup["target"]), 24)
    torch.manual_seed(0)
    save_eagle3(Eagle3DraftModel(cfg), tmp_path / "head")
    result = calibrate(tmp_path / "head", setup["data"], conversations=4, steps=2, temperatures=(0.5, 1.0),
                       scales=(0.5, 1.0), dtype="float32", target=setup["target"], progress=False)
    assert result.alpha.shape == (2, 2, 2) and min(result.positions) > 0
    assert ((result.alpha > 0) & (result.alpha <= 1)).all() and result.best in (0.5, 1.0)
    assert "best s" in result.table()
    record(tmp_path / "head", result.best)  # (what main's --write does)
    assert load_eagle3(tmp_path / "head").config.draft_temperature_scale == result.best
    with pytest.raises(ValueError, match="steps"):
        calibrate(tmp_path / "head", setup["data"], steps=0, target=setup["target"])


def test_a_draft_lms_recorded_scale_reaches_its_backend():
    from ssd_eagle.drafters.backends import DraftLMBackend

    draft = make_tiny_llama(seed=7)
    assert DraftLMBackend(draft, 1, 64).temperature_scale == 1.0
    draft.config.ssd_eagle = {"draft_temperature_scale": 0.6}
    assert DraftLMBackend(draft, 1, 64).temperature_scale == 0.6
