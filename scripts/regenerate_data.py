#!/usr/bin/env python
"""Regenerate the assistant turns of training conversations with the target itself (``NOTES.md`` section 4).

The draft must learn the target's distribution, so every assistant turn is rewritten by the target: each assistant
turn is generated given the *regenerated* history (multi-turn conversations are generated turn by turn), with the
same chat template the trainer renders with (the template's default system prompt is not stored in the rows; the
trainer's rendering adds it again, exactly as generation saw it).

Inputs (``--source``, repeatable):

- ``builtin``: :func:`train.data.training_prompts` (HumanEval training problems, packaged ShareGPT user turns)
  plus ``--num-magpie`` Magpie self-instruct prompts that the target writes from its own user-turn prefix
  (:func:`train.data.magpie_prompts`).
- a JSON/JSONL file or folder (ShareGPT ``conversations``, OpenAI ``messages`` or plain ``prompt``/``text`` rows,
  via :func:`train.data.load_conversations`), optionally labelled ``NAME=PATH``. User and system messages are
  kept; every assistant message is regenerated, and a conversation ending with a user message gets an answer.

Every prompt is checked with :func:`train.data.assert_no_heldout` before anything is generated, and every finished
row again (a row whose generated text contains a held-out prompt is dropped and counted).

Generation runs through the project's engine in AR mode with continuous batching: ``--batch-size`` requests decode
together, and a slot freed by a finished turn is refilled at once (next turn of the same conversation first, then
new conversations). Magpie candidates stream through the same batch: each is filtered as soon as it finishes and,
if kept, queued for its answer at once; candidates are started only while fewer than ``--batch-size``
conversations wait, so prompts are written about as fast as they are answered.

Sampling: a fraction ``--greedy-fraction`` of the conversations is decoded greedily, the rest at
``--temperature`` with a per-conversation seed (turn k uses ``seed + k``); both are derived from ``--seed`` and the
conversation id, so a restart makes the same choices. Generations that reach ``--max-new-tokens`` are kept and
recorded with ``finish_reason == "length"``.

Output: one JSON line per finished conversation, appended as soon as it finishes::

    {"id": str, "source": str, "messages": [{"role", "content"}, ...],
     "gen": {"temperature": float, "top_p": float, "seed": int, "finish_reasons": [str, ...],
             "stop_reasons": [int | null, ...], "num_tokens": [int, ...], "dropped_turns": int}}

``num_tokens[k]`` counts the tokens generated for assistant turn k, including the token that stopped it
(``<|im_end|>``) when ``finish_reason == "stop"``. Restarting with the same arguments resumes: ids already in the
output are skipped, a torn last line is cut off, and Magpie prompts are read back from ``<output>.magpie.jsonl``
(one line per candidate). ``<output>.runs.json`` records every invocation (command line, times, tokens).

``--time-limit MINUTES``, or creating the file ``<output>.stop``, drains the run: nothing new starts (queued
Magpie requests are cancelled), the requests in flight and the conversations already started are finished and
written, and the process exits; running the same command again continues (delete the stop file first).

``--gz`` / ``--manifest`` (after a complete run, or alone with ``--finalize-only``) write a deterministic gzip of
the rows (sorted by source, then id) and a manifest with counts, settings, command lines, wall time, git commit
and the gzip's sha256.

Example::

    python scripts/regenerate_data.py --source builtin --num-magpie 2000 --batch-size 96 --num-threads 1 \\
        --output data/smollm2-135m/work/regenerated.jsonl \\
        --gz data/smollm2-135m/regenerated.jsonl.gz --manifest data/smollm2-135m/manifest.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tqdm.auto import tqdm  # noqa: E402

from train import data as tdata  # noqa: E402

FORMAT_VERSION = 1
SOURCE_ORDER = ("humaneval", "sharegpt", "magpie")


# ----------------------------------------------------------------------------------------------------------------
# Conversations to regenerate
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Conversation:
    """A conversation whose assistant turns are (re)generated.

    Attributes:
        id, source: as written to the output.
        messages: the prompt skeleton: user/system messages, and ``None`` at each position where an assistant
            turn is generated (in order).
    """

    id: str
    source: str
    messages: list[dict | None]

    @property
    def num_generations(self) -> int:
        return sum(m is None for m in self.messages)

    def prompt_texts(self) -> list[str]:
        return [m["content"] for m in self.messages if m is not None]


def skeleton(messages: list[dict]) -> list[dict | None]:
    """User/system messages kept, each assistant message replaced by a generation point (``None``); a trailing
    user message gets one; assistant messages before the first user message are dropped (nothing prompts them)."""
    out: list[dict | None] = []
    seen_user = False
    for m in messages:
        if m["role"] == "assistant":
            if seen_user and (not out or out[-1] is not None):  # consecutive assistant messages: one generation
                out.append(None)
            continue
        seen_user = seen_user or m["role"] == "user"
        out.append({"role": m["role"], "content": m["content"]})
    if out and out[-1] is not None and out[-1]["role"] == "user":
        out.append(None)
    return out


def builtin_conversations() -> list[Conversation]:
    out = []
    for p in tdata.training_prompts():
        msgs: list[dict | None] = []
        for turn in p["turns"]:
            msgs += [{"role": "user", "content": turn}, None]
        out.append(Conversation(p["id"], p["source"], msgs))
    return out


def file_conversations(spec: str, field_name: str | None, split: str) -> list[Conversation]:
    label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    label = label or Path(path.rstrip("/")).stem or "file"
    out = []
    for conv in tdata.load_conversations(path, split=split, field=field_name):
        sk = skeleton(conv["messages"])
        if any(m is None for m in sk):
            out.append(Conversation(f"{label}/{conv['id']}", label, sk))
    return out


def magpie_conversation(index: int, prompt: str, prefix: str = "magpie/") -> Conversation:
    return Conversation(f"{prefix}{index}", "magpie", [{"role": "user", "content": prompt}, None])


def sampling_choice(seed: int, conv_id: str, greedy_fraction: float, temperature: float) -> tuple[float, int]:
    """(temperature, seed) of a conversation, a pure function of the run seed and the id."""
    rng = random.Random(f"{seed}:{conv_id}")
    greedy = rng.random() < greedy_fraction
    return (0.0 if greedy else float(temperature)), rng.randrange(2**31)


# ----------------------------------------------------------------------------------------------------------------
# Output file helpers
# ----------------------------------------------------------------------------------------------------------------

def read_rows(path: Path, repair: bool = False) -> list[dict]:
    """Rows of a JSONL output; with ``repair``, a torn last line (a killed writer) is cut off the file."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    rows, good_end, pos = [], 0, 0
    for line in raw.splitlines(keepends=True):
        pos += len(line)
        if not line.endswith(b"\n"):
            break
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if pos == len(raw):  # a torn final line that happens to end in a newline byte
                    break
                raise
        good_end = pos
    if good_end != len(raw):
        if not repair:
            raise ValueError(f"{path}: the last line is incomplete (bytes {good_end}..{len(raw)})")
        print(f"[regenerate] cutting a torn last line off {path} ({len(raw) - good_end} bytes)", flush=True)
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


