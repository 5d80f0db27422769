"""scripts/train_default_drafts.sh exports into OUT_DIR (default runs/default-drafts), never into the committed
drafts/ folders, and says how to promote a draft. Run with ``python`` and ``deepspeed`` replaced by stubs that only
record their arguments (the real trainings take hours)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_default_drafts.sh"


def _run(tmp_path: Path, cwd: Path | None = None, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    log.write_text("")
    for tool in ("python", "deepspeed"):
        stub = bin_dir / tool
        stub.write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >> "{log}"\n')
        stub.chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), "--max_steps", "2"], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env})
    return proc, [line.split() for line in log.read_text().splitlines()]


def test_drafts_are_exported_outside_drafts_and_the_promotion_is_explained(tmp_path):
    out = tmp_path / "out"
    proc, calls = _run(tmp_path, OUT_DIR=str(out))
    assert proc.returncode == 0, proc.stderr
    exports = [c for c in calls if c[:3] == ["python", "-m", "train.export"]]
    assert [c[4] for c in exports] == [str(out / n) for n in ("smollm2-135m-eagle3", "smollm2-135m-draftlm",
                                                              "smollm2-135m-eagle3-saguaro")]
    estimates = [c for c in calls if c[:4] == ["python", "-m", "train.heldout", "estimate"]]
    assert [c[c.index("--draft") + 1] for c in estimates] == [c[4] for c in exports]
    assert not any("drafts/" in arg for c in calls for arg in c if not arg.startswith(str(tmp_path)))
    trainings = [c for c in calls if c[0] == "deepspeed" and "train/train_draft.py" in c]
    assert len(trainings) == 3 and all(c[-2:] == ["--max_steps", "2"] for c in trainings)
    assert f"cp -r {out}/<name> drafts/" in proc.stdout


def test_the_default_out_dir_is_under_runs_and_drafts_is_refused(tmp_path):
    proc, calls = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {c[4] for c in calls if c[:3] == ["python", "-m", "train.export"]} == {
        f"runs/default-drafts/{n}" for n in ("smollm2-135m-eagle3", "smollm2-135m-draftlm",
                                             "smollm2-135m-eagle3-saguaro")}
    for inside in ("drafts", "drafts/new", str(REPO / "drafts")):
        proc, calls = _run(tmp_path, OUT_DIR=inside)
        assert proc.returncode == 1 and "inside drafts/" in proc.stderr and calls == []


def test_a_relative_out_dir_is_the_callers_not_the_repositorys(tmp_path):
    """The script works from the repository root, but a relative OUT_DIR names a folder of the caller's directory
    (as every path argument of a command does); a relative path to drafts/ from there is refused too."""
    caller = tmp_path / "elsewhere"
    caller.mkdir()
    proc, calls = _run(tmp_path, cwd=caller, OUT_DIR="mine")
    assert proc.returncode == 0, proc.stderr
    assert [c[4] for c in calls if c[:3] == ["python", "-m", "train.export"]] == [
        str(caller / "mine" / n) for n in ("smollm2-135m-eagle3", "smollm2-135m-draftlm", "smollm2-135m-eagle3-saguaro")]
    assert not (REPO / "mine").exists()
    proc, calls = _run(tmp_path, cwd=caller, OUT_DIR=os.path.relpath(REPO / "drafts" / "new", caller))
    assert proc.returncode == 1 and "inside drafts/" in proc.stderr and calls == []
