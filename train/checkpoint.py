"""Training checkpoints: layout, atomic commit, and reading the trained draft back (for resume and export).

    <output_dir>/checkpoints/
        latest                      the tag of the newest complete checkpoint (replaced atomically)
        step-00000500/
            <DeepSpeed engine state>  model/optimizer/scheduler partitions (``engine.save_checkpoint``)
            draft/draft_config.json   {"kind": "eagle3" | "draft_lm", "config": {...}, "target": ...}
            draft/model.safetensors   the full trained tensors, gathered from every ZeRO partition
            trainer_state.json        step, micro-batches consumed, tokens, wall time, last metrics, data stats
            train_config.yaml         the resolved :class:`~train.config.TrainConfig`

A checkpoint is written under ``.tmp-step-...`` and renamed once complete, then ``latest`` is replaced; a crash
leaves the previous checkpoint as the latest. ``draft/`` holds the EAGLE-3 head's tensors under the checkpoint
names of ``docs/design.md`` section 5 (``d2t``/``t2d`` included, no embeddings), or the draft LM's trained tensors under
``LlamaForCausalLM`` names (no embedding/output layer: those are the frozen target's).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ssd_eagle.io import atomic_write, move_into_place

CHECKPOINTS = "checkpoints"
LATEST = "latest"
DRAFT_DIR = "draft"
DRAFT_CONFIG = "draft_config.json"
DRAFT_WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.json"
TRAIN_CONFIG = "train_config.yaml"
TMP_PREFIX = ".tmp-"

# prefixes the trainer's wrapper modules add to the draft's parameter names in DeepSpeed's own files
_WRAPPER_PREFIXES = {"eagle3": "head.", "draft_lm": "body."}


def step_tag(step: int) -> str:
    return f"step-{step:08d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under a checkpoints root, or None."""
    root = Path(root)
    latest = root / LATEST
    if not latest.is_file():
        return None
    path = root / latest.read_text().strip()
    return path if (path / DRAFT_DIR / DRAFT_CONFIG).is_file() else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory from: a step directory, a checkpoints root (its ``latest``), its ``latest`` file itself
    (DeepSpeed's convention, ``runs/<run>/checkpoints/latest``), or a run's output dir.

    Raises:
        FileNotFoundError: none of those.
    """
    path = Path(path)
    if path.name == LATEST and path.is_file():
        path = path.parent
    if (path / DRAFT_DIR / DRAFT_CONFIG).is_file() or (path / TRAINER_STATE).is_file():
        return path
    for root in (path, path / CHECKPOINTS):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise FileNotFoundError(f"{path}: not a training checkpoint (no {DRAFT_DIR}/{DRAFT_CONFIG}), checkpoints root "
                            f"or output dir with {CHECKPOINTS}/{LATEST}")


def write_draft_snapshot(step_dir: str | os.PathLike, kind: str, config: dict, tensors: dict[str, torch.Tensor],
                         extra: dict | None = None) -> None:
    """Write ``draft/draft_config.json`` and ``draft/model.safetensors`` into a (temporary) step directory."""
    d = Path(step_dir) / DRAFT_DIR
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(d / DRAFT_WEIGHTS),
              metadata={"format": "pt"})
    (d / DRAFT_CONFIG).write_text(json.dumps({"kind": kind, "config": config, **(extra or {})}, indent=2) + "\n")


def read_draft_config(step_dir: str | os.PathLike) -> dict:
    """``draft/draft_config.json`` of a step directory."""
    return json.loads((Path(step_dir) / DRAFT_DIR / DRAFT_CONFIG).read_text())


def read_draft_tensors(step_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The trained tensors of a checkpoint: ``draft/model.safetensors``, or, when a checkpoint lacks it, the fp32
    weights DeepSpeed reconstructs from its ZeRO partitions (``get_fp32_state_dict_from_zero_checkpoint``; the
    vocabulary buffers then come from DeepSpeed's module states).

    Raises:
        FileNotFoundError: neither is present.
    """
    step_dir = Path(step_dir)
    path = step_dir / DRAFT_DIR / DRAFT_WEIGHTS
    if path.is_file():
        return load_file(str(path))
    kind = read_draft_config(step_dir)["kind"]
    prefix = _WRAPPER_PREFIXES[kind]
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
    except (FileNotFoundError, ValueError) as err:
        raise FileNotFoundError(f"{step_dir}: no {DRAFT_DIR}/{DRAFT_WEIGHTS} and no readable DeepSpeed state "
                                f"({err})") from err
    out = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if kind == "eagle3":
        for f in sorted(step_dir.glob("*model_states.pt")):
            module = torch.load(f, map_location="cpu", weights_only=False).get("module") or {}
            for name in ("d2t", "t2d"):
                if prefix + name in module:
                    out[name] = module[prefix + name]
            break
    return out


def commit_checkpoint(root: str | os.PathLike, tmp_tag: str, tag: str, keep: int) -> Path:
    """Rename ``root/tmp_tag`` to ``root/tag``, point ``latest`` at it (atomic replace), and delete all but the
    ``keep`` newest checkpoints and any stale temporary directory. Rank 0 only."""
    root = Path(root)
    final = move_into_place(root / tmp_tag, root / tag)
    with atomic_write(root / LATEST) as tmp:
        tmp.write_text(tag + "\n")
    steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final
