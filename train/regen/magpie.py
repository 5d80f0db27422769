"""Magpie-style self-instruct: the target writes the user's turn itself (Xu et al. 2024, "Magpie", section 2).

Rendered up to where a user's message starts (:func:`user_turn_prefix`), an instruction-tuned model continues with
a plausible user request. Two uses here:

- new conversations, steered across the kinds of requests MT-Bench covers (:data:`KINDS`: writing, roleplay,
  reasoning, math, coding, extraction, STEM, humanities) by a system prompt describing the user and the first
  words of the request, both written for this project (no MT-Bench text);
- follow-up turns of multi-turn conversations: the history so far, then the user prefix.

Every candidate goes through one :class:`CandidateFilter`: cut at the end of the user turn, decoded, and dropped when
unfinished, degenerate (:func:`is_degenerate_prompt`), a duplicate, or touching a held-out prompt
(:func:`train.heldout.check_text`).
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from train.data import Message, render_template, special_token_ids
from train.heldout import check_text
from train.regen.filters import prompt_key

# kind | who the user is (the system prompt) | first words of requests, separated by ";"
_KIND_TABLE = """
writing | The user is a writer who asks an AI assistant for help drafting texts: stories, emails, poems, blog posts, \
speeches and product descriptions. | Write a; Compose a; Draft an email; Write a short story about; Help me write
roleplay | The user asks an AI assistant to play a character, a profession or a famous person and to answer in that \
role. | Pretend you are; Imagine you are; Act as a; You are a; Play the role of
reasoning | The user asks an AI assistant logic puzzles, riddles and common-sense questions that need careful \
step-by-step thinking. | If; Suppose that; A man has; Which of these; Is it true that
math | The user asks an AI assistant to solve mathematics problems: arithmetic, algebra, geometry, probability and \
number theory. | Solve; Calculate; What is the probability; Find the value of; How many
coding | The user is a programmer who asks an AI assistant to write, fix or explain code. | Write a Python function; \
How do I; Fix this code; Write a program that; What is the difference between
extraction | The user gives an AI assistant a piece of text and asks it to pull out names, dates, numbers or facts, \
often as a list, a table or JSON. | Extract; From the following text; List all the; Read this and; Identify the
stem | The user asks an AI assistant questions about physics, chemistry, biology, engineering and computer \
science. | Explain how; What happens when; Why does; Describe the process of; How does
humanities | The user asks an AI assistant about history, philosophy, economics, law, art and culture. | Discuss; \
What were the causes of; Compare; How did; What is the role of
"""


def _parse_kinds(table: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for line in table.strip().splitlines():
        kind, system, openers = (part.strip() for part in line.split(" | "))
        out[kind] = (system, tuple(o.strip() for o in openers.split(";")))
    return out


#: Kinds of request (MT-Bench's eight categories) -> (system prompt describing the user, first words of requests).
KINDS: dict[str, tuple[str, tuple[str, ...]]] = _parse_kinds(_KIND_TABLE)

_SPECIAL_TEXT = re.compile(r"<\|[^|>\s]{1,40}\|>|<(?:start|end)_of_turn>")


def user_turn_prefix(tokenizer, system_prompt: str | None = None, chat_template: str | None = None,
                     history: Sequence[Message] = ()) -> tuple[str, int]:
    """The chat template rendered up to where a user's message starts, and the token that ends a user turn.

    Renders ``[system?, *history, user: <sentinel>]``; the prefix is the text before the sentinel (for SmolLM2:
    ``...<|im_start|>user\\n``; for Llama-3: ``...<|start_header_id|>user<|end_header_id|>\\n\\n``), the end token
    is the first special token after it (``<|im_end|>``, ``<|eot_id|>``).

    Returns:
        ``(prefix_text, end_of_turn_id)``.

    Raises:
        ValueError: the sentinel does not survive rendering, or no special token follows it.
    """
    sentinel = "MAGPIE" + uuid.uuid4().hex
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(history) + \
        [{"role": "user", "content": sentinel}]
    rendered = render_template(tokenizer, messages, chat_template, add_generation_prompt=False)
    pos = rendered.find(sentinel)
    if pos < 0:
        raise ValueError("the chat template does not render user content verbatim; cannot build a Magpie prefix")
    special = special_token_ids(tokenizer)
    after = tokenizer(rendered[pos + len(sentinel):], add_special_tokens=False)["input_ids"]
    end = next((t for t in after if t in special), None)
    if end is None:
        raise ValueError("no special token ends the user turn in the chat template's rendering")
    return rendered[:pos], end


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


@dataclass(frozen=True)
class Steering:
    """How Magpie candidate ``index`` is steered: its kind, the system prompt and the request's first words."""

    kind: str
    system_prompt: str
    opener: str

    @classmethod
    def for_candidate(cls, seed: int, index: int) -> Steering:
        """Kinds in turn (candidate ``index`` gets kind ``index % 8``), the opener drawn from
        ``random.Random(f"steer:{seed}:{index}")``: a pure function of the run seed and the index."""
        kind = list(KINDS)[index % len(KINDS)]
        system, openers = KINDS[kind]
        return cls(kind, system, random.Random(f"steer:{seed}:{index}").choice(openers))


class CandidateFilter:
    """Turns generated user turns into prompts: cut, decoded, filtered, deduplicated.

    Args:
        tokenizer: the target's tokenizer.
        exclude: prompts already in use (their :func:`~train.regen.filters.prompt_key` counts as seen).
        stop_token_ids: more ids that end a user turn (besides the template's end of turn and EOS).
        dedup: drop a prompt seen before (off for follow-ups: "Can you give an example?" may follow many answers).

    ``__call__(token_ids, opener="")`` returns ``(outcome, prompt)``: outcome one of :data:`OUTCOMES`, prompt the
    kept text (``opener`` + the decoded tokens up to the first stop token, stripped) or None.
    """

    OUTCOMES = ("kept", "unfinished", "degenerate", "duplicate", "heldout")

    def __init__(self, tokenizer, exclude: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                 dedup: bool = True, min_chars: int = 8, max_chars: int = 4000):
        _, end_id = user_turn_prefix(tokenizer)
        self.tokenizer = tokenizer
        self.stops = {end_id, *stop_token_ids} | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                  else set())
        self.special_texts = [t for t in tokenizer.all_special_tokens if t]
        self.seen = {prompt_key(t) for t in exclude}
        self.dedup, self.min_chars, self.max_chars = dedup, min_chars, max_chars

    def seen_add(self, prompt: str) -> None:
        """Count ``prompt`` as seen (a later candidate equal to it is a duplicate)."""
        self.seen.add(prompt_key(prompt))

    def __call__(self, token_ids: Sequence[int], opener: str = "") -> tuple[str, str | None]:
        cut = next((j for j, tok in enumerate(token_ids) if tok in self.stops), None)
        if cut is None:
            return "unfinished", None
        text = (opener + self.tokenizer.decode(list(token_ids[:cut]), skip_special_tokens=False)).strip()
        if is_degenerate_prompt(text, min_chars=self.min_chars, max_chars=self.max_chars,
                                special_tokens=self.special_texts):
            return "degenerate", None
        key = prompt_key(text)
        if self.dedup and key in self.seen:
            return "duplicate", None
        self.seen.add(key)
        if check_text(text) is not None:
            return "heldout", None
        return "kept", text
