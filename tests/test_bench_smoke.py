"""Every benchmark script runs end to end on tiny models for a few tokens, so that none can rot unnoticed (issue 13:
``bench_decode.py`` once crashed at start-up). The figures mean nothing here; the scripts' own checks do: each
prints the platform line (CPU, flags, dtype) and its table, and the exactness columns find no violation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import eagle3_head_for, make_byte_tokenizer, make_tiny_llama, noisy_copy
from test_server_uvicorn import Server

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """A tiny float32 target (long enough for the held-out prompts at one byte per token), a draft LM of the same
    vocabulary and an EAGLE-3 head, saved like real checkpoints."""
    from ssd_eagle.models.eagle3_formats import save_eagle3

    root = tmp_path_factory.mktemp("bench_assets")
    tokenizer = make_byte_tokenizer()
    target = make_tiny_llama(num_layers=4, max_positions=8192, dtype=torch.float32, seed=3)
    paths = {"target": root / "target", "draft_lm": root / "draft_lm", "eagle3": root / "eagle3"}
    target.save_pretrained(paths["target"])
    tokenizer.save_pretrained(paths["target"])
    draft = noisy_copy(target, 0.05)
    draft.save_pretrained(paths["draft_lm"])
    tokenizer.save_pretrained(paths["draft_lm"])
    save_eagle3(eagle3_head_for(target.double()), paths["eagle3"], dtype=torch.float32)
    return paths


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Script:
    """A benchmark script started in the background (all of them run at once: most of their time is start-up)."""

    def __init__(self, *args: str):
        self.name = args[0]
        self.proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def output(self, platform_line: bool = True) -> str:
        try:
            stdout, stderr = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
        assert self.proc.returncode == 0, f"{self.name} failed ({self.proc.returncode}):\n{stdout[-3000:]}\n" \
                                          f"{stderr[-3000:]}"
        if platform_line:
            assert "dtype=" in stdout and "native_bf16=" in stdout, "the platform line is missing"
        return stdout


@pytest.fixture(scope="module")
def scripts(assets, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench_ssd")
    target = str(assets["target"])
    # the server first: started next to five busy scripts on two cores it can miss its start-up timeout
    server = Server(assets["target"], tmp_path_factory.mktemp("server") / "server.log")
    started = {
        "bench_decode": Script("scripts/bench_decode.py", "--model", target, "--prompts", "1", "--max-tokens", "6",
                               "--repeats", "1", "--threads", "1"),
        "bench_ssd": Script("scripts/bench_ssd.py", "--model", target, "--draft-lm", str(assets["draft_lm"]),
                            "--eagle3", str(assets["eagle3"]), "--eagle3-saguaro", "",
                            "--configs", "ar,sd_ngram,sd_lm,ssd_lm_geo,sd_eagle3,ssd_eagle3,hf_lookup,ar_fixed,"
                                         "sd_eagle3_fixed,sd_ngram_plan",
                            "--temperatures", "0,1", "--prompts", "1", "--max-tokens", "6", "--budget", "6",
                            "--out", str(out_dir)),
        "eval_draft": Script("scripts/eval_draft.py", "--model", target, "--draft", f"eagle3={assets['eagle3']}",
                             "--draft", f"draft_model={assets['draft_lm']}", "--limit", "1", "--max-tokens", "6",
                             "--batch", "2", "--threads", "1"),
        "bench_forward": Script("scripts/bench_forward.py", "--model", target, "--context", "20", "--tokens", "1,3",
                                "--dtypes", "float32,auto", "--repeats", "2", "--warmup", "1"),
        "bench_round_cost": Script("scripts/bench_round_cost.py", "--model", target, "--draft-lm",
                                   str(assets["draft_lm"]), "--eagle3", str(assets["eagle3"]), "--ks", "0,2",
                                   "--plan", "--max-tokens", "4", "--repeats", "1"),
        "gpu_throughput": Script("scripts/gpu_throughput.py", "--device", "cpu", "--layers", "1", "--tokens", "2"),
        "load_test": Script("scripts/load_test.py", "--url", server.url, "--clients", "2", "--duration", "1",
                            "--warmup", "0", "--max-tokens", "4"),
    }
    yield started, out_dir
    for script in started.values():
        if script.proc.poll() is None:
            script.proc.kill()
    server.stop()


def test_bench_decode(scripts):
    out = scripts[0]["bench_decode"].output()
    assert out.count("native_bf16=") == 1, "the platform header is printed more than once"
    assert "ours n-gram SD" in out and "ratio ours AR / transformers generate" in out
    assert "\nours n-gram SD (planned) " in out and "ratio ours n-gram SD (planned) / ours AR, median over 1" in out
    assert "!" not in out.split("configuration", 1)[1].split("ratio")[0], "a divergence that is not a near tie"


def test_bench_ssd(scripts):
    out = scripts[0]["bench_ssd"].output()
    table = out.split("bound/reach")[0].rsplit("tok/s: median", 1)[1]
    for name in ("ar", "sd_ngram", "sd_lm", "ssd_lm_geo", "sd_eagle3", "ssd_eagle3", "hf_lookup", "ar_fixed",
                 "sd_eagle3_fixed", "sd_ngram_plan"):
        assert f"\n{name} " in table, f"{name} row missing"
    assert "!" not in table, "a divergence that is not a near tie, or a token that is not its verification's argmax"
    assert "wHit" in table and "wMiss" in table
    ssd_row = next(line for line in table.splitlines() if line.startswith("ssd_lm_geo "))
    assert ssd_row.split()[-4] != "-" or ssd_row.split()[-3] != "-", "an SSD row without the verifier's waits"
    assert "/" in ssd_row.split()[-2], "an SSD row without its fast-backup misses (fastB)"
    for temp in ("0", "1"):
        assert f"planner's choice vs AR: sd_ngram_plan T={temp}: median ratio over 1 runs" in out
    assert (scripts[1] / "results.csv").is_file()


def test_eval_draft(scripts):
    out = scripts[0]["eval_draft"].output()
    assert out.count("humaneval") >= 3 and "tau" in out


def test_bench_forward(scripts):
    out = scripts[0]["bench_forward"].output()
    assert "\nfloat32 " in out and "\nauto " in out and "(x1.00)" in out


def test_bench_round_cost(scripts):
    out = scripts[0]["bench_round_cost"].output()
    rows = {tuple(line.split()[:2]) for line in out.split("drafter ", 1)[1].splitlines()[1:] if line[:1].isalpha()}
    assert {("ar", "0")} | {(d, k) for d in ("ngram", "draft_model", "eagle3") for k in ("0", "2", "plan")} <= rows


def test_gpu_throughput_on_cpu(scripts):
    assert "graphs / eager (AR)" in scripts[0]["gpu_throughput"].output()


def test_load_test(scripts):
    out = scripts[0]["load_test"].output(platform_line=False)  # the server's /health carries the platform
    assert '"errors": 0' in out


def import_bench_ssd(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_ssd", ROOT / "scripts/bench_ssd.py")
    bench_ssd = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_ssd", bench_ssd)  # (dataclasses resolve their module)
    spec.loader.exec_module(bench_ssd)
    return bench_ssd


def test_bench_ssd_writes_no_empty_plot(tmp_path, monkeypatch):
    """No SSD row, or none with 10 bonus-token ranks: no hit-rate PNG (it would be an empty frame); with ranks, one."""
    bench_ssd = import_bench_ssd(monkeypatch)
    for ranks in ({}, {"ssd_lm_geo": [0, 1, 2]}):
        bench_ssd.plot_hit_rate(ranks, tmp_path)
        assert not (tmp_path / "hit_rate_vs_fanout.png").exists()
    bench_ssd.plot_hit_rate({"ssd_lm_geo": [0] * 12 + [1] * 6 + [2] * 3 + [5]}, tmp_path)
    assert (tmp_path / "hit_rate_vs_fanout.png").stat().st_size > 0


def test_bench_ssd_adds_the_saguaro_rows_only_for_a_head_with_weights(tmp_path, monkeypatch, capsys):
    """The committed Saguaro folder holds a config and a card, not weights (untracked): its rows are not added, and
    asking for them names why (they crashed the default run at its last rows)."""
    from safetensors.torch import save_file

    from ssd_eagle.models.eagle3_formats import has_checkpoint

    bench_ssd = import_bench_ssd(monkeypatch)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    assert not has_checkpoint(head) and not has_checkpoint(tmp_path / "missing")
    monkeypatch.setattr(sys, "argv", ["bench_ssd.py", "--eagle3-saguaro", str(head), "--configs",
                                      "ar,ssd_eagle3_sag_aware", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        bench_ssd.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown ssd_eagle3_sag_aware" in err and "has none" in err
    save_file({"w": torch.zeros(1)}, str(head / "model.safetensors"))
    assert has_checkpoint(head)
