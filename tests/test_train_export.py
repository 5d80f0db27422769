"""Export of trained drafts: the EAGLE-3 folder through the vLLM and SGLang name maps, untied draft configs, refusal
of a head without lm_head, ZeRO-3 checkpoints exported to the in-memory weights, draft LM layouts, hub push."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine_loaders import from_sglang_names, from_vllm_names, to_sglang_names, to_vllm_names
from helpers import make_byte_tokenizer
from ssd_eagle.models.eagle3 import Eagle3Config, Eagle3DraftModel
from ssd_eagle.models.eagle3_formats import load_eagle3
from train import checkpoint as ckpt
from train.export import export_checkpoint, main as export_main, materialize
from train_helpers import REPO, make_head, run_trainer, tiny_config, write_tiny_setup

H = 32


def save_target(path: Path, tie: bool = False) -> LlamaConfig:
    """A saved target whose geometry matches test_train_draft.make_head (vocab 40, hidden 32, 8 layers)."""
    cfg = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                      num_hidden_layers=8, vocab_size=40, max_position_embeddings=128, rope_theta=1e4,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    make_byte_tokenizer().save_pretrained(path)
    return cfg


def write_checkpoint(root: Path, head: Eagle3DraftModel, target: str, step: int = 7) -> Path:
    """A committed checkpoint holding ``head`` (what the trainer writes, without DeepSpeed's own files)."""
    from dataclasses import asdict

    tmp = root / (ckpt.TMP_PREFIX + ckpt.step_tag(step))
    config = asdict(head.config)
    config["aux_layer_ids"] = list(config["aux_layer_ids"])
    ckpt.write_draft_snapshot(tmp, "eagle3", config, head.state_dict(), {"target": target})
    state = {"step": step, "tokens": 1234, "elapsed_s": 5.0, "world_size": 1, "zero_stage": 2,
             "data": {"source": "data.jsonl", "num_conversations": 3, "num_tokens": 99},
             "last_metrics": {"loss": 1.5, "step_acc": [0.5, 0.4], "epoch": 1.0},
             "last_heldout": {"heldout_tau": 2.25, "heldout_rounds": 10, "heldout_num_draft": 7}}
    (tmp / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    (tmp / ckpt.TRAIN_CONFIG).write_text(yaml.safe_dump({"target": target, "ttt_steps": 7, "ttt_decay": 0.8}))
    return ckpt.commit_checkpoint(root, tmp.name, ckpt.step_tag(step), keep=2)


@pytest.fixture()
def head_checkpoint(tmp_path):
    target = tmp_path / "target"
    save_target(target)
    head, _ = make_head(dtype=torch.float32)
    step_dir = write_checkpoint(tmp_path / "ckpts", head, str(target))
    return head, step_dir, target


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-3 folder

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_round_trip_through_vllm_and_sglang_name_maps(head_checkpoint, tmp_path, dtype):
    head, step_dir, target = head_checkpoint
    out = export_checkpoint(step_dir.parent, tmp_path / "export", dtype=dtype, speculators=True)
    expected = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v) for k, v in head.state_dict().items()}
    maps = [(to_vllm_names, from_vllm_names), (to_sglang_names, from_sglang_names)]
    for folder, engines in ((out, maps), (out / "speculators", maps[:1])):  # speculators: a vLLM format
        tensors = load_file(str(folder / "model.safetensors"))
        assert not any("embed" in k for k in tensors)
        for to_engine, from_engine in engines:
            back = from_engine(to_engine(tensors), head.config)
            assert sorted(back) == sorted(expected)
            for k, v in expected.items():
                assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        loaded = load_eagle3(folder, target_config=LlamaConfig.from_pretrained(target))
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, expected[k]), k
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["tie_word_embeddings"] is False
    assert config["rope_parameters"] == {"rope_theta": 1e4, "rope_type": "default"} and config["rope_theta"] == 1e4
    assert config["max_position_embeddings"] == 128 and config["draft_vocab_size"] == 16
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_aux_hidden_state_layer_ids_convention"] == "input_of_layer"
    assert config["torch_dtype"] == dtype
    card = (out / "README.md").read_text()
    assert "tau = 2.25" in card and "data.jsonl" in card and "7 optimizer steps" in card
    assert (out / "tokenizer.json").exists()


