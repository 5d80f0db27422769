"""The work folder of a regeneration run: append-only JSONL shards, candidate logs and the run log.

Layout of ``work_dir`` (outside the work tree, e.g. ``~/.cache/ssd_eagle/regen/smollm2-135m-v2``)::

    settings.json          the settings that decide the content (a resumed run must match them)
    rows-00000.jsonl ...   finished conversations, one JSON line each, appended as they finish
    candidates.jsonl       one line per Magpie candidate (outcome, prompt), so a restart rebuilds the prompts
    runs.json              one record per invocation (command, times, counts), rewritten atomically

Appends are flushed line by line; a writer killed mid-line leaves a torn last line, which :func:`read_jsonl` cuts
off on resume. Whole-file writes go through :func:`write_atomic` only.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ssd_eagle.io import atomic_write

SHARD_ROWS = 2000  # conversations per rows shard


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`ssd_eagle.io.atomic_write`): readers see the old or the new
    file."""
    path = Path(path)
    with atomic_write(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a JSONL file; a torn last line (no newline, or unparsable at the very end) is ignored and, with
    ``repair``, cut off the file so that appends continue on a line boundary.

    Raises:
        ValueError: a line before the last one is not JSON.
    """
    if not path.exists():
        return []
    raw = path.read_bytes()
    rows, good_end = [], 0
    lines = raw.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.endswith(b"\n"):
            break
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        good_end += len(line)
    if repair and good_end != len(raw):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def git_commit(repo: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class WorkDir:
    """Reads and appends the files of a work folder (module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.candidates_path = self.root / "candidates.jsonl"
        self.runs_path = self.root / "runs.json"
        self._shard: Path | None = None
        self._shard_rows = 0

    # settings
    def check_settings(self, settings: dict) -> None:
        """Record ``settings`` on the first run; refuse a resumed run whose settings differ.

        Raises:
            ValueError: naming the keys that differ.
        """
        path = self.root / "settings.json"
        if not path.exists():
            write_atomic(path, json.dumps(settings, indent=1, sort_keys=True))
            return
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise ValueError(f"{self.root} was made with other settings ({', '.join(diff)}: "
                             f"{ {k: old.get(k) for k in diff} }); use another work folder or the original settings")

    # rows
    def shards(self) -> list[Path]:
        return sorted(self.root.glob("rows-*.jsonl"))

    def rows(self, repair: bool = False) -> list[dict]:
        return [r for s in self.shards() for r in read_jsonl(s, repair=repair)]

    def append_row(self, row: dict) -> None:
        if self._shard is None or self._shard_rows >= SHARD_ROWS:
            shards = self.shards()
            last = shards[-1] if shards else None
            n = len(read_jsonl(last)) if last is not None else SHARD_ROWS
            if last is not None and n < SHARD_ROWS:
                self._shard, self._shard_rows = last, n
            else:
                self._shard, self._shard_rows = self.root / f"rows-{len(shards):05d}.jsonl", 0
        with open(self._shard, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._shard_rows += 1

    # candidates
    def candidates(self, repair: bool = False) -> list[dict]:
        return read_jsonl(self.candidates_path, repair=repair)

    def append_candidate(self, line: dict) -> None:
        with open(self.candidates_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


class RunLog:
    """``runs.json``: one record per invocation, rewritten atomically at most once a minute and at exit."""

    def __init__(self, work: WorkDir, args: dict, repo: Path):
        self.path = work.runs_path
        self.runs = json.loads(self.path.read_text()) if self.path.exists() else []
        now = time.time()
        self.record = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "args": args,
                       "git_commit": git_commit(repo), "started": now, "updated": now, "status": "running",
                       "conversations_written": 0, "assistant_tokens_written": 0, "tokens_generated": 0}
        self.runs.append(self.record)
        self._last = 0.0
        self.update(force=True)

    def update(self, force: bool = False, **fields) -> None:
        self.record.update(fields)
        now = time.time()
        if force or now - self._last >= 60:
            self._last = self.record["updated"] = now
            write_atomic(self.path, json.dumps(self.runs, indent=1))
