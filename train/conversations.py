"""Loading training conversations and normalising them to OpenAI-style ``messages`` lists.

:func:`load_conversations` reads local JSON/JSONL files (gzip included), a folder of them, or a hub dataset already in
the local cache with the ``datasets`` library, and normalises three row shapes (:func:`normalize_conversation`):
OpenAI ``messages``, ShareGPT ``conversations`` and plain ``prompt``/``text`` rows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: ShareGPT ``from`` values and the OpenAI role each maps to.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant",
    "system": "system",
}
#: Roles accepted in OpenAI-style ``messages``.
MESSAGE_ROLES = frozenset({"system", "user", "assistant"})

Message = dict[str, str]

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
              local_only: bool = True, progress: bool = True) -> list[tuple[str, Any]]:
    """Load raw rows with the ``datasets`` library.

    Each local file is loaded on its own (``datasets`` cannot merge files whose rows have different fields).

    Args:
        source: a ``.json``/``.jsonl`` file, a folder (all ``.json``/``.jsonl`` files under it, sorted by path), or
            a hub dataset id.
        split: split of a hub dataset (local files always load as one split).
        field: for JSON files whose rows sit under a top-level key.
        local_only: hub datasets are read from the local cache only (no download).
        progress: False hides datasets' "Generating train split" bars (a caller's ``--no-progress``).

    Returns:
        ``[(name, datasets.Dataset), ...]``: one entry per file (``name`` = the file path) or one for the hub id.

    Raises:
        FileNotFoundError: a folder without JSON files, or a hub id not available locally (the message says so).
    """
    import datasets

    from ssd_eagle.assets import progress_bars

    path = Path(source)
    if path.is_dir() or path.is_file():
        files = _json_files(path) if path.is_dir() else [str(path)]
        kwargs = {"field": field} if field else {}
        with progress_bars(progress):
            return [(f, datasets.load_dataset("json", data_files=f, split="train", **kwargs)) for f in files]
    context = _hub_offline() if local_only else contextlib.nullcontext()
    try:
        with context, progress_bars(progress):
            return [(str(source), datasets.load_dataset(str(source), split=split))]
    except (ConnectionError, FileNotFoundError, OSError) as err:
        where = "in the local Hugging Face cache" if local_only else "locally or on the hub"
        raise FileNotFoundError(
            f"'{source}' is neither a local .json/.jsonl file or folder nor a dataset available {where} "
            f"({err.__class__.__name__}: {err})") from err


def load_conversations(source: str | os.PathLike | Iterable[dict], *, split: str = "train",
                       field: str | None = None, local_only: bool = True, limit: int | None = None,
                       progress: bool = True) -> list[dict]:
    """Load conversations and normalise them to ``messages`` lists.

    Args:
        source: a JSON/JSONL file or folder, a hub dataset id (local cache only unless ``local_only=False``), or an
            iterable of rows (dicts, e.g. a ``datasets.Dataset``).
        split, field, local_only, progress: see :func:`load_rows`.
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
        parts = load_rows(source, split=split, field=field, local_only=local_only, progress=progress)
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
