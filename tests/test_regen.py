"""Regeneration (train/regen): prompt builders from local text, the held-out overlap check, the filters, packing,
and a tiny end-to-end regeneration with a random Llama from conftest. CPU only, seconds."""

from __future__ import annotations

import builtins
import gzip
import io
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import EOS_ID, make_byte_tokenizer, make_tiny_llama

from ssd_eagle import prompts
from ssd_eagle.engine.llm_engine import LLMEngine
from train import heldout
from train.regen import grounded, pack
from train.regen.filters import conversation_key, is_repetitive, prompt_key
from train.regen.magpie import KINDS, Steering
from train.regen.scheduler import RegenConfig, Regenerator
from train.regen.sources import plan, single_turn
from train.regen.store import WorkDir, read_jsonl

def _mtbench_question() -> str:
    return next(t for q in prompts.mtbench_questions() for t in q["turns"] if len(t.split()) > 30)


# ---------------------------------------------------------------------------------------------------------------
# held-out checks

def test_ngram_overlap_catches_13_word_runs_only():
    words = re.findall(r"\w+", _mtbench_question())
    assert heldout.find_ngram_overlap("Intro. " + " ".join(words[3:16]) + " outro.") is not None  # 13 words
    assert heldout.find_ngram_overlap("Intro. " + " ".join(words[3:15]) + " outro.") is None  # 12 words
    upper = " ".join(w.upper() for w in words[5:20])  # case and punctuation do not matter
    assert heldout.find_ngram_overlap(upper.replace(" ", " , ")) is not None
    assert heldout.check_text("Well: Prove the Pythagorean theorem.") == "mtbench/99/turn2"  # 4 words: verbatim
    assert heldout.check_text("An ordinary request about the weather in Paris.") is None
    problem = next(p for p in prompts.humaneval_problems() if p["task_id"] == "HumanEval/8")
    assert heldout.check_text("Look: " + problem["prompt"][40:400]) == "HumanEval/8"


# ---------------------------------------------------------------------------------------------------------------
# prompt builders from local text

def _fake_tree(root: Path) -> tuple[Path, Path]:
    docs, lib = root / "site", root / "lib"
    prose = ("This library parses configuration files and reports every error with its line number. "
             "It reads INI, TOML and JSON files, merges them in order and keeps comments. ")
    for name in ("alpha", "beta", "gamma"):
        (docs / name).mkdir(parents=True)
        (docs / name / "README.md").write_text(f"# {name}\n\n{prose * 3}\n\n{prose * 4}\n")
    (docs / "pkg-1.0.dist-info").mkdir()
    (docs / "pkg-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\nSummary: A package\nLicense: MIT\n\n" + prose * 4)
    secret = "SECRET HELD OUT TEXT " * 30
    for bad in ("human_eval", "mtbench_evaluator", "data"):
        (docs / bad).mkdir()
        (docs / bad / "README.md").write_text(secret + "\n\n" + secret)
    lib.mkdir()
    (lib / "tools.py").write_text('"""' + prose * 3 + '"""\n\n\n' + "".join(
        f'def f{i}(x, y={i}):\n    """Return x plus {i} times y."""\n    z = x + {i} * y\n    w = z * 2\n'
        f'    return w // 2\n\n\n' for i in range(4)))
    return docs, lib


def test_grounded_builders_are_deterministic_and_skip_excluded(tmp_path):
    docs, lib = _fake_tree(tmp_path)
    build = lambda seed: grounded.grounded_conversations(100, seed, roots=[docs, lib],  # noqa: E731
                                                         excluded=[docs / "data"], stdlib=lib)
    first, again, other = build(0), build(0), build(1)
    assert [(c.id, c.source, c.messages) for c in first] == [(c.id, c.source, c.messages) for c in again]
    assert [c.messages for c in first] != [c.messages for c in other]
    texts = [c.messages[0]["content"] for c in first]
    assert first and not any("SECRET" in t for t in texts)
    sources = {c.source for c in first}
    assert sources <= {f"grounded-{t}" for t in ("summarise", "explain", "extract", "rewrite", "continue")}
    assert len(sources) >= 4
    assert any("def f" in t for t in texts) and any("Name: pkg" in t for t in texts)
    assert len({c.id for c in first}) == len(first)