def test_tied_target_never_gives_a_tied_draft_config(tmp_path):
    target = tmp_path / "target"
    tc = save_target(target, tie=True)
    assert tc.tie_word_embeddings is True
    cfg = Eagle3Config.from_target(tc, 16)
    assert cfg.to_llama_config().tie_word_embeddings is False
    head = Eagle3DraftModel(cfg)
    head.set_vocab_mapping(*head.build_vocab_mapping(range(16), 40, 16))
    step_dir = write_checkpoint(tmp_path / "ckpts", head, str(target))
    out = export_checkpoint(step_dir, tmp_path / "export", dtype="float32")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert load_file(str(out / "model.safetensors"))["lm_head.weight"].shape == (16, H)


def test_checkpoint_without_lm_head_is_refused(head_checkpoint, tmp_path):
    _, step_dir, _ = head_checkpoint
    weights = step_dir / ckpt.DRAFT_DIR / ckpt.DRAFT_WEIGHTS
    tensors = load_file(str(weights))
    del tensors["lm_head.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="no lm_head.weight"):
        export_checkpoint(step_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_push_to_hub_calls_create_repo_and_upload_folder(head_checkpoint, tmp_path, monkeypatch):
    import huggingface_hub

    _, step_dir, _ = head_checkpoint
    calls = []

    def create_repo(repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))
        return f"https://hub.local/{repo_id}"

    def upload_folder(**kw):
        files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
        calls.append(("upload_folder", kw, files))
        return "commit-info"

    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    export_main([str(step_dir), str(tmp_path / "export"), "--push-to-hub", "me/draft", "--private", "--speculators"])
    assert calls[0] == ("create_repo", "me/draft", {"private": True, "exist_ok": True, "repo_type": "model",
                                                    "token": None})
    _, kw, files = calls[1]
    assert kw["repo_id"] == "me/draft" and kw["repo_type"] == "model"
    assert Path(kw["folder_path"]) == tmp_path / "export"
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "speculators"} <= set(files)


# ----------------------------------------------------------------------------------------------------------------
# ZeRO-3 checkpoints and the draft LM

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_setup(tmp_path_factory.mktemp("tiny_export"), num_convs=12)


def _assert_equal_states(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].numel() > 0 and got[k].shape == v.shape, k
        assert torch.equal(got[k].to(v.dtype), v), k


def test_zero3_checkpoint_exports_in_memory_weights(tiny, tmp_path):
    out = tmp_path / "run"
    trainer, _ = run_trainer(**tiny_config(tiny, out, max_steps=2, save_every=2, eval_every=0,
                                           deepspeed_config=str(REPO / "configs" / "ds_zero3.json")))
    params = list(trainer.engine.module.parameters())
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params)  # really partitioned by ZeRO-3
    memory = trainer.gathered_draft_state()
    assert memory["lm_head.weight"].shape == (24, 64)
    export = export_checkpoint(out, tmp_path / "export", dtype="float32")
    tensors = load_file(str(export / "model.safetensors"))
    _assert_equal_states(tensors, memory)
    assert not any("embed" in k for k in tensors)
    # without the gathered snapshot, DeepSpeed's own ZeRO-3 partitions give the same tensors
    step_dir = ckpt.resolve_checkpoint(out)
    (step_dir / ckpt.DRAFT_DIR / ckpt.DRAFT_WEIGHTS).unlink()
    _assert_equal_states(ckpt.read_draft_tensors(step_dir), memory)
    again = export_checkpoint(out, tmp_path / "export2", dtype="float32")
    _assert_equal_states(load_file(str(again / "model.safetensors")), memory)