class RunLog:
    """``<output>.runs.json``: one record per invocation, rewritten atomically every minute and at exit."""

    def __init__(self, path: Path, args: argparse.Namespace):
        self.path = path
        self.runs = json.loads(path.read_text()) if path.exists() else []
        self.record = {"command": shlex.join([sys.executable.rsplit('/', 1)[-1], *sys.argv]),
                       "args": {k: v for k, v in vars(args).items()}, "git_commit": git_commit(),
                       "started": time.time(), "updated": time.time(), "status": "running",
                       "conversations_written": 0, "assistant_tokens_written": 0, "tokens_generated": 0}
        self.runs.append(self.record)
        self._last = 0.0
        self.save(force=True)

    def update(self, force: bool = False, **fields) -> None:
        self.record.update(fields)
        self.save(force)

    def save(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < 60:
            return
        self._last = now
        self.record["updated"] = now
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.runs, indent=1))
        os.replace(tmp, self.path)


# ----------------------------------------------------------------------------------------------------------------
# Continuous-batching scheduler over the engine
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class _Job:
    conv: Conversation
    temperature: float
    seed: int
    messages: list[dict] = field(default_factory=list)  # regenerated history so far
    position: int = 0  # index into conv.messages
    turn: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    stop_reasons: list[int | None] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    dropped_turns: int = 0