def test_grounded_builders_do_not_depend_on_where_the_files_lie(tmp_path):
    """The same files in another folder give the same conversations (keys are relative to their root: with absolute
    ones, pytest's numbered tmp folder changed the tasks drawn and once left 3 of the 5 above)."""
    built = []
    for where in ("a", "b/c"):
        docs, lib = _fake_tree(tmp_path / where)
        built.append([(c.id, c.source, c.messages) for c in grounded.grounded_conversations(
            100, 0, roots=[docs, lib], excluded=[docs / "data"], stdlib=lib)])
    assert built[0] == built[1]


def test_grounded_builders_never_read_heldout_text(monkeypatch):
    opened: list[str] = []
    real_open = io.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def refuse(*_a, **_k):
        raise AssertionError("a prompt builder read the held-out prompts")

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    for name in ("mtbench_questions", "humaneval_problems", "heldout_prompts"):
        monkeypatch.setattr(prompts, name, refuse)
    monkeypatch.setattr(heldout, "heldout_texts", refuse)
    repo_data = Path(__file__).resolve().parent.parent / "data"
    convs = grounded.grounded_conversations(300, 0, excluded=[repo_data])
    assert len(convs) == 300 and opened
    bad = [p for p in opened if grounded.EXCLUDED_NAMES.search(p) or Path(p).resolve().is_relative_to(repo_data)]
    assert not bad, bad[:5]
    monkeypatch.undo()
    assert sum(heldout.check_text(c.messages[0]["content"]) is not None for c in convs) <= 3


def test_steering_covers_mtbench_kinds_without_its_text():
    assert set(KINDS) == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    steer = [Steering.for_candidate(0, k) for k in range(16)]
    assert [s.kind for s in steer[:8]] == list(KINDS) and steer == [Steering.for_candidate(0, k) for k in range(16)]
    for system, openers in KINDS.values():
        assert heldout.check_text(system) is None and all(heldout.check_text(o) is None for o in openers)


def test_plan_is_a_pure_function_of_seed_and_id():
    plans = [plan(0, f"c{i}", greedy_fraction=0.5, temperature=0.7, multi_turn_fraction=0.3, max_followups=2)
             for i in range(400)]
    assert plans == [plan(0, f"c{i}", greedy_fraction=0.5, temperature=0.7, multi_turn_fraction=0.3,
                          max_followups=2) for i in range(400)]
    greedy = sum(p.temperature == 0.0 for p in plans) / len(plans)
    multi = sum(p.followups > 0 for p in plans) / len(plans)
    assert 0.4 < greedy < 0.6 and 0.2 < multi < 0.4 and max(p.followups for p in plans) == 2


# ---------------------------------------------------------------------------------------------------------------
# filters and packing

def test_repetition_filter():
    prose = ("The function reads the file line by line, strips comments, splits each line at the first equals "
             "sign and stores the key and value in a dictionary, which it returns at the end. Errors name the "
             "line. ") * 1
    assert not is_repetitive(prose + "Short answer.")
    assert is_repetitive(prose + "I am here to help. " * 30)
    assert is_repetitive("\n".join(["- Use the same line again here"] * 5))
    assert not is_repetitive("ok " * 10)  # too short to judge
    assert prompt_key("  Hello   World ") == prompt_key("hello world")


def _row(i: str, turns: list[tuple[str, str]], source="grounded-explain", temperature=0.0) -> dict:
    messages = []
    for user, answer in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"id": i, "source": source, "messages": messages,
            "gen": {"temperature": temperature, "top_p": 1.0, "seed": 1, "dropped_turns": 0,
                    "finish_reasons": ["length" if a.endswith("...") else "stop" for _, a in turns],
                    "stop_reasons": [None if a.endswith("...") else 2 for _, a in turns],
                    "num_tokens": [len(a.split()) + 1 for _, a in turns]}}


