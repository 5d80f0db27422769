"""Scaling beyond one device, on CPU with gloo.

- A TP=2 target plus a speculator rank (3 processes under torchrun) decodes greedily exactly like the
  single-process target, each target rank holds half of every sharded weight, and its KV cache half the kv heads.
- ``python -m inference.launch --tp 2 generate`` (the user-facing command) gives the same tokens.
- A 2-process ``deepspeed --num_gpus 2`` draft training on offline features written once: the ranks read disjoint
  halves of the one feature cache, and the ZeRO-3 checkpoint exports the same tensor names and shapes as a
  1-process run, also when rebuilt from the 2-rank ZeRO partitions alone.

This file is also the rank program of those launches (``python tests/test_tp.py serve-ranks|train-rank ...``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(REPO) not in sys.path:  # run as a rank program
    sys.path.insert(0, str(REPO))

from helpers import make_byte_tokenizer, make_tiny_llama  # noqa: E402

PROMPTS = [[72, 101, 108, 108, 111], [84, 104, 101, 32, 113, 117, 105, 99, 107], [65, 66, 67]]
MAX_TOKENS = [16, 24, 20]  # different lengths: the third request is admitted while others run
K = 3
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
EOS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


# ----------------------------------------------------------------------------------------------------------------
# tensor-parallel serving

@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """A float64 target (4 heads, 2 kv heads, vocabulary 257: odd, so the output layer splits 129/128), a draft
    LM that is the target with noise (it agrees on some tokens, not all), and the target's greedy reference."""
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.engine.llm_engine import LLMEngine
    from ssd_eagle.sampling_params import SamplingParams

    root = tmp_path_factory.mktemp("tp")
    tok = make_byte_tokenizer()
    target = make_tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2, seed=0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    draft = make_tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.08)
    draft.save_pretrained(root / "draft")
    tok.save_pretrained(root / "draft")
    engine = LLMEngine(target, tok, None, max_num_seqs=2, max_model_len=256)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    reference = [o.token_ids for o in LLM(engine=engine).generate(PROMPTS, params)]
    return {"root": root, "target": str(root / "target"), "draft": str(root / "draft"), "reference": reference}


def _cache_ops(runner) -> list[list[float]]:
    """Cache maintenance as a tree verification does it, then forwards that read the result: a prompt, two sibling
    drafts at the same depth, ``compact`` keeping the second, a token after it; ``copy_slot`` to slot 1 and a token
    there. Returns the two forwards' logits (equal on a TP target only if every rank mirrored the operations)."""
    from ssd_eagle.kv_cache import ForwardBatch

    dt, dev = runner.dtype, runner.device
    prompt = PROMPTS[0]
    n = len(prompt)
    runner.forward(ForwardBatch.causal([prompt], [0], [0], dt, dev), compute_logits=False)
    visible = torch.zeros(1, 2, n + 2, dtype=torch.bool)
    visible[0, :, :n] = True
    visible[0, 0, n] = visible[0, 1, n + 1] = True
    runner.forward(ForwardBatch.build(torch.tensor([[65, 66]]), torch.tensor([[n, n]]), torch.tensor([[n, n + 1]]),
                                      [0], visible, dt, dev, [2]), compute_logits=False)
    runner.kv.compact(0, torch.tensor([n + 1], device=dev), n)
    first = runner.forward(ForwardBatch.causal([[67]], [0], [n + 1], dt, dev)).logits
    runner.kv.copy_slot(0, 1, n + 2)
    second = runner.forward(ForwardBatch.causal([[68]], [1], [n + 2], dt, dev)).logits
    return [first.flatten().tolist(), second.flatten().tolist()]