def test_narrow_head_trains_exports_and_loads_in_both_engine_simulations(tiny, tmp_path):
    """``draft_hidden_size`` 32 on the 64-wide target: the head's own table starts as the projection of the target's,
    stays frozen, and is exported; vLLM and SGLang (simulated) run the head on it."""
    from engine_loaders import engine_embeddings

    out = tmp_path / "run"
    trainer, _ = run_trainer(**tiny_config(tiny, out, max_steps=2, save_every=2, eval_every=0, draft_hidden_size=32))
    head = trainer.head
    assert (head.config.hidden_size, head.config.target_hidden_size) == (32, 64)
    fresh = Eagle3DraftModel(head.config)
    fresh.project_target_embeddings(trainer.target_embed.weight)
    assert torch.equal(head.embed_tokens.weight, fresh.embed_tokens.weight)  # frozen through training
    export = export_checkpoint(out, tmp_path / "export", dtype="float32")
    tensors = load_file(str(export / "model.safetensors"))
    assert tensors["embed_tokens.weight"].shape == (head.config.vocab_size, 32)
    assert tensors["fc.weight"].shape == (32, 3 * 64)
    _assert_equal_states(tensors, trainer.gathered_draft_state())
    for to_engine, engine in ((to_vllm_names, "vLLM"), (to_sglang_names, "SGLang")):
        assert engine_embeddings(head.config, to_engine(tensors), engine) == "checkpoint"
    loaded = load_eagle3(export, target_config=LlamaConfig.from_pretrained(tiny["target"]))
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)
    assert "own `embed_tokens.weight` [vocab, 32]" in (export / "README.md").read_text()


def test_init_from_warm_starts_a_draft_lm_from_its_compact_export_and_refuses_another_depth(tiny, tmp_path):
    from ssd_eagle.models.draft_lm import draft_vocab_ids, load_draft_lm

    first, _ = run_trainer(**tiny_config(tiny, tmp_path / "a", draft="draft_lm", draft_lm_layers=2, max_steps=2,
                                         save_every=2, eval_every=0, draft_vocab_size=12))
    compact = export_checkpoint(tmp_path / "a", tmp_path / "compact", dtype="float32", compact=True)
    exported = load_draft_lm(compact, first.target)
    warm, _ = run_trainer(**tiny_config(tiny, tmp_path / "b", draft="draft_lm", draft_lm_layers=2, max_steps=1,
                                        save_every=1, eval_every=0, lr=1e-9, draft_vocab_size=12,
                                        init_from=str(compact)))
    assert warm.body.config.ssd_eagle == {"draft_vocab": draft_vocab_ids(exported.config).tolist()}
    assert len(warm.body.config.ssd_eagle["draft_vocab"]) == 12
    state = warm.body.trained_state_dict()
    for name, value in exported.state_dict().items():  # one step at lr 1e-9 from the export's weights
        if name in state:
            torch.testing.assert_close(state[name].float(), value.float(), rtol=0, atol=1e-6)
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"],
                           first.target.get_decoder().layers[0].mlp.up_proj.weight.to(state["model.norm.weight"]))
    with pytest.raises(ValueError, match="draft_lm_layers 1"):
        run_trainer(**tiny_config(tiny, tmp_path / "c", draft="draft_lm", draft_lm_layers=1, max_steps=1,
                                  init_from=str(compact)))