def test_filter_rows_dedups_cuts_drops_and_caps_length():
    loop = "again and again " * 40
    rows = [_row("a", [("q1", "fine answer")]), _row("a", [("other", "x")]),  # same id
            _row("b", [("Q1 ", "another answer")]),  # same user turns as a
            _row("c", [("q3", "good"), ("q4", loop)]),  # cut before the loop
            _row("d", [("q5", loop)]),  # nothing left
            _row("e", [("q6", "answer: " + _mtbench_question())]),  # held-out text in a response
            _row("f", [("q7", "cut ..."), ("q8", "more")])]  # nothing is asked after a cut answer
    rows += [_row(f"L{i}", [(f"long {i}", "cut off ...")]) for i in range(6)]
    rows += [_row(f"S{i}", [(f"short {i}", "done")]) for i in range(6)]
    kept, dropped = pack.filter_rows(rows, max_length_share=0.25)
    ids = [r["id"] for r in kept]
    assert ids[:2] == ["a", "c"] and "b" not in ids and "d" not in ids and "e" not in ids
    assert kept[1]["messages"][-1]["content"] == "good" and kept[1]["gen"]["num_tokens"] == [2]
    assert kept[1]["gen"]["dropped_turns"] == 1
    turns = sum(len(r["gen"]["num_tokens"]) for r in kept)
    length = sum(r["gen"]["finish_reasons"].count("length") for r in kept)
    assert length <= 0.25 * turns and length > 0
    assert dropped["duplicate"] == 2 and dropped["repetitive_turns"] == 2 and dropped["heldout_overlap"] == 1
    assert dropped["length_cap_turns"] == 7 - length and dropped["turns_after_length"] == 1
    assert all("length" not in r["gen"]["finish_reasons"][:-1] for r in kept)
    assert len({conversation_key(r["messages"]) for r in kept}) == len(kept)


# ---------------------------------------------------------------------------------------------------------------
# tiny end-to-end regeneration

@pytest.fixture(scope="module")
def tiny_engine_parts():
    tok = make_byte_tokenizer()  # user turns end on <eos> here, so Magpie can cut a written user turn
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
                         "{% if add_generation_prompt %}<{{ 'assistant' }}>{% endif %}")
    model = make_tiny_llama(seed=1, max_positions=1024)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[EOS_ID] = 3.0  # turns end after a few tokens, some on length
    model.lm_head = head
    return model, tok


def _regen(parts, work: WorkDir, **overrides) -> Regenerator:
    model, tok = parts
    engine = LLMEngine(model, tok, max_num_seqs=4, max_model_len=1024)
    cfg = RegenConfig(**{"max_new_tokens": 24, "followup_max_tokens": 24, "magpie_max_tokens": 16,
                         "multi_turn_fraction": 0.7, "max_followups": 1, "num_magpie": 4, "magpie_share": 0.3,
                         **overrides})
    return Regenerator(engine, work, cfg, progress=False)