def _serve_ranks(out: Path, target: str, draft: str) -> None:
    """Rank program: TP=2 target + speculator rank; rank 0 generates, every target rank reports its shard."""
    import torch.distributed as dist

    from ssd_eagle.config import EngineConfig
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.parallel.engine import DriverSession, run_worker, share_config
    from ssd_eagle.parallel.sharding import load_sharded_model, shard_shapes
    from ssd_eagle.parallel.speculator import run_speculator_rank
    from ssd_eagle.parallel.topology import SPECULATOR, init_topology
    from ssd_eagle.sampling_params import SamplingParams

    topo = init_topology(2)
    if topo.role == SPECULATOR:
        share_config()
        run_speculator_rank(topo, "cpu")
    else:
        model = load_sharded_model(target, topo, torch.float64, torch.device("cpu"))
        (out / f"shards-rank{topo.rank}.json").write_text(json.dumps(shard_shapes(model)))
        if topo.rank == 0:
            config = EngineConfig(model=target, dtype="float64", mode="ssd", max_model_len=256, max_num_seqs=2,
                                  pin_cpus=False, speculative_config={"method": "draft_model", "model": draft,
                                                                      "num_speculative_tokens": K})
            session = DriverSession(topo)
            try:
                engine = session.build_engine(config, model=model)
                params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
                outs = LLM(engine=engine).generate(PROMPTS, params)
                result = {"token_ids": [o.token_ids for o in outs], "stats": engine.stats.summary(),
                          "drafter_healthy": engine.drafter.healthy, "cache_ops": _cache_ops(engine.target),
                          "forwards": engine.target.forwards, "kv_heads": engine.target.kv.keys[0].shape[1]}
            finally:
                session.close()
            (out / "driver.json").write_text(json.dumps(result))
        else:
            forwards = run_worker(share_config(), topo, model)
            (out / f"worker-rank{topo.rank}.json").write_text(json.dumps({"forwards": forwards}))
    dist.destroy_process_group()