class MagpieStream:
    """Magpie prompts written one candidate at a time, each filtered as soon as it finishes, logged to a cache.

    A candidate is the target's continuation of the bare user-turn prefix (:func:`train.data.user_turn_prefix`),
    sampled at ``temperature`` with seed ``random.Random(f"magpie:{seed}:{k}")`` for candidate k. Each finished
    candidate goes through :func:`train.data.magpie_prompts` (one row, one round), i.e. exactly the library's cut
    at the end-of-turn token, degenerate / duplicate / held-out filters; a kept prompt becomes conversation
    ``id_prefix + index`` at once. The cache (``<output>.magpie.jsonl``) has one line per candidate (plus, from
    older runs, whole chunks of prompts); a restart rebuilds the kept prompts, their order and the counters from it.
    """

    OUTCOMES = ("unfinished", "degenerate", "duplicate", "heldout")

    def __init__(self, tokenizer, args: argparse.Namespace, cache_path: Path, exclude: list[str]):
        self.tok, self.args, self.cache_path = tokenizer, args, cache_path
        self.target = args.num_magpie
        self.settings = magpie_settings(args)
        prefix, _ = tdata.user_turn_prefix(tokenizer)
        self.prefix_ids = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        self.kept: list[str] = []
        self.stats = collections.Counter()
        self.next_candidate = 0
        self._load()
        self.seen = list(exclude) + list(self.kept)
        self.in_flight = 0

    def _load(self) -> None:
        cache = read_magpie_cache(self.cache_path)
        for settings in cache["settings"]:
            mine = {k: self.settings[k] for k in MAGPIE_KEYS}
            theirs = {k: settings.get(k) for k in MAGPIE_KEYS}
            if mine != theirs:
                raise SystemExit(f"{self.cache_path} was made with Magpie settings {theirs}, not {mine}; "
                                 "use another --output or the original settings")
        self.kept, self.stats, self.next_candidate = cache["kept"], cache["stats"], cache["next_candidate"]
        if not self.cache_path.exists():
            with open(self.cache_path, "a") as f:
                f.write(json.dumps({"settings": self.settings}) + "\n")

    @property
    def needed(self) -> bool:
        return len(self.kept) + self.in_flight < self.target

    def new_request(self) -> tuple[list[int], int, int]:
        k = self.next_candidate
        self.next_candidate += 1
        self.in_flight += 1
        seed = random.Random(f"magpie:{self.args.seed}:{k}").randrange(2**62)
        return list(self.prefix_ids), k, seed

    def finished(self, k: int, seed: int, token_ids: list[int]) -> str | None:
        """Filter candidate ``k``; log it; return the kept prompt or None."""
        self.in_flight -= 1
        result = tdata.magpie_prompts(self.tok, lambda *_: [list(token_ids)], 1,
                                      max_tokens=self.args.magpie_max_tokens,
                                      temperature=self.args.magpie_temperature, batch_size=1, max_rounds=1,
                                      exclude=self.seen, progress=False)
        prompt = result.prompts[0] if result.prompts else None
        outcome = "kept" if prompt is not None else next(
            (o for o in self.OUTCOMES if getattr(result, f"num_{o}")), "unfinished")
        self.stats["candidates"] += 1
        self.stats[outcome] += 1  # "kept" included
        with open(self.cache_path, "a") as f:
            f.write(json.dumps({"candidate": k, "seed": seed, "outcome": outcome, "prompt": prompt},
                               ensure_ascii=False) + "\n")
        if prompt is not None:
            self.kept.append(prompt)
            self.seen.append(prompt)
        return prompt