def test_tiny_end_to_end_regeneration_resume_and_pack(tiny_engine_parts, tmp_path):
    listed = [single_turn(f"grounded/{i}", "grounded-explain", f"Explain item number {i}, please.")
              for i in range(8)] + [single_turn("leak", "grounded-explain", _mtbench_question())]
    work = WorkDir(tmp_path / "work")
    first = _regen(tiny_engine_parts, work, target_tokens=20)
    first.add(listed)
    assert first.counts["dropped_heldout_prompt"] == 1
    first.run()
    assert first.draining and 0 < len(work.rows()) < 8 + 4
    done = {r["id"] for r in work.rows()}

    again = _regen(tiny_engine_parts, work)  # resume: the written conversations are skipped
    again.add(listed)
    again.run()
    rows = work.rows()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) and done < set(ids)
    assert {f"grounded/{i}" for i in range(8)} <= set(ids) and "leak" not in ids
    candidates = work.candidates()
    assert candidates and all(c["outcome"] in ("kept", "unfinished", "degenerate", "duplicate", "heldout")
                              for c in candidates)
    kept = [c for c in candidates if c["outcome"] == "kept"]
    assert {f"magpie/{c['kind']}/{c['candidate']}" for c in kept} <= set(ids)
    sources = {r["id"]: r["source"] for r in rows}
    assert all(sources[f"magpie/{c['kind']}/{c['candidate']}"] == f"magpie-{c['kind']}" for c in kept)
    for r in rows:
        g, roles = r["gen"], [m["role"] for m in r["messages"]]
        assert roles[-1] == "assistant" and roles.count("assistant") == len(g["num_tokens"]) >= 1
        assert all(1 <= n <= 24 for n in g["num_tokens"]) and set(g["finish_reasons"]) <= {"stop", "length"}
        assert "length" not in g["finish_reasons"][:-1]  # a cut answer ends its conversation
    assert any(len(r["gen"]["num_tokens"]) > 1 for r in rows)  # target-written follow-ups

    # the same listed conversations in a fresh folder: greedy ones come out token for token the same
    other = WorkDir(tmp_path / "other")
    fresh = _regen(tiny_engine_parts, other, num_magpie=0)
    fresh.add(listed)
    fresh.run()
    by_id = {r["id"]: r for r in rows}
    greedy = [r for r in other.rows() if r["gen"]["temperature"] == 0.0 and len(r["gen"]["num_tokens"]) == 1]
    assert greedy and all(r["messages"] == by_id[r["id"]]["messages"][:2] for r in greedy)

    manifest = pack.pack([work.root], tmp_path / "out", model="tiny", max_length_share=0.25)
    packed = [json.loads(x) for x in gzip.decompress((tmp_path / "out" / pack.GZ_NAME).read_bytes()).splitlines()]
    assert manifest["num_conversations"] == len(packed) and manifest["length_share"] <= 0.25
    assert manifest["heldout_check"]["passed"] and manifest["heldout_check"]["ngram"] == 13
    assert sum(v["conversations"] for v in manifest["per_source"].values()) == len(packed)
    first_bytes = (tmp_path / "out" / pack.GZ_NAME).read_bytes()
    pack.pack([work.root], tmp_path / "out", model="tiny")
    assert (tmp_path / "out" / pack.GZ_NAME).read_bytes() == first_bytes  # deterministic


def test_exclude_skips_an_earlier_packs_conversations_and_seeds_namespace_magpie_ids(tiny_engine_parts, tmp_path):
    listed = [single_turn(f"grounded/{i}", "grounded-explain", f"Explain item number {i}, please.") for i in range(4)]
    earlier = [{"id": "grounded/1", "source": "grounded-explain", "messages": [
        {"role": "user", "content": listed[1].messages[0]["content"]}, {"role": "assistant", "content": "x"}]},
        {"id": "magpie/writing/0", "source": "magpie-writing", "messages": [
            {"role": "user", "content": "Write a poem about rain."}, {"role": "assistant", "content": "y"}]}]
    regen = _regen(tiny_engine_parts, WorkDir(tmp_path / "work"), num_magpie=0, seed=3)
    regen.exclude(earlier)
    regen.add(listed)
    assert [c.id for c in regen.listed] == ["grounded/0", "grounded/2", "grounded/3"]
    assert prompt_key("Write a poem about rain.") in regen.filter.seen  # a Magpie candidate equal to it: duplicate
    assert regen.magpie_id("writing", 0) == "magpie/writing/s3-0" != earlier[1]["id"]
    assert _regen(tiny_engine_parts, WorkDir(tmp_path / "w0")).magpie_id("writing", 0) == "magpie/writing/0"


