"""Conversations to regenerate, and the choices made for each one (sampling, number of turns).

Sources:

- ``builtin``: :func:`training_prompts`: the HumanEval problems outside the held-out split and the user turns of the
  packaged ShareGPT conversations (:mod:`ssd_eagle.prompts`);
- ``grounded``: requests about real text on this machine (:mod:`train.regen.grounded`);
- ``magpie-<kind>``: user turns the target writes itself, steered across MT-Bench's kinds (:mod:`train.regen.magpie`);
  these stream through the scheduler instead of being listed here;
- a JSON/JSONL file or folder (ShareGPT, OpenAI ``messages`` or plain prompt rows), labelled ``NAME=PATH``.

A conversation is a *skeleton*: its user/system messages, with ``None`` where an assistant turn is generated, plus
a number of follow-up user turns the target writes after the skeleton's last answer (multi-turn conversations).
Every choice is a pure function of the run seed and the conversation id (:func:`plan`), so a restart makes the same.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from train.conversations import load_conversations, normalize_conversation
from train.heldout import assert_no_heldout
from train.regen.filters import prompt_key

HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"  # same framing as ssd_eagle.prompts.heldout_prompts


@dataclass
class Conversation:
    """A conversation whose assistant turns are (re)generated.

    Attributes:
        id, source: as written to the output.
        messages: user/system messages, and ``None`` at each position where an assistant turn is generated.
        followups: user turns the target writes (Magpie-style) after the last generated answer.
    """

    id: str
    source: str
    messages: list[dict | None]
    followups: int = 0

    def prompt_texts(self) -> list[str]:
        return [m["content"] for m in self.messages if m is not None]


@dataclass(frozen=True)
class Plan:
    """Per-conversation choices: ``temperature`` (0.0 = greedy), the sampling ``seed`` (turn k uses
    ``seed + k``) and the number of target-written ``followups``."""

    temperature: float
    seed: int
    followups: int


def plan(run_seed: int, conv_id: str, *, greedy_fraction: float, temperature: float,
         multi_turn_fraction: float = 0.0, max_followups: int = 0) -> Plan:
    """The choices of one conversation, drawn from ``random.Random(f"{run_seed}:{conv_id}")``.

    Greedy with probability ``greedy_fraction``; with probability ``multi_turn_fraction``, 1..``max_followups``
    follow-up turns (uniform).
    """
    rng = random.Random(f"{run_seed}:{conv_id}")
    greedy = rng.random() < greedy_fraction
    seed = rng.randrange(2**31)
    followups = rng.randint(1, max_followups) if max_followups and rng.random() < multi_turn_fraction else 0
    return Plan(0.0 if greedy else float(temperature), seed, followups)


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


def training_prompts(extra: Iterable[str] = (), *, humaneval: bool = True, sharegpt: bool = True) -> list[dict]:
    """The packaged prompts whose responses the target regenerates for draft training.

    Sources: HumanEval problems whose number is not divisible by 4 (framed as in the evaluation split), the user
    turns of the packaged ShareGPT conversations (deduplicated by their sequence of user turns), and ``extra``
    single-turn prompts (deduplicated, case and whitespace ignored).

    Returns:
        ``[{"id": str, "source": "humaneval" | "sharegpt" | "extra", "turns": list[str]}, ...]``; ``turns`` are the
        user turns in order (one for single-turn prompts).

    Raises:
        HeldoutLeakError: a result would contain a held-out prompt (checked before returning).
        FileNotFoundError: a prompt package is missing.
    """
    from ssd_eagle import prompts as packaged

    out: list[dict] = []
    if humaneval:
        out += [{"id": p["task_id"], "source": "humaneval", "turns": [HUMANEVAL_INSTRUCTION + p["prompt"]]}
                for p in packaged.training_humaneval_problems()]
    if sharegpt:
        seen: set[tuple[str, ...]] = set()
        for i, row in enumerate(packaged.sharegpt_conversations()):
            turns = tuple(m["content"] for m in normalize_conversation(row, row.get("id", i)) if m["role"] == "user")
            if turns and turns not in seen:
                seen.add(turns)
                out.append({"id": f"sharegpt/{row.get('id', i)}", "source": "sharegpt", "turns": list(turns)})
    seen_extra: set[str] = set()
    for i, text in enumerate(extra):
        key = prompt_key(text)
        if key and key not in seen_extra:
            seen_extra.add(key)
            out.append({"id": f"extra/{i}", "source": "extra", "turns": [text]})
    assert_no_heldout(out)
    return out


def builtin_conversations() -> list[Conversation]:
    out = []
    for p in training_prompts():
        msgs: list[dict | None] = []
        for turn in p["turns"]:
            msgs += [{"role": "user", "content": turn}, None]
        out.append(Conversation(p["id"], p["source"], msgs))
    return out


def file_conversations(spec: str, field_name: str | None = None, split: str = "train") -> list[Conversation]:
    """Conversations of a JSON/JSONL file or folder, ``[NAME=]PATH`` (NAME defaults to the file's stem)."""
    label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    label = label or Path(path.rstrip("/")).stem or "file"
    out = []
    for conv in load_conversations(path, split=split, field=field_name):
        sk = skeleton(conv["messages"])
        if any(m is None for m in sk):
            out.append(Conversation(f"{label}/{conv['id']}", label, sk))
    return out


def single_turn(conv_id: str, source: str, prompt: str) -> Conversation:
    return Conversation(conv_id, source, [{"role": "user", "content": prompt}, None])