def test_draft_lm_zero3_plain_compact_and_materialized_exports(tiny, tmp_path):
    from ssd_eagle.models.draft_lm import load_draft_lm

    out = tmp_path / "run"
    trainer, result = run_trainer(**tiny_config(tiny, out, draft="draft_lm", draft_lm_layers=2, max_steps=2,
                                                save_every=2, eval_every=2,
                                                deepspeed_config=str(REPO / "configs" / "ds_zero3.json")))
    assert "heldout_tau" in result
    memory = trainer.gathered_draft_state()
    assert sorted(memory) == sorted(f"model.{k}" for k in trainer.body.model.state_dict())
    plain = export_checkpoint(out, tmp_path / "plain", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.tie_word_embeddings is False
    state = model.state_dict()
    for k, v in memory.items():
        assert torch.equal(state[k], v), k
    assert torch.equal(state["model.embed_tokens.weight"], trainer.target.get_input_embeddings().weight)
    assert torch.equal(state["lm_head.weight"], trainer.target.get_output_embeddings().weight)

    compact = export_checkpoint(out, tmp_path / "compact", dtype="float32", compact=True)
    assert not (compact / "model.safetensors").exists()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(compact)
    with pytest.raises(ValueError, match="pass the target"):
        load_draft_lm(compact)
    loaded = load_draft_lm(compact, trainer.target)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    other = type(trainer.target)(trainer.target.config)
    with pytest.raises(ValueError, match="another target"):
        load_draft_lm(compact, other)
    plain2 = materialize(compact, tmp_path / "plain2", dtype="float32")
    again = AutoModelForCausalLM.from_pretrained(plain2, dtype=torch.float32).state_dict()
    for k, v in state.items():
        assert torch.equal(again[k], v), k
    ids = torch.randint(0, 257, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits)
    # the engines load the compact folder directly (SD drafter and the SSD speculator's draft), completed from the
    # target: greedy SD output equals the target's own greedy decode
    from ssd_eagle.config import SpeculativeConfig
    from ssd_eagle.drafters import build_drafter
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.sampling_params import SamplingParams
    from ssd_eagle.engine.factory import load_draft

    spec = SpeculativeConfig(method="draft_model", model=str(compact), num_speculative_tokens=3)
    ssd_draft = load_draft(spec, trainer.target)
    for k, v in ssd_draft.state_dict().items():
        assert torch.equal(v, state[k]), k
    # every layout records the draft vocabulary (the run's most frequent assistant tokens: at most 24, here the
    # 14 the tiny data has), and the engine's drafter scores only those rows
    from train.vocab import load_token_counts, most_frequent_ids

    counts, _ = load_token_counts(out / "token_counts.json")
    vocab = most_frequent_ids(counts, 24).sort().values.tolist()
    assert 0 < len(vocab) <= 24
    for folder in (plain, compact, plain2):
        assert json.loads((folder / "config.json").read_text())["ssd_eagle"]["draft_vocab"] == vocab, folder
    card = (compact / "README.md").read_text()
    assert f"draft vocabulary: ssd-eagle drafts over the {len(vocab)} most frequent" in card
    target, tokenizer = trainer.target, trainer.tokenizer
    drafter = build_drafter(spec, target, 1, 256)
    assert drafter.backend.vocab.tolist() == vocab and drafter.backend.runner.lm_head.weight.shape[0] == len(vocab)
    engine = LLMEngine(target, tokenizer, drafter, num_speculative_tokens=3, max_num_seqs=1, max_model_len=256)
    prompt = [5, 9, 17, 33, 8]
    got = LLM(engine=engine).generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    with torch.no_grad():
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None)[0, len(prompt):].tolist()
    assert got[0].token_ids == expected


def test_model_card_names_the_configured_data_file():
    """Offline features may index several data files (the first one's name is in their metadata); the card names
    the file training selected its rows from, the config's ``data``."""
    from train.export import model_card

    state = {"step": 3, "data": {"source": "runs/pilot/data.jsonl", "num_conversations": 2, "num_tokens": 9}}
    card = model_card("eagle3", "x", "t", state, {"data": "data/real.jsonl.gz", "ttt_steps": 7})
    assert "`data/real.jsonl.gz`" in card and "pilot" not in card
    assert "`runs/pilot/data.jsonl`" in model_card("eagle3", "x", "t", state, {"ttt_steps": 7})
