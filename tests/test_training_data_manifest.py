"""The committed regenerated training data (``data/smollm2-135m``) agrees with its manifest and holds no held-out
evaluation prompt.

The data is packed by ``scripts/regenerate_data.py --pack`` (:mod:`train.regen.pack`): ``regenerated.jsonl.gz``
(rows ``{id, source, messages, gen}``) and ``manifest.json`` (sha256, counts per source, greedy share, share of turns
ending on ``length``, filters, held-out guard). CPU only, a few seconds.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
from pathlib import Path

import pytest
from helpers import real_model_or_skip

from ssd_eagle import prompts
from train import heldout
from train.regen.filters import conversation_key, is_repetitive

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "smollm2-135m"
MANIFEST = DATA_DIR / "manifest.json"
GZ = DATA_DIR / "regenerated.jsonl.gz"
MAX_BYTES = 30 * 1024 * 1024


@pytest.fixture(scope="module")
def manifest() -> dict:
    assert MANIFEST.is_file(), f"{MANIFEST} is missing (written by scripts/regenerate_data.py)"
    return json.loads(MANIFEST.read_text())


@pytest.fixture(scope="module")
def gz_bytes() -> bytes:
    assert GZ.is_file(), f"{GZ} is missing (written by scripts/regenerate_data.py)"
    return GZ.read_bytes()


@pytest.fixture(scope="module")
def rows(gz_bytes) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(gz_bytes).split(b"\n") if line.strip()]  # (not splitlines:
    # a response holds an unescaped U+2028)


def test_file_matches_manifest_hash_and_size(manifest, gz_bytes):
    assert manifest["file"]["sha256"] == hashlib.sha256(gz_bytes).hexdigest()
    assert manifest["file"]["bytes"] == len(gz_bytes)
    assert len(gz_bytes) < MAX_BYTES
    assert (DATA_DIR.parent.parent / manifest["file"]["path"]).resolve() == GZ.resolve()
    assert manifest["file"]["uncompressed_bytes"] == len(gzip.decompress(gz_bytes))


def test_rows_are_well_formed(rows):
    assert rows
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids), "duplicate conversation ids"
    for r in rows:
        assert set(r) == {"id", "source", "messages", "gen"}, r["id"]
        msgs, gen = r["messages"], r["gen"]
        roles = [m["role"] for m in msgs]
        assert set(roles) <= {"system", "user", "assistant"}, r["id"]
        assert all(isinstance(m["content"], str) for m in msgs), r["id"]
        assert roles[-1] == "assistant", r["id"]
        n = roles.count("assistant")
        assert n == len(gen["num_tokens"]) == len(gen["finish_reasons"]) == len(gen["stop_reasons"]) >= 1, r["id"]
        assert all(a != b or a != "assistant" for a, b in zip(roles, roles[1:])), r["id"]
        assert all(isinstance(t, int) and t >= 1 for t in gen["num_tokens"]), r["id"]
        assert set(gen["finish_reasons"]) <= {"stop", "length"}, r["id"]
        assert gen["temperature"] >= 0.0


def test_counts_match_file(manifest, rows):
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    finish, temps, greedy = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        c = per_source[r["source"]]
        c["conversations"] += 1
        c["assistant_turns"] += len(r["gen"]["num_tokens"])
        c["assistant_tokens"] += sum(r["gen"]["num_tokens"])
        finish.update(r["gen"]["finish_reasons"])
        temps[str(r["gen"]["temperature"])] += 1
        if r["gen"]["temperature"] == 0.0:
            greedy["conversations"] += 1
            greedy["assistant_tokens"] += sum(r["gen"]["num_tokens"])
    turns = sum(c["assistant_turns"] for c in per_source.values())
    tokens = sum(c["assistant_tokens"] for c in per_source.values())
    assert manifest["num_conversations"] == len(rows)
    assert manifest["num_assistant_turns"] == turns
    assert manifest["assistant_tokens"] == tokens
    assert manifest["per_source"] == {k: dict(v) for k, v in per_source.items()}
    assert manifest["finish_reasons"] == dict(finish)
    assert manifest["conversations_by_temperature"] == dict(temps)
    assert manifest["length_share"] == round(finish["length"] / turns, 4) <= 0.25
    assert manifest["greedy_share"] == {"conversations": round(greedy["conversations"] / len(rows), 4),
                                        "assistant_tokens": round(greedy["assistant_tokens"] / tokens, 4)}
    # enough T = 0 data for greedy serving: train.regen generates half of its conversations greedily; the float32
    # set merged in (format 1) had a quarter, less after its greedy loops were filtered out
    assert manifest["greedy_share"]["conversations"] >= 0.2


def test_sources_cover_the_new_prompt_kinds(manifest, rows):
    sources = set(manifest["per_source"])
    grounded = {s for s in sources if s.startswith("grounded-")}
    steered = {s for s in sources if s.startswith("magpie-")}
    assert grounded and grounded <= {f"grounded-{t}" for t in ("summarise", "explain", "extract", "rewrite",
                                                               "continue")}
    assert steered and steered <= {f"magpie-{k}" for k in ("writing", "roleplay", "reasoning", "math", "coding",
                                                           "extraction", "stem", "humanities")}
    patterns = [k.split("<")[0] for k in manifest["sources"] if k.endswith(">")]  # "grounded-<task>" -> "grounded-"
    assert all(s in manifest["sources"] or any(s.startswith(p) for p in patterns) for s in sources), sources
    assert manifest["multi_turn_conversations"] == sum(len(r["gen"]["num_tokens"]) > 1 for r in rows) > 0


def test_rows_are_deduplicated_and_loop_free(rows):
    keys = [conversation_key(r["messages"]) for r in rows]
    assert len(set(keys)) == len(keys), "two conversations with the same user turns"
    loops = [r["id"] for r in rows for m in r["messages"] if m["role"] == "assistant" and is_repetitive(m["content"])]
    assert not loops, loops[:5]
    for r in rows:  # a cut answer ends its conversation
        assert "length" not in r["gen"]["finish_reasons"][:-1], r["id"]


def test_no_heldout_prompt_in_training_data(manifest, rows):
    with real_model_or_skip():  # the prompt packages may be missing
        held = heldout.heldout_texts()
    assert len(held) == 2 * len(prompts.mtbench_questions()) + sum(
        prompts.is_heldout_humaneval(p["task_id"]) for p in prompts.humaneval_problems())
    heldout.assert_no_heldout([r["messages"] for r in rows])
    overlaps = [(r["id"], hit) for r in rows for m in r["messages"]
                if (hit := heldout.find_ngram_overlap(m["content"])) is not None]
    assert not overlaps, overlaps[:5]  # no message shares a run of 13 words with a held-out prompt
    check = manifest["heldout_check"]
    assert check["passed"] and check["ngram"] == heldout.OVERLAP_NGRAM == 13
    assert check["num_heldout_prompts"] == len(held) and check["num_heldout_ngrams"] == len(heldout.heldout_ngrams())
    for r in rows:  # ids of the held-out split never appear either
        assert not r["id"].lower().startswith("mtbench"), r["id"]
        if r["id"].startswith("HumanEval/"):
            assert not prompts.is_heldout_humaneval(r["id"]), r["id"]