class Regenerator:
    """Keeps the engine's ``max_num_seqs`` slots busy with conversation turns and Magpie candidates."""

    def __init__(self, llm, args: argparse.Namespace, out_file, runlog: RunLog):
        from ssd_eagle.engine.llm import render_chat
        from ssd_eagle.sampling_params import SamplingParams

        self.llm, self.engine, self.tok = llm, llm.engine, llm.tokenizer
        self.render_chat, self.SamplingParams = render_chat, SamplingParams
        self.args, self.out, self.runlog = args, out_file, runlog
        self.capacity = llm.engine.max_num_seqs
        self.max_model_len = llm.engine.max_model_len
        specials = set(self.tok.all_special_ids)
        specials.update(i for i, t in getattr(self.tok, "added_tokens_decoder", {}).items()
                        if getattr(t, "special", False))
        self.stop_ids = sorted(specials)  # a special token (e.g. a new <|im_start|>) ends the turn too
        self.pending: collections.deque[_Job] = collections.deque()
        self.in_flight: dict[str, _Job | tuple[int, int]] = {}  # a job, or (candidate, seed) of a Magpie request
        self.magpie: MagpieStream | None = None
        self.done_ids: set[str] = set()
        self._rid = 0
        self.counts = collections.Counter()
        self.start = time.time()
        self.bar: tqdm | None = None
        self._last_log = time.time()
        self.draining = False
        self.stop_file = Path(args.output + ".stop")
        self._keep_running_sorted_by_slot()

    def _keep_running_sorted_by_slot(self) -> None:
        """Run the batch in ascending slot order.

        The engine batches ``running`` in admission order; once slots are recycled that order is not the slot
        order, and the KV cache then *gathers* every attended key/value of every row in every layer on each step
        (``KVCache.update``: ``k_store[slots, :, :kv_len]``), which cost ~60% of the run time at batch 96. With the
        rows in ascending slot order and the slots ``0..n-1`` all busy (the scheduler keeps them busy, and freed
        slots are handed out lowest first), the batch is a slot range and the cache returns views. Each row keeps
        its own generator, so outputs do not depend on the order.
        """
        engine = self.engine
        admit = engine._admit

        def admit_sorted():
            admitted = admit()
            engine.running.sort(key=lambda s: s.slot)
            return admitted

        engine._admit = admit_sorted

    # queue
    def add(self, convs: Iterable[Conversation]) -> int:
        n = 0
        for conv in convs:
            temperature, seed = sampling_choice(self.args.seed, conv.id, self.args.greedy_fraction,
                                                self.args.temperature)
            self.pending.append(_Job(conv, temperature, seed))
            n += 1
        if self.bar is not None:
            self.bar.total = (self.bar.total or 0) + n
            self.bar.refresh()
        return n

    def _new_rid(self, kind: str) -> str:
        self._rid += 1
        return f"{kind}-{self._rid}"

    def _submit_turn(self, job: _Job) -> bool:
        """Submit the next generation of ``job``; False when the job is finished (written or dropped)."""
        conv = job.conv
        while job.position < len(conv.messages) and conv.messages[job.position] is not None:
            job.messages.append(conv.messages[job.position])
            job.position += 1
        if job.position >= len(conv.messages):
            self._finish(job)
            return False
        prompt = self.render_chat(self.tok, job.messages)
        if len(prompt) + self.args.max_new_tokens > self.max_model_len:
            remaining = sum(m is None for m in conv.messages[job.position:])
            if job.turn == 0:
                self.counts["dropped_too_long"] += 1
                self._advance_bar()
                return False
            # keep what was generated: cut the conversation after the last generated turn
            while job.messages and job.messages[-1]["role"] != "assistant":
                job.messages.pop()
            job.dropped_turns += remaining
            job.position = len(conv.messages)
            self._finish(job)
            return False
        params = self.SamplingParams(max_tokens=self.args.max_new_tokens, temperature=job.temperature,
                                     top_p=self.args.top_p, seed=job.seed + job.turn, stop_token_ids=self.stop_ids,
                                     skip_special_tokens=True)
        rid = self._new_rid("turn")
        self.engine.add_request(rid, prompt, params)
        self.in_flight[rid] = job
        return True

    def _check_stop(self) -> None:
        if self.draining:
            return
        over_time = self.args.time_limit is not None and time.time() - self.start > 60 * self.args.time_limit
        if over_time or self.stop_file.exists():
            self.draining = True
            print(f"[regenerate] {'time limit reached' if over_time else f'{self.stop_file} found'}: draining "
                  f"(finishing the {len(self.in_flight)} requests in flight and the started conversations)",
                  flush=True)

    def _next_kind(self) -> str | None:
        """What the next free slot gets: a started conversation's next turn first; then a Magpie candidate while
        fewer than ``capacity`` conversations wait (so answers never run dry); then a new conversation."""
        if self.pending and self.pending[0].turn > 0:  # started conversations sit at the front
            return "turn"
        if self.draining:
            return None
        need_magpie = self.magpie is not None and self.magpie.needed
        if need_magpie and len(self.pending) < self.capacity:
            return "magpie"
        if self.pending:
            return "turn"
        return "magpie" if need_magpie else None

    def _submittable(self) -> bool:
        return self._next_kind() is not None

    def _top_up(self) -> None:
        while len(self.in_flight) < self.capacity:
            kind = self._next_kind()
            if kind is None:
                break
            if kind == "magpie":
                prefix, k, seed = self.magpie.new_request()
                params = self.SamplingParams(max_tokens=self.args.magpie_max_tokens,
                                             temperature=self.args.magpie_temperature, seed=seed,
                                             skip_special_tokens=False)
                rid = self._new_rid("magpie")
                self.engine.add_request(rid, prefix, params)
                self.in_flight[rid] = (k, seed)
            else:
                self._submit_turn(self.pending.popleft())

    def step(self) -> None:
        self._check_stop()
        self._top_up()
        if not self.in_flight:
            return
        for out in self.engine.step():
            if not out.finished:
                continue
            job = self.in_flight.pop(out.request_id)
            self.counts["tokens_generated"] += len(out.token_ids)
            if isinstance(job, tuple):  # a Magpie candidate
                prompt = self.magpie.finished(*job, list(out.token_ids))
                if prompt is not None:
                    conv = magpie_conversation(len(self.magpie.kept) - 1, prompt, self.args.magpie_id_prefix)
                    tdata.assert_no_heldout([conv.prompt_texts()])
                    if conv.id not in self.done_ids:
                        self.add([conv])
                continue
            job.messages.append({"role": "assistant", "content": out.text})
            job.finish_reasons.append(out.finish_reason)
            job.stop_reasons.append(out.outputs[0].stop_reason if out.finish_reason == "stop" else None)
            job.num_tokens.append(len(out.token_ids))
            job.position += 1
            job.turn += 1
            if job.position < len(job.conv.messages):
                self.pending.appendleft(job)  # finish started conversations first
            else:
                self._finish(job)
        self._log()

    def run(self) -> None:
        while self.in_flight or self._submittable():
            self.step()

    # results
    def _finish(self, job: _Job) -> None:
        row = {"id": job.conv.id, "source": job.conv.source, "messages": job.messages,
               "gen": {"temperature": job.temperature, "top_p": self.args.top_p, "seed": job.seed,
                       "finish_reasons": job.finish_reasons, "stop_reasons": job.stop_reasons,
                       "num_tokens": job.num_tokens, "dropped_turns": job.dropped_turns}}
        if not job.num_tokens:
            self.counts["dropped_too_long"] += 1
        elif tdata.find_heldout([row["messages"]]):
            self.counts["dropped_heldout_in_output"] += 1
        else:
            self.out.write(json.dumps(row, ensure_ascii=False) + "\n")
            self.out.flush()
            self.counts["conversations_written"] += 1
            self.counts["assistant_tokens_written"] += sum(job.num_tokens)
        self._advance_bar()

    def _advance_bar(self) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.counts['tokens_generated'] / max(time.time() - self.start, 1e-9):.1f}",
                                 asst_tok=self.counts["assistant_tokens_written"], refresh=False)
        self.runlog.update(conversations_written=self.counts["conversations_written"],
                           assistant_tokens_written=self.counts["assistant_tokens_written"],
                           tokens_generated=self.counts["tokens_generated"])

    def _log(self) -> None:
        now = time.time()
        if now - self._last_log < self.args.log_every:
            return
        self._last_log = now
        self.runlog.update(tokens_generated=self.counts["tokens_generated"])  # heartbeat (throttled to 1/min)
        el = now - self.start
        print(f"[regenerate] {time.strftime('%H:%M:%S')} elapsed {el / 60:.1f} min: "
              f"{self.counts['conversations_written']} conversations written, "
              f"{self.counts['assistant_tokens_written']} assistant tokens, "
              f"{self.counts['tokens_generated']} tokens generated ({self.counts['tokens_generated'] / el:.1f} tok/s), "
              f"in flight {len(self.in_flight)}, pending {len(self.pending)}"
              + (f", magpie kept {len(self.magpie.kept)}/{self.magpie.target} of {self.magpie.stats['candidates']} "
                 f"candidates ({self.magpie.in_flight} in flight)" if self.magpie is not None else ""), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Magpie settings and cache lines
# ----------------------------------------------------------------------------------------------------------------

MAGPIE_KEYS = ("temperature", "max_tokens", "seed")  # what decides the candidates (batching does not)


def magpie_settings(args: argparse.Namespace) -> dict:
    return {"temperature": args.magpie_temperature, "max_tokens": args.magpie_max_tokens, "seed": args.seed}


def read_magpie_cache(path: Path) -> dict:
    """Kept prompts (in order), counters (candidates, kept, unfinished, degenerate, duplicate, heldout), the next
    candidate index, and every settings record of a Magpie cache (candidate lines, or an older run's chunks)."""
    kept, stats, next_candidate, settings = [], collections.Counter(), 0, []
    for line in read_jsonl_lines(path):
        if line.get("settings") is not None:
            settings.append(line["settings"])
        if "chunk" in line:  # an older run's whole chunk
            kept += line["prompts"]
            stats["candidates"] += line["stats"]["num_generated"]
            for k in MagpieStream.OUTCOMES:
                stats[k] += line["stats"][f"num_{k}"]
        elif "candidate" in line:
            stats["candidates"] += 1
            if line["prompt"] is not None:
                kept.append(line["prompt"])
            else:
                stats[line["outcome"]] += 1
            next_candidate = max(next_candidate, line["candidate"] + 1)
    stats["kept"] = len(kept)
    return {"kept": kept, "stats": stats, "next_candidate": next_candidate, "settings": settings}


def read_jsonl_lines(path: Path) -> list[dict]:
    """JSON lines of a file that may end with a torn line (ignored)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    return out


# ----------------------------------------------------------------------------------------------------------------
# Finalisation: gzip + manifest
# ----------------------------------------------------------------------------------------------------------------

def _natural_key(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def row_sort_key(row: dict) -> tuple:
    src = row["source"]
    rank = SOURCE_ORDER.index(src) if src in SOURCE_ORDER else len(SOURCE_ORDER)
    return rank, src, _natural_key(row["id"])


def summarize(rows: list[dict]) -> dict:
    """Counts the manifest states (the test recomputes them from the committed file)."""
    per_source: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    finish = collections.Counter()
    by_temperature = collections.Counter()
    for row in rows:
        g = row["gen"]
        c = per_source[row["source"]]
        c["conversations"] += 1
        c["assistant_turns"] += len(g["num_tokens"])
        c["assistant_tokens"] += sum(g["num_tokens"])
        finish.update(g["finish_reasons"])
        by_temperature[str(g["temperature"])] += 1
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
        "conversations_by_temperature": dict(sorted(by_temperature.items())),
    }


def _interval_union(intervals: list[tuple[float, float]]) -> float:
    total, cur_lo, cur_hi = 0.0, None, None
    for lo, hi in sorted(intervals):
        if cur_hi is None or lo > cur_hi:
            total += (cur_hi - cur_lo) if cur_hi is not None else 0.0
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    return total + ((cur_hi - cur_lo) if cur_hi is not None else 0.0)


def _read_part(jsonl: Path) -> dict:
    """One run's output with its run log and Magpie cache (settings as that run recorded them)."""
    runs_path = jsonl.with_name(jsonl.name + ".runs.json")
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else []
    cache = jsonl.with_name(jsonl.name + ".magpie.jsonl")
    magpie = read_magpie_cache(cache) if cache.exists() else None
    return {"path": jsonl, "rows": read_rows(jsonl), "runs": runs, "magpie": magpie}


def _magpie_key(row: dict) -> str | None:
    if row["source"] != "magpie":
        return None
    first_user = next(m["content"] for m in row["messages"] if m["role"] == "user")
    return " ".join(first_user.split()).lower()


def finalize(args: argparse.Namespace, jsonl: Path) -> None:
    parts = [_read_part(jsonl)] + [_read_part(Path(m)) for m in args.merge]
    rows, seen_ids, seen_magpie = [], set(), set()
    dropped = collections.Counter()
    for part in parts:
        part["rows_kept"] = 0
        for r in part["rows"]:
            key = _magpie_key(r)
            if r["id"] in seen_ids:
                dropped["duplicate_id"] += 1
                continue
            if key is not None and key in seen_magpie:
                dropped["duplicate_magpie_prompt_across_runs"] += 1
                continue
            seen_ids.add(r["id"])
            if key is not None:
                seen_magpie.add(key)
            rows.append(r)
            part["rows_kept"] += 1
    tdata.assert_no_heldout([r["messages"] for r in rows])
    rows.sort(key=row_sort_key)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    gz_path = Path(args.gz)
    gz_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as f:
        f.write(payload)
    gz_bytes = buf.getvalue()
    gz_path.write_bytes(gz_bytes)

    all_runs = [r for part in parts for r in part["runs"]]
    gen_runs = [r for r in all_runs if r.get("tokens_generated")]
    wall = _interval_union([(r["started"], r["updated"]) for r in gen_runs])
    process_time = sum(r["updated"] - r["started"] for r in gen_runs)
    tokens_generated = sum(r["tokens_generated"] for r in gen_runs)
    summary = summarize(rows)
    magpie_total = collections.Counter()

    def rel(path: Path) -> str:
        path = Path(path).resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    def describe(part: dict) -> dict:
        stats = part["magpie"]["stats"] if part["magpie"] else collections.Counter()
        magpie_total.update(stats)
        last = part["runs"][-1]["args"] if part["runs"] else {}
        answered = sum(r["source"] == "magpie" for r in part["rows"])
        return {
            "output": rel(part["path"]), "rows": len(part["rows"]), "rows_kept": part["rows_kept"],
            "settings": {k: last.get(k) for k in ("source", "num_magpie", "magpie_temperature",
                                                  "magpie_max_tokens", "magpie_id_prefix",
                                                  "max_new_tokens", "temperature", "greedy_fraction", "top_p",
                                                  "seed", "batch_size", "num_threads", "max_model_len")},
            "magpie": {**dict(stats), "answered": answered,
                       "generated_but_unanswered": stats["kept"] - answered} if part["magpie"] else None,
            "runs": [{"command": r["command"], "git_commit": r["git_commit"],
                      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["started"])),
                      "wall_time_s": round(r["updated"] - r["started"], 1),
                      "status": "killed (wall time up to its last heartbeat)" if r["status"] == "running"
                      else r["status"],
                      "tokens_generated": r["tokens_generated"],
                      "conversations_written": r["conversations_written"]} for r in part["runs"]],
        }

    described = [describe(part) for part in parts]
    from train.data import heldout_texts

    manifest = {
        "format_version": FORMAT_VERSION,
        "description": "Training conversations whose assistant turns were regenerated by the target "
                       "(scripts/regenerate_data.py). Rows: {id, source, messages, gen}; messages exclude the chat "
                       "template's default system prompt, which generation used and the trainer's rendering adds.",
        "file": {"path": rel(gz_path), "sha256": hashlib.sha256(gz_bytes).hexdigest(), "bytes": len(gz_bytes),
                 "uncompressed_bytes": len(payload), "row_order": "source (humaneval, sharegpt, magpie, others), "
                 "then id in natural order"},
        "model": args.model,
        **summary,
        "token_count_definition": "tokens generated per assistant turn, including the end-of-turn token that "
                                  "stopped the turn (finish_reason 'stop'); sum of gen.num_tokens",
        "generation": {"mode": "ar", "dtype": "float32", "max_new_tokens": args.max_new_tokens,
                       "temperature": args.temperature, "greedy_fraction": args.greedy_fraction,
                       "top_p": args.top_p, "per_conversation_choice": "greedy or sampled, and the seed, drawn from "
                       "random.Random(f'{seed}:{id}') (seed: the run's --seed, see parts)",
                       "per_turn_seed": "gen.seed + turn index",
                       "stop_token_ids": "every special token of the tokenizer",
                       "max_model_len": args.max_model_len},
        "sources": {"builtin": "train.data.training_prompts(): HumanEval problems not divisible by 4, packaged "
                               "ShareGPT user turns (deduplicated)",
                    "magpie": {**dict(magpie_total), "temperature": args.magpie_temperature,
                               "max_tokens": args.magpie_max_tokens} if magpie_total else None},
        "dropped_at_merge": dict(dropped),
        "heldout_check": {"passed": True, "num_heldout_prompts": len(heldout_texts()),
                          "rule": "all MT-Bench turns and HumanEval problems whose number is divisible by 4; "
                                  "train.data.assert_no_heldout on every message of every row"},
        "parts": described,
        "wall_time_s": round(wall, 1),
        "process_time_s": round(process_time, 1),
        "tokens_generated": tokens_generated,
        "throughput_tokens_per_s": round(tokens_generated / wall, 1) if wall else None,
        "git_commit": git_commit(),
        "finalize_command": shlex.join(["python", *sys.argv]),
    }
    mpath = Path(args.manifest)
    mpath.parent.mkdir(parents=True, exist_ok=True)
    mpath.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    print(f"[regenerate] wrote {gz_path} ({len(gz_bytes) / 1e6:.2f} MB, {summary['num_conversations']} "
          f"conversations, {summary['assistant_tokens']} assistant tokens) and {mpath}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", action="append", default=None,
                   help="'builtin', 'none' (Magpie prompts only), or a JSON/JSONL file or folder ([NAME=]PATH); "
                        "repeatable (default: builtin)")
    p.add_argument("--field", default=None, help="JSON files whose rows sit under this top-level key")
    p.add_argument("--split", default="train", help="split of a hub dataset in the local cache")
    p.add_argument("--limit", type=int, default=None, help="regenerate only the first N conversations (a test run)")
    p.add_argument("--num-magpie", type=int, default=0, help="Magpie prompts to write with --source builtin")
    p.add_argument("--magpie-temperature", type=float, default=1.0)
    p.add_argument("--magpie-max-tokens", type=int, default=128)
    p.add_argument("--magpie-id-prefix", default="magpie/",
                   help="ids of Magpie conversations are PREFIX + index (give parallel runs distinct prefixes)")
    p.add_argument("--output", required=True, help="JSONL written (appended) as conversations finish")
    p.add_argument("--model", default=None, help="target (default: the project's default model)")
    p.add_argument("--max-new-tokens", type=int, default=384, help="cap per assistant turn")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled conversations")
    p.add_argument("--greedy-fraction", type=float, default=0.25, help="fraction of conversations decoded greedily")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="requests decoded together (engine max_num_seqs)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + turn (trainer max length)")
    p.add_argument("--drop-heldout", action="store_true",
                   help="drop conversations that contain a held-out prompt instead of refusing to run")
    p.add_argument("--log-every", type=float, default=60.0, help="seconds between progress log lines")
    p.add_argument("--time-limit", type=float, default=None,
                   help="minutes; then stop starting new work, finish what is in flight and exit (rerun to "
                        "continue). Creating the file OUTPUT.stop does the same at any time")
    p.add_argument("--gz", default=None, help="after a complete run: write the sorted rows here (gzip)")
    p.add_argument("--manifest", default=None, help="after a complete run: write the manifest here")
    p.add_argument("--finalize-only", action="store_true", help="only write --gz/--manifest from --output")
    p.add_argument("--merge", action="append", default=[],
                   help="with --gz/--manifest: also merge this output of a parallel run (repeatable); rows whose "
                        "id or Magpie prompt is already present are dropped and counted")
    args = p.parse_args(argv)
    args.source = args.source or ["builtin"]
    if args.num_magpie and not {"builtin", "none"} & set(args.source):
        p.error("--num-magpie needs --source builtin or --source none")
    if bool(args.gz) != bool(args.manifest):
        p.error("--gz and --manifest go together")
    if args.finalize_only and not args.gz:
        p.error("--finalize-only needs --gz and --manifest")
    if not 0.0 <= args.greedy_fraction <= 1.0:
        p.error("--greedy-fraction must be in [0, 1]")
    if args.model is None:
        from ssd_eagle.assets import DEFAULT_MODEL

        args.model = DEFAULT_MODEL
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if args.finalize_only:
        finalize(args, out_path)
        return 0

    # prompts (checked against the held-out split before anything is generated)
    convs: list[Conversation] = []
    for src in args.source:
        if src == "none":
            continue
        convs += builtin_conversations() if src == "builtin" else file_conversations(src, args.field, args.split)
    if args.limit is not None:
        convs = convs[: args.limit]
    leaks = tdata.find_heldout([c.prompt_texts() for c in convs])
    if leaks:
        if not args.drop_heldout:
            tdata.assert_no_heldout([c.prompt_texts() for c in convs])
        bad = {i for i, _ in leaks}
        print(f"[regenerate] dropping {len(bad)} conversations that contain held-out prompts", flush=True)
        convs = [c for i, c in enumerate(convs) if i not in bad]
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        dup = [k for k, v in collections.Counter(ids).items() if v > 1][:5]
        raise SystemExit(f"duplicate conversation ids across sources: {dup}")

    stop_file = Path(args.output + ".stop")
    if stop_file.exists():
        raise SystemExit(f"{stop_file} exists (it asks a run to stop); delete it to run")
    done = {r["id"] for r in read_rows(out_path, repair=True)}
    magpie_cache = out_path.with_name(out_path.name + ".magpie.jsonl")
    todo = [c for c in convs if c.id not in done]
    print(f"[regenerate] {len(convs)} conversations from --source ({len(done)} rows already in {out_path}), "
          f"{len(todo)} to generate", flush=True)

    from ssd_eagle.engine.llm import LLM

    runlog = RunLog(out_path.with_name(out_path.name + ".runs.json"), args)
    status = "failed"
    regen = None
    try:
        llm = LLM(args.model, mode="ar", max_num_seqs=args.batch_size, num_threads=args.num_threads,
                  max_model_len=args.max_model_len, seed=args.seed)
        with open(out_path, "a", encoding="utf-8") as out:
            regen = Regenerator(llm, args, out, runlog)
            regen.done_ids = done
            regen.bar = tqdm(total=0, desc="conversations", unit="conv", dynamic_ncols=True,
                             mininterval=1.0 if sys.stderr.isatty() else 30.0)
            regen.add(todo)
            if args.num_magpie:
                exclude = [c.prompt_texts()[0] for c in convs if len(c.prompt_texts()) == 1]
                regen.magpie = MagpieStream(llm.tokenizer, args, magpie_cache, exclude)
                cached = [magpie_conversation(i, p, args.magpie_id_prefix)
                          for i, p in enumerate(regen.magpie.kept[: args.num_magpie])]
                tdata.assert_no_heldout([c.prompt_texts() for c in cached])
                regen.add(c for c in cached if c.id not in done)
                print(f"[regenerate] Magpie: {len(regen.magpie.kept)} prompts cached "
                      f"({regen.magpie.stats['candidates']} candidates), target {args.num_magpie}", flush=True)
            regen.run()
            regen.bar.close()
        status = "stopped (drained; rerun to continue)" if regen.draining else "complete"
        counts = dict(regen.counts)
        print(f"[regenerate] done: {counts}, {time.time() - regen.start:.0f} s", flush=True)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        final = {"status": status}
        if regen is not None:
            final.update(conversations_written=regen.counts["conversations_written"],
                         assistant_tokens_written=regen.counts["assistant_tokens_written"],
                         tokens_generated=regen.counts["tokens_generated"])
        runlog.update(force=True, **final)
    if args.gz and status == "complete":
        finalize(args, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
