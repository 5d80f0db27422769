"""The one config system (ssd_eagle/schema.py): every config refuses an unknown key or a bad value with a
ValueError naming it, YAML files and command-line flags are read through the same schema, and the shipped
configs/*.yaml still parse."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from inference.generate import SAMPLING_FLAGS, add_sampling_args
from inference.serve import parse_args as serve_args
from ssd_eagle.config import (ENGINE_FLAGS, EngineConfig, SpeculativeConfig, add_engine_args, default_draft_model,
                              default_speculative_config, engine_config_from_args)
from ssd_eagle.sampling_params import SamplingParams
from ssd_eagle.schema import ConfigError, load_yaml, parse_flags
from train.config import TrainConfig, load_config
from train.config import parse_args as train_args

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("make, key", [
    (lambda: SamplingParams(n=2), "n"),
    (lambda: SamplingParams(temperature=math.inf), "temperature"),
    (lambda: SamplingParams(temperature=math.nan), "temperature"),
    (lambda: SamplingParams(top_p=math.nan), "top_p"),
    (lambda: SamplingParams(max_tokens=True), "max_tokens"),
    (lambda: SamplingParams(max_tokens=2.0), "max_tokens"),
    (lambda: SamplingParams(top_k=-2), "top_k"),
    (lambda: SamplingParams(seed=2**64), "seed"),
    (lambda: SamplingParams(stop=["a", ""]), "stop"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
    (lambda: SamplingParams(logprobs=21), "logprobs"),
    (lambda: SpeculativeConfig(num_speculative_tokens=0), "num_speculative_tokens"),
    (lambda: SpeculativeConfig(methd="ngram"), "methd"),
    (lambda: SpeculativeConfig(method="eagle3"), "model"),
    (lambda: SpeculativeConfig(saguaro_c=0.0), "saguaro_c"),
    (lambda: SpeculativeConfig(fanout=[2, -1]), "fanout"),
    (lambda: SpeculativeConfig(prompt_lookup_min=5), "prompt_lookup_min"),
    (lambda: SpeculativeConfig(tree_budget=8), "tree_budget"),
    (lambda: SpeculativeConfig(speculator_timeout=math.inf), "speculator_timeout"),
    (lambda: SpeculativeConfig.from_dict({"num_speculative_token": 3}), "num_speculative_token"),
    (lambda: EngineConfig(mode="xx"), "mode"),
    (lambda: EngineConfig(dtype="float8"), "dtype"),
    (lambda: EngineConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: EngineConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: EngineConfig(kv_cache_memory=0), "kv_cache_memory"),
    (lambda: EngineConfig(prefix_cache_memory=math.inf), "prefix_cache_memory"),
    (lambda: EngineConfig(no_such_key=1), "no_such_key"),
    (lambda: EngineConfig(speculative_config={"method": "ngram", "k": 3}), "speculative_config.k"),
    (lambda: TrainConfig(lr=0.0), "lr"),
    (lambda: TrainConfig(aux_layer_ids=[1, 2]), "aux_layer_ids"),
    (lambda: TrainConfig(lrr=1.0), "lrr"),
])
def test_an_unknown_or_bad_key_is_a_value_error_naming_it(make, key):
    with pytest.raises(ValueError, match=key):
        make()


def test_sampling_params_normalise_like_vllm():
    params = SamplingParams(temperature=0, top_k=-1, stop="x", stop_token_ids=(7, 8))
    assert params.greedy and isinstance(params.temperature, float)
    assert (params.top_k, params.stop, params.stop_token_ids) == (0, ["x"], [7, 8])
    assert SamplingParams().model_dump() == dict(
        max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
        logprobs=None, include_stop_str_in_output=False, skip_special_tokens=True)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_speculative_config_keeps_its_keys_and_methods():
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 3,
                                        "fanout": 2})
    assert spec.fanout == [2] and spec.resolved_fanout() == [2, 2, 2, 2]
    assert SpeculativeConfig.from_dict(spec.to_dict()) == spec
    assert SpeculativeConfig.from_json('{"method": "ngram"}') == SpeculativeConfig()
    with pytest.raises(ConfigError, match="did you mean num_speculative_tokens"):
        SpeculativeConfig.from_dict({"num_speculative_token": 3})
    config = EngineConfig(mode="sd", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config.num_speculative_tokens == 3
    assert EngineConfig(mode="ar").speculative_config is None
    auto = EngineConfig(mode="sd")  # the default drafter is the one recorded for the resolved dtype
    assert auto.speculative_config == default_speculative_config(auto.torch_dtype)


def _generate_args(argv):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_sampling_args(parser)
    return parse_flags(parser, (*ENGINE_FLAGS, *SAMPLING_FLAGS), argv)


def test_engine_and_sampling_flags():
    args = _generate_args(["--target-device", "cuda:1", "--no-pin-cpus", "--eager", "--drafter", "eagle3",
                           "--num-speculative-tokens", "3", "--stop", ", ", "--stop", "x", "--seed-request", "5",
                           "--max-model-len", "none"])
    assert (args.device, args.pin_cpus, args.eager, args.compile, args.mode) == ("cuda:1", False, True, False, None)
    assert (args.max_tokens, args.temperature, args.request_seed, args.stop) == (128, 0.0, 5, [", ", "x"])
    config = engine_config_from_args(args)
    assert config.speculative_config.method == "eagle3" and config.speculative_config.num_speculative_tokens == 3
    assert config.speculative_config.model == default_draft_model("eagle3") and config.max_model_len is None
    params = SamplingParams(**{f.field: getattr(args, f.dest) for f in SAMPLING_FLAGS})
    assert (params.seed, params.stop, params.temperature) == (5, [", ", "x"], 0.0)
    assert engine_config_from_args(_generate_args(["--compile", "true", "--mode", "ar"])).compile is True
    for bad in (["--max-num-seqs", "0"], ["--temperature", "inf"], ["--eager", "maybe"], ["--mode", "xx"]):
        with pytest.raises(SystemExit):
            _generate_args(bad)


def test_scheduler_and_memory_flags_reach_the_engine(monkeypatch):
    """vLLM's flag names; the factory passes them to LLMEngine."""
    from ssd_eagle.engine import factory

    args = _generate_args(["--max-num-batched-tokens", "64", "--no-enable-prefix-caching",
                           "--prefix-cache-memory", "0.5", "--kv-cache-memory", "2", "--mode", "ar"])
    config = engine_config_from_args(args)
    assert (config.max_num_batched_tokens, config.enable_prefix_caching, config.prefix_cache_memory,
            config.kv_cache_memory) == (64, False, 0.5, 2.0)
    defaults = engine_config_from_args(_generate_args(["--mode", "ar"]))
    assert (defaults.max_num_batched_tokens, defaults.enable_prefix_caching, defaults.kv_cache_memory) == \
        (512, True, None)
    seen = {}
    monkeypatch.setattr(factory, "LLMEngine", lambda *a, **kw: seen.update(kw))
    model = type("Target", (), {"config": type("C", (), {"get_text_config": lambda self: self,
                                                         "max_position_embeddings": 128})()})()
    factory.build(config, target=model, tokenizer=object())
    assert {k: seen[k] for k in ("max_num_batched_tokens", "enable_prefix_caching", "prefix_cache_memory",
                                 "kv_cache_memory")} == {"max_num_batched_tokens": 64, "enable_prefix_caching": False,
                                                         "prefix_cache_memory": 0.5, "kv_cache_memory": 2.0}