def test_tp2_target_with_speculator_rank_equals_single_process(tp_models, tmp_path):
    """3 processes: ranks 0-1 hold the target sharded in two, rank 2 the SSD speculator (its own group with rank
    0). Greedy tokens equal the single-process target's; every projection weight and the output layer are split
    in halves across the two ranks (the embedding and norms stay whole); the KV cache holds one of two kv heads;
    the worker replayed every forward and mirrored ``compact``/``copy_slot``; the speculator answered (drafts were
    accepted)."""
    from ssd_eagle.model_runner import ModelRunner
    from transformers import AutoModelForCausalLM

    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", __file__,
          "serve-ranks", str(tmp_path), tp_models["target"], tp_models["draft"]])
    driver = json.loads((tmp_path / "driver.json").read_text())
    assert driver["token_ids"] == tp_models["reference"]
    assert driver["drafter_healthy"] and driver["stats"]["accepted_tokens"] > 0
    assert driver["stats"]["cache_lookups"] > 0
    assert driver["kv_heads"] == 1
    assert json.loads((tmp_path / "worker-rank1.json").read_text())["forwards"] == driver["forwards"] > 0
    whole = AutoModelForCausalLM.from_pretrained(tp_models["target"], dtype=torch.float64)
    expected = _cache_ops(ModelRunner(whole, 2, 256))
    for got, want in zip(driver["cache_ops"], expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-9)

    ranks = [json.loads((tmp_path / f"shards-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    sharded = []
    for name, (full, local0) in ranks[0].items():
        local1 = ranks[1][name][1]
        if local0 == full:
            assert local1 == full and ("norm" in name or "embed_tokens" in name), name
            continue
        sharded.append(name)
        dims = [d for d in range(len(full)) if local0[d] != full[d]]
        assert len(dims) == 1 and local0[dims[0]] + local1[dims[0]] == full[dims[0]], (name, full, local0, local1)
        if name.split(".")[-2] in split:
            assert local0 == local1 and 2 * local0[dims[0]] == full[dims[0]], name
            assert dims[0] == (1 if name.split(".")[-2] in ("o_proj", "down_proj") else 0), name
    expected = {f"model.layers.{i}.{kind}.{proj}.weight" for i in range(3)
                for kind, projs in (("self_attn", split[:4]), ("mlp", split[4:])) for proj in projs}
    assert set(sharded) == expected | {"lm_head.weight"}
    assert (ranks[0]["lm_head.weight"][1][0], ranks[1]["lm_head.weight"][1][0]) == (129, 128)


def test_launch_command_generates_the_single_process_tokens(tp_models):
    """``python -m inference.launch --tp 2 generate`` re-executes itself under torchrun with 3 processes (SSD) and
    prints the target's greedy tokens."""
    proc = _run([sys.executable, "-m", "inference.launch", "--tp", "2", "generate", "--json", "--no-chat",
                 "--prompt", bytes(PROMPTS[1]).decode(), "--model", tp_models["target"], "--dtype", "float64",
                 "--mode", "ssd", "--max-tokens", str(MAX_TOKENS[1]), "--max-model-len", "256", "--max-num-seqs", "2",
                 "--speculative-config", json.dumps({"method": "draft_model", "model": tp_models["draft"],
                                                     "num_speculative_tokens": K})])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == tp_models["reference"][1]
    assert out["stats"]["mode"] == "ssd:draft_model" and out["stats"]["accepted_tokens"] > 0


def test_launcher_world_size_follows_the_mode(tmp_path):
    from inference.launch import torchrun_argv

    assert torchrun_argv(4, ["--tp", "4", "generate"], ["--mode", "ssd"])[5] == "5"
    assert torchrun_argv(4, ["--tp", "4", "generate"], ["--mode", "ar"])[5] == "4"
    yaml_cfg = tmp_path / "serve.yaml"
    yaml_cfg.write_text("mode: ssd\n")
    assert torchrun_argv(2, [], ["--config", str(yaml_cfg)])[5] == "3"


def test_embedding_and_tied_output_layer_stay_whole_and_heads_must_divide():
    from ssd_eagle.parallel.sharding import check_shardable, restrict_plan, whole_module_names

    untied, tied = make_tiny_llama(num_layers=1), make_tiny_llama(num_layers=1, tie=True)
    assert whole_module_names(untied) == {"model.embed_tokens"}
    assert whole_module_names(tied) == {"model.embed_tokens", "lm_head"}
    plan = {"model.embed_tokens": "embedding_rowwise", "model.embed_tokens.weight": "embedding_rowwise",
            "lm_head": "colwise_gather_output", "lm_head.weight": "colwise_gather_output",
            "model.layers.0.self_attn.q_proj.weight": "colwise"}
    assert set(restrict_plan(untied, plan)) == {"lm_head", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert set(restrict_plan(tied, plan)) == {"model.layers.0.self_attn.q_proj.weight"}
    check_shardable(untied.config, 2)
    with pytest.raises(ValueError, match="must divide"):
        check_shardable(untied.config, 4)  # 4 heads, 2 kv heads


@pytest.mark.parametrize("name", ["llama-3.1-70b-tp4-draftlm.yaml", "llama-3.1-70b-tp4-eagle3.yaml",
                                  "llama-3.1-8b-ssd-draftlm.yaml"])
def test_deployment_configs_are_serve_configs_for_ssd(name):
    from inference.launch import wants_speculator
    from inference.serve import parse_args
    from ssd_eagle.config import engine_config_from_args

    path = str(REPO / "configs" / name)
    cfg = engine_config_from_args(parse_args(["--config", path]))
    assert cfg.mode == "ssd" and cfg.device.startswith("cuda") and cfg.torch_dtype == torch.bfloat16
    assert cfg.max_model_len == 8192 and cfg.max_num_seqs == 8
    assert cfg.speculative_config.num_speculative_tokens == 7 and sum(cfg.speculative_config.resolved_fanout()) == 24
    assert wants_speculator(["--config", path])


# ----------------------------------------------------------------------------------------------------------------
# multi-process training

def _train_rank(config_path: str, record: str) -> None:
    """Rank program: train one rank of a DeepSpeed run and write which feature samples it read: ``counted``
    (vocabulary counts) and ``trained`` (micro-batches). Under the ``deepspeed`` launcher, or alone with plain
    ``python`` (a one-process world)."""
    from train.config import parse_args
    from train.features import FeatureStore
    from train.train_draft import Trainer, init_distributed

    reads = {"counted": [], "trained": []}
    original = FeatureStore.get

    def recording_get(self, i, with_hidden=True):
        reads["trained" if with_hidden else "counted"].append(int(i))
        return original(self, i, with_hidden)

    FeatureStore.get = recording_get
    cfg = parse_args(["--config", config_path])
    rank, world = init_distributed()
    Trainer(cfg).train()
    Path(record, f"reads-rank{rank}.json").write_text(json.dumps(dict(reads, world=world)))


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A tiny float32 target, 24 conversations, and their offline features written once (one process)."""
    from train.config import config_from_dict
    from train.precompute_features import precompute

    root = tmp_path_factory.mktemp("train")
    tok = make_byte_tokenizer()
    tok.chat_template = EOS_TEMPLATE
    model = make_tiny_llama(num_layers=4, hidden_size=64, dtype=torch.float32, max_positions=512, seed=0)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(0)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i} " + words(2, 4)},
                                                     {"role": "assistant", "content": words(4, 8)}]}) + "\n"
                            for i in range(24)))
    values = dict(target=str(root / "target"), data=str(data), check_heldout=False, mode="offline",
                  features_dir=str(root / "features"), feature_dtype="float32", max_length=96, draft_vocab_size=24,
                  ttt_steps=2, lr=3e-3, warmup_steps=1, max_steps=3, save_every=3, eval_every=0, log_every=1,
                  progress=False, num_threads=1, deepspeed_config=str(REPO / "configs" / "ds_zero3.json"))
    precompute(config_from_dict(values), rank=0, world_size=1)
    return root, values


def _export_layout(run_dir: Path, out: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    from train.export import main as export_main

    export_main([str(run_dir), str(out), "--dtype", "float32"])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_two_rank_deepspeed_training_reads_disjoint_halves_and_exports_like_one_rank(features, tmp_path):
    """``deepspeed --num_gpus 2`` (gloo, ZeRO-3) on features precomputed once: rank 0 and rank 1 count and train
    on disjoint halves of the one cache, together all of it. The 2-rank checkpoint exports the same tensor names
    and shapes as a 1-rank run's, and the same values when rebuilt from the ZeRO-3 partitions alone."""
    import yaml

    from train.checkpoint import DRAFT_DIR, DRAFT_WEIGHTS, read_draft_tensors, resolve_checkpoint
    from train.features import FeatureStore

    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not installed (pip install deepspeed)")
    root, values = features
    runs = {}
    for world in (2, 1):
        out = runs[world] = tmp_path / f"world{world}"
        out.mkdir()
        cfg = out / "train.yaml"
        cfg.write_text(yaml.safe_dump(dict(values, output_dir=str(out / "run"))))
        if world == 2:
            port = str(29500 + random.Random().randint(0, 400))
            _run(["deepspeed", "--num_gpus", "2", "--master_port", port, __file__, "train-rank", str(cfg), str(out)],
                 timeout=600)
        else:  # plain python: a one-process world (and no process group left in this pytest process)
            _run([sys.executable, __file__, "train-rank", str(cfg), str(out)], timeout=600)

    total = len(FeatureStore(values["features_dir"]))
    reads = [json.loads((runs[2] / f"reads-rank{r}.json").read_text()) for r in (0, 1)]
    shards = [set(r["counted"]) for r in reads]
    assert all(r["world"] == 2 for r in reads) and all(shards)
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(total))
    for r, shard in zip(reads, shards):
        assert r["trained"] and set(r["trained"]) <= shard
    single = json.loads((runs[1] / "reads-rank0.json").read_text())
    assert set(single["counted"]) == set(range(total))

    layouts = {w: _export_layout(runs[w] / "run", runs[w] / "export") for w in (1, 2)}
    assert layouts[2] == layouts[1] and "lm_head.weight" in layouts[2] and "d2t" in layouts[2]

    step = resolve_checkpoint(runs[2] / "run")
    gathered = read_draft_tensors(step)
    (step / DRAFT_DIR / DRAFT_WEIGHTS).unlink()  # force the rebuild from the two ranks' ZeRO-3 partitions
    rebuilt = read_draft_tensors(step)
    assert rebuilt.keys() == gathered.keys()
    for name, tensor in gathered.items():
        assert torch.equal(rebuilt[name].to(tensor.dtype), tensor), name


# ----------------------------------------------------------------------------------------------------------------
# rank programs

if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    if argv[0] == "serve-ranks":
        _serve_ranks(Path(argv[1]), argv[2], argv[3])
    elif argv[0] == "train-rank":
        _train_rank(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown rank program {argv[0]!r}")