def test_work_dir_cuts_a_torn_line_and_refuses_other_settings(tmp_path):
    work = WorkDir(tmp_path)
    work.append_row({"id": "x"})
    with open(work.shards()[0], "a") as f:
        f.write('{"id": "tor')
    assert read_jsonl(work.shards()[0], repair=True) == [{"id": "x"}]
    work.append_row({"id": "y"})
    assert [r["id"] for r in work.rows()] == ["x", "y"]
    work.check_settings({"seed": 0})
    work.check_settings({"seed": 0})
    with pytest.raises(ValueError, match="seed"):
        work.check_settings({"seed": 1})
    with pytest.raises(ValueError, match="greedy_fraction"):
        RegenConfig(greedy_fraction=1.5)


def test_cli_flags_come_from_the_config(tmp_path):
    from train.regen import cli

    args = cli.parse_args(["--work-dir", str(tmp_path), "--greedy-fraction", "0.4", "--target-tokens", "100",
                           "--time-limit", "2.5", "--max-new-tokens", "64"])
    cfg = cli.regen_config(args, tmp_path)
    assert (cfg.greedy_fraction, cfg.target_tokens, cfg.time_limit_min, cfg.max_new_tokens) == (0.4, 100, 2.5, 64)
    assert cfg.stop_file == tmp_path / "stop" and args.dtype == "bfloat16" and args.source == ["builtin", "grounded"]
    with pytest.raises(ValueError, match="magpie_share"):
        cli.regen_config(cli.parse_args(["--work-dir", str(tmp_path), "--magpie-share", "2"]), tmp_path)


def test_packing_an_empty_work_folder_is_a_one_line_error(tmp_path, capsys):
    from train.regen import cli

    assert cli.main(["--work-dir", str(tmp_path / "empty"), "--pack", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--pack: error: nothing to pack: 0 rows read" in err and "Traceback" not in err
    assert not (tmp_path / "out" / pack.GZ_NAME).exists()


def test_a_looping_turn_is_aborted_at_a_check_not_generated_to_its_cap(tiny_engine_parts, tmp_path, monkeypatch):
    from train.regen import scheduler

    # every text of 40 characters or more counts as a loop: each turn is caught at its first check past that
    monkeypatch.setattr(scheduler, "is_repetitive", lambda text: len(text) >= 40)
    bias = tiny_engine_parts[0].lm_head.bias.data
    saved = bias.clone()
    bias[EOS_ID] = -30.0  # no turn ends on its own before its cap (the module's model is restored after)
    try:
        regen = _regen(tiny_engine_parts, WorkDir(tmp_path / "work"), max_new_tokens=400, num_magpie=0,
                       multi_turn_fraction=0.0)
        regen.add([single_turn(f"grounded/{i}", "grounded-explain", f"Explain item {i}.") for i in range(6)])
        regen.run()
    finally:
        bias.copy_(saved)
    assert regen.counts["aborted_repetitive"] == regen.counts["ended_repetitive"] == 6
    assert regen.counts["dropped_no_turn"] == 6 and not regen.work.rows()
    # caught at a multiple of REPETITION_CHECK_TOKENS, far below the cap of 400 tokens
    assert regen.counts["tokens_generated"] <= 6 * 2 * scheduler.REPETITION_CHECK_TOKENS
    assert not regen.engine.requests and not regen.engine.running  # aborted requests left the engine


def test_a_packed_row_with_unicode_line_separators_reads_back_whole(tmp_path):
    """A response of the 10th regeneration round held an unescaped U+2028 (``ensure_ascii=False``): reading the pack
    with ``str.splitlines`` cut that row in two (JSONDecodeError in ``--merge``)."""
    rows = [{"id": "a", "messages": [{"role": "assistant", "content": "one\u2028two\x85three\u2029"}]}, {"id": "b"}]
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()))
    assert pack.read_rows_file(path) == rows