def test_serve_yaml_types_are_strict(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_EAGLE_API_KEY", "from-env")
    path = tmp_path / "serve.yaml"
    path.write_text("served_model_name: [a, b]\nmax_model_len: 64\ngraceful_timeout: 5\nnum_speculative_tokens: 2\n"
                    "api_key: null\n")  # null: the flag's default, here the environment's key
    args = serve_args(["--config", str(path), "--served-model-name", "c"])
    assert (args.served_model_name, args.max_model_len, args.graceful_timeout) == (["c"], 64, 5.0)
    assert args.api_key == "from-env" and engine_config_from_args(args).speculative_config.num_speculative_tokens == 2
    for bad in ("max_model_len: '64'\n", "graceful_timeout: .inf\n", "port: 70000\n", "num_speculative_tokens: 0\n"):
        path.write_text(bad)
        with pytest.raises(SystemExit):
            serve_args(["--config", str(path)])


def test_train_flags_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 3e-4\nmax-steps: 5\nextra: {note: x}\n")  # 3e-4 is a float (YAML 1.2), dashes allowed
    cfg = load_config(path, ["--no-resume", "--progress", "--extra", "{note: y}"])
    assert (cfg.lr, cfg.max_steps, cfg.resume, cfg.progress, cfg.extra) == (3e-4, 5, False, True, {"note": "y"})
    path.write_text("resume: 'no'\n")
    with pytest.raises(ConfigError, match="resume"):
        load_config(path)
    with pytest.raises(ConfigError, match="max_steps"):
        train_args(["--max_steps"])
    with pytest.raises(ConfigError, match="expected --key value"):
        train_args(["stray"])


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_shipped_yaml_configs_parse(name):
    path = REPO / "configs" / name
    if name == "default_serving.yaml":
        assert default_speculative_config() == SpeculativeConfig.from_dict(load_yaml(path)["speculative_config"])
    elif "draft" in load_yaml(path):
        assert load_config(path).output_dir
    else:
        assert engine_config_from_args(serve_args(["--config", str(path)])).max_num_seqs == 8


def test_cuda_and_cuda0_are_one_gpu_for_the_link():
    """``device=cuda`` with ``draft_device=cuda:0`` is one GPU: the link must stay gloo (NCCL cannot pair a GPU
    with itself); ``torch.device("cuda") != torch.device("cuda:0")`` said they differ."""
    from ssd_eagle.engine.factory import cuda_index

    assert cuda_index("cuda:0") == 0 and cuda_index("cuda:1") == 1
    assert cuda_index("cuda") == cuda_index("cuda:0")


def test_default_serving_config_is_picked_per_resolved_dtype(tmp_path, monkeypatch):
    """configs/default_serving.yaml records the fastest lossless configuration per dtype (issue 13 item 6):
    inference.serve/inference.generate (engine_config_from_args) and EngineConfig take the entry of the resolved
    dtype, the top-level keys where a dtype has none."""
    import ssd_eagle.config as config

    path = tmp_path / "default_serving.yaml"
    path.write_text("mode: sd\nspeculative_config: {method: ngram, num_speculative_tokens: 4}\n"
                    "by_dtype:\n  bfloat16:\n    speculative_config: {method: eagle3, model: /heads/e3}\n"
                    "  float16:\n    mode: ssd\n")
    monkeypatch.setattr(config, "DEFAULT_SERVING_CONFIG", path)
    bf16 = engine_config_from_args(_generate_args(["--dtype", "bfloat16"]))
    assert (bf16.mode, bf16.speculative_config.method, bf16.speculative_config.model) == ("sd", "eagle3", "/heads/e3")
    assert "num_speculative_tokens" not in bf16.speculative_config.model_fields_set  # the planner picks K
    f32 = engine_config_from_args(_generate_args(["--dtype", "float32"]))
    assert (f32.speculative_config.method, f32.speculative_config.num_speculative_tokens) == ("ngram", 4)
    assert engine_config_from_args(_generate_args(["--dtype", "float16"])).mode == "ssd"
    assert EngineConfig(mode="sd", dtype="bfloat16").speculative_config.method == "eagle3"
    assert EngineConfig(mode="sd", dtype="float32").speculative_config.method == "ngram"
    assert config.default_mode() == "sd" and config.default_speculative_config().method == "ngram"
