"""Training data for EAGLE-3 draft heads: assistant loss masks and the (sharded) training dataset.

Pipeline (``docs/design.md`` sections 4 and 8):

1. :func:`~train.conversations.load_conversations` reads local JSON/JSONL files (or a hub dataset already in the
   local cache) and normalises them to OpenAI-style ``messages`` lists.
2. :func:`assistant_mask` renders a conversation with the tokenizer's chat template, tokenizes the rendering with
   character offsets and marks the tokens of every assistant turn (content plus the turn's end-of-turn token).
3. :func:`build_dataset` turns conversations into a ``datasets.Dataset`` of ``input_ids`` / ``loss_mask`` /
   ``length``, refuses held-out prompts (:func:`train.heldout.assert_no_heldout`), and keeps this rank's shard.

The prompts whose responses the target regenerates live in :mod:`train.regen`; the held-out guard in
:mod:`train.heldout`. Loading and the guard are importable from here too (``from train.data import
load_conversations``), since the dataset is built from them.

Loss-mask convention: ``loss_mask[t] == 1`` iff ``input_ids[t]`` is a token the target produced as assistant,
i.e. a token the draft must learn to predict (from positions ``< t``). The assistant role header (e.g.
``<|im_start|>assistant\\n`` or ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``) is **excluded**: serving
engines insert it with the generation prompt, the draft never proposes it. The end-of-turn token that closes each
assistant turn (``<|im_end|>``, ``<|eot_id|>``, ...) is **included**: the draft must learn to predict the stop.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from train.conversations import Message, load_conversations, load_rows, normalize_conversation  # noqa: F401
from train.heldout import HeldoutLeakError, assert_no_heldout, find_heldout, heldout_texts  # noqa: F401

DEFAULT_MAX_LENGTH = 2048

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


def special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if getattr(tok, "special", False))
    return ids


def render_template(tokenizer, messages: list[Message], chat_template: str | None,
                    add_generation_prompt: bool) -> str:
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
        prefix = render_template(tokenizer, messages, chat_template, add_generation_prompt)
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
    rendered = render_template(tokenizer, messages, chat_template, add_generation_prompt=False)
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
    eot = set(eot_token_ids) if eot_token_ids is not None else special_token_ids(tokenizer)
    special = special_token_ids(tokenizer)
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
        conversations = load_conversations(source, split=split, local_only=local_only, progress=progress)
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
