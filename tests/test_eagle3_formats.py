"""EAGLE-3 checkpoint formats: our export (``docs/design.md`` section 5), strict loading, public layouts,
speculators, and the vLLM / SGLang weight-name maps (``tests/engine_loaders.py``)."""

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig

from engine_loaders import (
    engine_embeddings,
    from_sglang_names,
    from_vllm_names,
    sglang_param_layout,
    sglang_route,
    to_sglang_names,
    to_vllm_names,
    vllm_param_layout,
    vllm_route,
)
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel, build_vocab_mapping
from ssd_eagle.models.eagle3_formats import (
    CONVENTION_KEY,
    HEAD_TENSOR_NAMES,
    head_state_dict,
    load_eagle3,
    save_eagle3,
    save_speculators,
)

VOCAB, DRAFT_VOCAB, H, H_TARGET = 50, 20, 32, 24


def target_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                num_hidden_layers=8, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=500000.0,
                rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def make_head(dtype=torch.float64, seed=0, target_hidden=H, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target(target_config(), DRAFT_VOCAB, target_hidden_size=target_hidden, **overrides)
    model = Eagle3DraftModel(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.set_vocab_mapping(*build_vocab_mapping(torch.randperm(VOCAB)[:DRAFT_VOCAB], VOCAB, DRAFT_VOCAB))
    return model


def assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def rewrite(path, tensors=None, config=None):
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------- our export

def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = make_head(target_hidden=H, aux_layer_ids=(1, 4, 6), saguaro_c=0.7, saguaro_fanout=3,
                      extra={"note": "x"})
    out = save_eagle3(model, tmp_path / "head")
    loaded = load_eagle3(out, target_config=target_config())
    assert_same_state(model.state_dict(), loaded.state_dict())
    assert loaded.config == dataclasses.replace(model.config, torch_dtype="float64")  # the written dtype
    emb = nn.Embedding(VOCAB, H).double()
    model.set_embeddings(emb)
    loaded.set_embeddings(emb)
    ids = torch.randint(0, VOCAB, (1, 6))
    hidden = torch.randn(1, 6, H, dtype=torch.float64)
    pos = torch.arange(6)[None]
    assert torch.equal(model(ids, hidden, pos), loaded(ids, hidden, pos))


@pytest.mark.parametrize("target_hidden", [H, H_TARGET], ids=["same-width", "other-width"])
def test_saved_file_has_exactly_the_notes_tensors(tmp_path, target_hidden):
    model = make_head(target_hidden=target_hidden)
    save_eagle3(model, tmp_path / "head")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    # a head of another width than its target carries its own table (engines cannot share the target's)
    own = ["embed_tokens.weight"] if target_hidden != H else []
    assert sorted(tensors) == sorted(HEAD_TENSOR_NAMES + tuple(own))
    if own:
        assert tensors["embed_tokens.weight"].shape == (VOCAB, H)
    assert tensors["fc.weight"].shape == (H, 3 * target_hidden)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert tensors["d2t"].dtype == torch.long and tensors["d2t"].shape == (DRAFT_VOCAB,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (VOCAB,)


def test_save_with_dtype_casts_floats_only(tmp_path):
    model = make_head()
    save_eagle3(model, tmp_path / "head", dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    loaded = load_eagle3(tmp_path / "head")
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert_same_state(loaded.state_dict(), model.to(torch.bfloat16).state_dict())


def test_config_json_follows_notes_section_5(tmp_path):
    tc = target_config(tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg = Eagle3Config.from_target(tc, DRAFT_VOCAB, target_hidden_size=H_TARGET)
    model = Eagle3DraftModel(cfg)
    model.set_vocab_mapping(*build_vocab_mapping(range(DRAFT_VOCAB), VOCAB, DRAFT_VOCAB))
    save_eagle3(model, tmp_path / "head")
    c = json.loads((tmp_path / "head" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["num_hidden_layers"] == 1
    assert c["tie_word_embeddings"] is False  # even for a target with tied embeddings
    assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["rms_norm_eps"]) == (H, 64, 4, 2, 8, 1e-5)
    assert c["vocab_size"] == VOCAB and c["draft_vocab_size"] == DRAFT_VOCAB and c["target_hidden_size"] == H_TARGET
    assert c["max_position_embeddings"] == 128 and c["torch_dtype"] == "float32"
    assert c["rope_theta"] == 500000.0
    assert c["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert c["rope_parameters"] == dict(c["rope_scaling"], rope_theta=500000.0)
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    assert c[CONVENTION_KEY] == "input_of_layer"
    assert "true" not in json.dumps({k: v for k, v in c.items() if "tie" in k}).lower()
    # what an engine on transformers gets from this file
    parsed = AutoConfig.from_pretrained(tmp_path / "head")
    assert parsed.rope_parameters == c["rope_parameters"]
    assert parsed.draft_vocab_size == DRAFT_VOCAB and parsed.tie_word_embeddings is False
    assert parsed.eagle_config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # and the head loads back with the same rope
    assert load_eagle3(tmp_path / "head").config.rope_parameters == cfg.rope_parameters


def test_default_rope_writes_null_rope_scaling(tmp_path):
    save_eagle3(make_head(), tmp_path / "head")
    c = json.loads((tmp_path / "head" / "config.json").read_text())
    assert c["rope_scaling"] is None and c["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}


def test_save_is_atomic_and_replaces(tmp_path):
    first, second = make_head(seed=0), make_head(seed=1)
    save_eagle3(first, tmp_path / "head")
    (tmp_path / "head" / "stale.txt").write_text("old")
    save_eagle3(second, tmp_path / "head")
    assert sorted(os.listdir(tmp_path)) == ["head"]  # no temp or backup dirs left
    assert sorted(os.listdir(tmp_path / "head")) == ["config.json", "model.safetensors"]
    assert_same_state(load_eagle3(tmp_path / "head").state_dict(), second.state_dict())


def test_inconsistent_mapping_is_never_written(tmp_path):
    model = make_head()
    model.t2d.zero_()
    with pytest.raises(ValueError, match="t2d"):
        save_eagle3(model, tmp_path / "head")
    assert not (tmp_path / "head").exists()


# ---------------------------------------------------------------- strict loading

@pytest.fixture
def saved(tmp_path):
    model = make_head()
    path = save_eagle3(model, tmp_path / "head")
    return model, path, load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def test_unexpected_tensor_is_refused_or_skipped(saved):
    model, path, tensors, _ = saved
    rewrite(path, dict(tensors, **{"midlayer.extra.weight": torch.zeros(3), "fc.bias": torch.zeros(H)}))
    with pytest.raises(ValueError, match=r"unexpected.*fc\.bias.*midlayer\.extra\.weight"):
        load_eagle3(path)
    with pytest.warns(UserWarning, match="skipping"):
        loaded = load_eagle3(path, strict=False)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_missing_tensor_is_refused(saved):
    _, path, tensors, _ = saved
    del tensors["midlayer.hidden_norm.weight"]
    del tensors["norm.weight"]
    rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"missing.*midlayer\.hidden_norm\.weight.*norm\.weight"):
        load_eagle3(path, strict=False)


def test_a_missing_folder_or_its_files_are_named(saved, tmp_path, monkeypatch):
    _, path, _, _ = saved
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no EAGLE-3 head folder at drafts/x \(.*/drafts/x; a relative"):
        load_eagle3("drafts/x")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_eagle3(path)


def test_checkpoint_without_lm_head_is_refused(saved):
    _, path, tensors, cfg = saved
    del tensors["lm_head.weight"]
    rewrite(path, tensors, dict(cfg, draft_vocab_size=None))
    with pytest.raises(ValueError, match="lm_head"):
        load_eagle3(path)


def test_missing_vocab_mapping_is_refused_for_a_reduced_vocabulary(saved):
    _, path, tensors, _ = saved
    for name in ("d2t", "t2d"):
        rewrite(path, {k: v for k, v in tensors.items() if k != name})
        with pytest.raises(ValueError, match=name):
            load_eagle3(path)


def test_missing_vocab_mapping_means_identity_for_a_full_vocabulary(tmp_path):
    cfg = Eagle3Config.from_target(target_config(), VOCAB)
    model = Eagle3DraftModel(cfg)
    path = save_eagle3(model, tmp_path / "head")
    tensors = load_file(str(path / "model.safetensors"))
    rewrite(path, {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})
    loaded = load_eagle3(path)
    assert not loaded.d2t.any() and bool(loaded.t2d.all())


def test_zeroed_t2d_and_wrong_shapes_are_refused(saved):
    _, path, tensors, _ = saved
    rewrite(path, dict(tensors, t2d=torch.zeros(VOCAB, dtype=torch.bool)))
    with pytest.raises(ValueError, match="t2d"):
        load_eagle3(path)
    rewrite(path, dict(tensors, **{"fc.weight": torch.zeros(H, 2 * H, dtype=torch.float64)}))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        load_eagle3(path)


@pytest.mark.parametrize("change, field", [
    (dict(rope_theta=10000.0), "rope_parameters"),
    (dict(max_position_embeddings=4096), "max_position_embeddings"),
    (dict(hidden_size=64, num_attention_heads=8), "hidden_size"),
    (dict(vocab_size=64), "vocab_size"),
])
def test_load_validates_against_the_target(saved, change, field):
    _, path, _, _ = saved
    with pytest.raises(ValueError, match=field):
        load_eagle3(path, target_config=target_config(**change))


def test_declared_output_of_layer_ids_are_shifted(saved):
    _, path, _, cfg = saved
    cfg = dict(cfg, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True})
    rewrite(path, config=dict(cfg, **{CONVENTION_KEY: "output_of_layer"}))
    assert load_eagle3(path).config.aux_layer_ids == (2, 4, 5)
    rewrite(path, config=dict(cfg, **{CONVENTION_KEY: "sideways"}))
    with pytest.raises(ValueError, match="convention"):
        load_eagle3(path)


# ---------------------------------------------------------------- public layouts

def reference_config(model) -> dict:
    """An EAGLE reference / SpecForge style config.json: legacy rope keys, no aux ids, no rope_parameters."""
    c = model.config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bias": False,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "rope_theta": 500000.0, "rope_scaling": None,
            "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
            "torch_dtype": "float16"}


def test_import_eagle_reference_layout(tmp_path):
    model = make_head()
    path = tmp_path / "ref"
    path.mkdir()
    torch.save(head_state_dict(model), path / "pytorch_model.bin")
    rewrite(path, config=reference_config(model))
    with pytest.raises(ValueError, match="target_config"):
        load_eagle3(path)
    loaded = load_eagle3(path, target_config=target_config())
    assert loaded.config.aux_layer_ids == (2, 4, 5)
    assert loaded.config.rope_parameters == model.config.rope_parameters
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_import_specforge_layout_with_model_prefix_and_embeddings(tmp_path):
    model = make_head()
    path = tmp_path / "specforge"
    path.mkdir()
    embed = torch.randn(VOCAB, H, dtype=torch.float64)
    tensors = {f"model.{k}" if k.startswith(("midlayer", "fc", "norm")) else k: v
               for k, v in head_state_dict(model).items()}
    rewrite(path, dict(tensors, **{"embed_tokens.weight": embed}), reference_config(model))
    loaded = load_eagle3(path, target_config=target_config())
    assert torch.equal(loaded.embed_tokens.weight, embed) and not loaded.embed_tokens.weight.requires_grad
    state = loaded.state_dict()
    assert torch.equal(state.pop("embed_tokens.weight"), embed)
    assert_same_state(state, model.state_dict())


def test_speculators_round_trip(tmp_path):
    model = make_head(target_hidden=H_TARGET, aux_layer_ids=(1, 4, 7))
    path = save_speculators(model, tmp_path / "spec", verifier_name_or_path="org/target", speculative_tokens=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["norm_before_residual"] is False  # vLLM would default it to true
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["transformer_layer_config"]["tie_word_embeddings"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    tensors = load_file(str(path / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer") for k in tensors)
    loaded = load_eagle3(path)
    assert loaded.config.aux_layer_ids == (1, 4, 7) and loaded.config.target_hidden_size == H_TARGET
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_speculators_variants_of_another_architecture_are_refused(tmp_path):
    path = save_speculators(make_head(), tmp_path / "spec")
    cfg = json.loads((path / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc"):
        rewrite(path, config=dict(cfg, **{flag: True}))
        with pytest.raises(ValueError, match=flag):
            load_eagle3(path)


def test_multi_layer_and_foreign_configs_are_refused(saved):
    _, path, _, cfg = saved
    rewrite(path, config=dict(cfg, num_hidden_layers=2))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_eagle3(path)
    rewrite(path, config=dict(cfg, architectures=["MedusaModel"]))
    with pytest.raises(ValueError, match="architectures"):
        load_eagle3(path)


# ---------------------------------------------------------------- engine name maps

def check_layout(engine_state: dict, layout: dict, dtype):
    optional = {"model.embed_tokens.weight"}
    assert set(layout) - optional <= set(engine_state), sorted(set(layout) - optional - set(engine_state))
    assert set(engine_state) <= set(layout), sorted(set(engine_state) - set(layout))
    for name, tensor in engine_state.items():
        shape, want = layout[name]
        assert tuple(tensor.shape) == shape, name
        assert tensor.dtype == (want or dtype), name


# (head of the target's width with no table | with an own table | of another width, which always has one)
HEAD_KINDS = {"shared": (H, False), "own-table": (H, True), "other-width": (H_TARGET, True)}


def head_and_state(kind: str):
    """A head of ``HEAD_KINDS[kind]`` and its checkpoint tensors."""
    target_hidden, with_embed = HEAD_KINDS[kind]
    model = make_head(target_hidden=target_hidden)
    if with_embed:
        model.set_owned_embeddings(torch.randn(VOCAB, H, dtype=torch.float64))
    return model, head_state_dict(model, include_embeddings=with_embed)


@pytest.mark.parametrize("kind", sorted(HEAD_KINDS))
def test_vllm_name_map_round_trip(kind):
    model, ours = head_and_state(kind)
    target_hidden, with_embed = HEAD_KINDS[kind]
    engine = to_vllm_names(ours)
    layout = vllm_param_layout(model.config)
    check_layout(engine, layout, torch.float64)
    assert ("model.embed_tokens.weight" in engine) == with_embed
    assert engine_embeddings(model.config, engine, "vLLM") == ("checkpoint" if with_embed else "target")
    assert engine["model.fc.weight"].shape == (H, 3 * target_hidden)
    assert engine["draft_id_to_target_id"].dtype == torch.long
    assert torch.equal(engine["model.layers.0.self_attn.qkv_proj.weight"][: 4 * 8],
                       ours["midlayer.self_attn.q_proj.weight"])
    assert_same_state(from_vllm_names(engine, model.config), ours)
    # speculators' names go through the same vLLM loader to the same parameters
    spec = {k.replace("midlayer.", "layers.0."): v for k, v in ours.items()}
    assert_same_state(to_vllm_names(spec), engine)


@pytest.mark.parametrize("kind", sorted(HEAD_KINDS))
def test_sglang_name_map_round_trip(kind):
    model, ours = head_and_state(kind)
    target_hidden, _ = HEAD_KINDS[kind]
    engine = to_sglang_names(ours)
    check_layout(engine, sglang_param_layout(model.config), torch.float64)
    # SGLang's set_embed shares the target's table unless the widths differ
    assert engine_embeddings(model.config, engine, "SGLang") == ("checkpoint" if kind == "other-width" else "target")
    assert engine["model.fc.weight"].shape == (H, 3 * target_hidden)
    assert torch.equal(engine["hot_token_id"], model.draft_target_ids)
    assert torch.equal(engine["model.midlayer.mlp.gate_up_proj.weight"][64:], ours["midlayer.mlp.up_proj.weight"])
    assert_same_state(from_sglang_names(engine, model.config), ours)


def test_name_maps_refuse_what_engines_would_silently_drop():
    ours = head_state_dict(make_head())
    for extra in ({"fc.bias": torch.zeros(H)}, {"midlayer.extra.weight": torch.zeros(2)}):
        with pytest.raises(ValueError, match="drop"):
            to_sglang_names(dict(ours, **extra))
    with pytest.raises(ValueError, match="drop"):
        to_vllm_names(dict(ours, **{"fc.bias": torch.zeros(H)}))
    # SGLang's loader has no layers.0.* parameters: a speculators-named file would load nothing silently
    with pytest.raises(ValueError, match="SGLang would silently drop"):
        to_sglang_names({k.replace("midlayer.", "layers.0."): v for k, v in ours.items()})
    incomplete = {k: v for k, v in ours.items() if k != "midlayer.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="shards"):
        to_vllm_names(incomplete)


def test_routes_transcribe_the_engine_loaders():
    assert vllm_route("t2d") is None and sglang_route("t2d") is None
    assert vllm_route("d2t") == ("draft_id_to_target_id", None)
    assert sglang_route("d2t") == ("hot_token_id", None)
    assert vllm_route("lm_head.weight") == ("lm_head.weight", None)
    assert vllm_route("midlayer.self_attn.k_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "k")
    assert vllm_route("layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert sglang_route("midlayer.mlp.gate_proj.weight") == ("model.midlayer.mlp.gate_up_proj.weight", 0)
    assert sglang_route("fc.weight") == ("model.fc.weight", None)
    assert sglang_route("lm_head.weight") == ("lm_head.weight", None)
    assert sglang_route("layers.0.mlp.gate_proj.weight") is None


# ---------------------------------------------------------------- a head narrower than its target, end to end

H_NARROW = 16


def narrow_head(seed=0) -> Eagle3DraftModel:
    """A float64 head 16 wide for the 32-wide ``target_config()``, its table projected from a random target's."""
    torch.manual_seed(seed)
    model = Eagle3DraftModel(Eagle3Config.from_target(target_config(), DRAFT_VOCAB, hidden_size=H_NARROW)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.set_vocab_mapping(*build_vocab_mapping(torch.randperm(VOCAB)[:DRAFT_VOCAB], VOCAB, DRAFT_VOCAB))
    model.project_target_embeddings(torch.randn(VOCAB, H, dtype=torch.float64))
    return model


def test_narrow_head_saves_loads_and_maps_onto_both_engines(tmp_path):
    model = narrow_head()
    path = save_eagle3(model, tmp_path / "head")
    c = json.loads((path / "config.json").read_text())
    assert (c["hidden_size"], c["target_hidden_size"], c["num_attention_heads"]) == (H_NARROW, H, 2)
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["embed_tokens.weight"].shape == (VOCAB, H_NARROW)
    assert tensors["fc.weight"].shape == (H_NARROW, 3 * H)
    loaded = load_eagle3(path, target_config=target_config())  # the width no longer refuses the head
    assert_same_state(loaded.state_dict(), model.state_dict())
    assert not loaded.embed_tokens.weight.requires_grad
    loaded.set_embeddings(nn.Embedding(VOCAB, H).double())  # what the engine does: the own table stays
    ids, pos = torch.randint(0, VOCAB, (1, 6)), torch.arange(6)[None]
    hidden = model.fuse(torch.randn(1, 6, 3 * H, dtype=torch.float64))
    assert torch.equal(model(ids, hidden, pos), loaded(ids, hidden, pos))
    for to_engine, layout, engine in ((to_vllm_names, vllm_param_layout, "vLLM"),
                                      (to_sglang_names, sglang_param_layout, "SGLang")):
        state = to_engine(tensors)
        check_layout(state, layout(model.config), torch.float64)
        assert engine_embeddings(model.config, state, engine) == "checkpoint"
        torch.testing.assert_close(state["model.embed_tokens.weight"], tensors["embed_tokens.weight"])
    spec = save_speculators(model, tmp_path / "spec")
    assert_same_state(load_eagle3(spec, target_config=target_config()).state_dict(), model.state_dict())


def test_narrow_head_without_its_table_is_refused_here_and_by_the_engine_simulations(tmp_path):
    model = narrow_head()
    path = save_eagle3(model, tmp_path / "head")
    tensors = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k != "embed_tokens.weight"}
    rewrite(path, tensors)
    with pytest.raises(ValueError, match=r"no embed_tokens\.weight.*hidden_size=16 != target_hidden_size=32"):
        load_eagle3(path)
    for to_engine, engine in ((to_vllm_names, "vLLM"), (to_sglang_names, "SGLang")):
        with pytest.raises(ValueError, match="needs its own embed_tokens"):
            engine_embeddings(model.config, to_engine(tensors), engine)
    wrong = dict(tensors, **{"embed_tokens.weight": torch.zeros(VOCAB, H, dtype=torch.float64)})
    with pytest.raises(ValueError, match="embed_tokens"):
        engine_embeddings(model.config, to_vllm_names(wrong), "vLLM")
    rewrite(path, wrong)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight: checkpoint \(50, 32\)"):
        load_eagle3(path)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sd_with_a_narrow_head_equals_target_greedy(mode, tmp_path, byte_tokenizer):
    """A 32-wide head on a 64-wide float64 target, exported and loaded by the engine factory (the serving path):
    SD and SSD output equal the target's greedy decode token for token."""
    from helpers import make_tiny_llama, random_prompts, reference_greedy
    from ssd_eagle.config import EngineConfig, SpeculativeConfig
    from ssd_eagle.engine.factory import build
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.sampling_params import SamplingParams

    target = make_tiny_llama(seed=4, num_layers=8, vocab_size=80, max_positions=256)
    cfg = Eagle3Config.from_target(target.config, 80, hidden_size=32, torch_dtype="float64")
    assert cfg.target_hidden_size == 64 and cfg.owns_embeddings
    torch.manual_seed(0)
    head = Eagle3DraftModel(cfg).double()
    head.init_weights(std=0.3)
    head.project_target_embeddings(target.get_input_embeddings().weight)
    path = save_eagle3(head, tmp_path / "narrow")
    spec = SpeculativeConfig(method="eagle3", model=str(path), num_speculative_tokens=3, adaptive=False,
                             **({"fanout": [60]} if mode == "ssd" else {}))  # (unplanned: every round drafts)
    engine = build(EngineConfig(model="in-memory", mode=mode, max_num_seqs=3, max_model_len=256, dtype="float64",
                                speculative_config=spec), target, tokenizer=byte_tokenizer)
    prompts = [[t % 80 for t in p] for p in random_prompts(4, seed=3)]
    outs = LLM(engine=engine).generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(target, prompt, 14, eos=set())
    assert engine.stats.num_drafted > 0
