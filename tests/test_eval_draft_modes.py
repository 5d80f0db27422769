"""scripts/eval_draft.py's other modes end to end on tiny models: ``--node-table`` (SSD per-node hit tables of a
tree and a chain) and ``--step-agreement`` (the engine's EAGLE-3 chain against the TTT unroll)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_bench_smoke import ROOT, _env, assets  # noqa: F401 (the tiny target, draft LM and EAGLE-3 head)


def eval_draft(assets, *argv: str) -> str:  # noqa: F811
    proc = subprocess.run([sys.executable, "scripts/eval_draft.py", "--model", str(assets["target"]), "--draft",
                           f"eagle3={assets['eagle3']}", "--limit", "1", "--max-tokens", "6", "--threads", "1",
                           *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("k", ["3", "3,4"])
def test_node_table_runs_with_k_as_given_on_the_command_line(assets, k):  # noqa: F811
    out = eval_draft(assets, "--node-table", "--k", k)
    assert "tree (6 nodes, top-2)" in out and "chain" in out and "K=" + k in out


def test_step_agreement_reports_every_step(assets):  # noqa: F811
    out = eval_draft(assets, "--step-agreement", "--k", "3")
    line = next(l for l in out.splitlines() if "engine vs TTT step argmax" in l)
    assert "'agreement': [" in line and "'compared': [" in line
