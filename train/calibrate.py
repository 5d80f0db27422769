"""Calibrate a draft's temperature scale s: the q its sampled rows draw from is ``softmax(z / (T s))``.

Any q keeps speculative sampling lossless (the verifier tests each draft with the q it was drawn from), so q may be
chosen for acceptance alone. A draft token x ~ q is accepted with probability ``min(1, p(x) / q(x))``, on average

    alpha(q) = sum_x min(p(x), q(x)),

and a draft trained by cross-entropy to estimate p hedges where it is unsure: its q is flatter than p there, and a
sharper q (s < 1) is accepted more often. This module measures alpha for a grid of s on *training* conversations,
teacher-forced (the target's features, as in training): an EAGLE-3 head over its first ``steps`` TTT steps (step i
fed its own outputs, as when it drafts), a draft LM over its next-token predictions; p and q at each serving
temperature T of the grid, over the draft's vocabulary (target mass outside it is never drafted). The chosen s
maximises the mean alpha over the temperatures and steps, and ``--write`` records it in the draft's
``config.json`` (``ssd_eagle.draft_temperature_scale``), where SD reads it (:mod:`ssd_eagle.drafters.chain`;
the SSD speculator drafts at s = 1 unless told otherwise: its rounds also need a rejected position's bonus among
the cached candidates, which a sharper q makes rarer).

    python -m train.calibrate --draft drafts/smollm2-135m-eagle3 --data data/smollm2-135m/regenerated.jsonl.gz --write

The sampled conversations go through :func:`train.data.build_dataset`'s held-out guard, so the calibration never
sees the text the drafts are evaluated on.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ssd_eagle.io import atomic_write
from ssd_eagle.models.draft_lm import TEMPERATURE_SCALE_KEY
from ssd_eagle.models.eagle3_formats import has_checkpoint, is_eagle3_head, load_eagle3
from ssd_eagle.platform import DTYPES, resolve_dtype

DEFAULT_TEMPERATURES = (0.5, 0.75, 1.0)
DEFAULT_SCALES = tuple(round(0.4 + 0.05 * i, 2) for i in range(13))  # 0.4 .. 1.0


def acceptance_by_scale(draft_logits: torch.Tensor, target_logits: torch.Tensor, draft_ids: torch.Tensor | None,
                        temperatures, scales, chunk: int = 256) -> torch.Tensor:
    """Summed acceptance chances ``sum over rows of sum_x min(p_T(x), q_{T,s}(x))``.

    Args:
        draft_logits: float [m, D], the draft's logits for m positions (columns: ``draft_ids``).
        target_logits: float [m, V], the target's logits for the same positions (its whole vocabulary).
        draft_ids: int64 [D], the target id of each draft column, or None (D = V).
        temperatures: T values > 0; scales: s values > 0.

    Returns:
        float64 [len(temperatures), len(scales)] sums (divide by m for the mean chance).

    Raises:
        ValueError: row counts differ, or a temperature or scale is not > 0.
    """
    if draft_logits.shape[0] != target_logits.shape[0]:
        raise ValueError(f"{draft_logits.shape[0]} draft rows but {target_logits.shape[0]} target rows")
    if min(temperatures) <= 0 or min(scales) <= 0:
        raise ValueError("temperatures and scales must be > 0")
    out = torch.zeros(len(temperatures), len(scales), dtype=torch.float64)
    for start in range(0, draft_logits.shape[0], chunk):
        z_d = draft_logits[start:start + chunk].float()
        z_t = target_logits[start:start + chunk].float()
        for i, t in enumerate(temperatures):
            p = torch.softmax(z_t / t, dim=-1)
            p = p if draft_ids is None else p[:, draft_ids]
            for j, s in enumerate(scales):
                out[i, j] += torch.minimum(p, torch.softmax(z_d / (t * s), dim=-1)).sum().double()
    return out


@dataclass
class Calibration:
    """What :func:`calibrate` measured.

    Attributes:
        temperatures, scales: the grid; steps: draft steps measured (1 for a draft LM).
        alpha: float [steps, len(temperatures), len(scales)], the mean acceptance chance of each.
        positions: scored positions per step.
        best: the s of the highest mean alpha over steps and temperatures.
    """

    temperatures: tuple[float, ...]
    scales: tuple[float, ...]
    alpha: torch.Tensor
    positions: list[int]

    @property
    def best(self) -> float:
        return self.scales[int(self.alpha.mean(dim=(0, 1)).argmax())]

    def table(self) -> str:
        lines = [f"{'step':>4s} {'T':>5s} " + " ".join(f"{s:>6.2f}" for s in self.scales) + "   best s"]
        for k in range(self.alpha.shape[0]):
            for i, t in enumerate(self.temperatures):
                row = self.alpha[k, i]
                lines.append(f"{k:4d} {t:5.2f} " + " ".join(f"{a:6.4f}" for a in row.tolist())
                             + f"   {self.scales[int(row.argmax())]:.2f}")
        mean = self.alpha.mean(dim=(0, 1))
        lines.append(f"{'mean':>10s} " + " ".join(f"{a:6.4f}" for a in mean.tolist()) + f"   {self.best:.2f}")
        return "\n".join(lines)


@torch.inference_mode()
def calibrate(draft_dir: str | Path, data: str | Path, *, conversations: int = 64, steps: int = 3,
              temperatures=DEFAULT_TEMPERATURES, scales=DEFAULT_SCALES, max_length: int = 1024,
              dtype: str = "auto", seed: int = 0, target: str | None = None, progress: bool = True) -> Calibration:
    """Measure the acceptance chance of each scale on ``conversations`` training conversations of ``data`` (a seeded
    sample), target and draft in ``dtype`` (the serving dtype under ``auto``). See the module docstring.

    Raises:
        ValueError: ``steps`` < 1, no sampled conversation with an assistant token, or a malformed draft.
        HeldoutLeakError: a sampled conversation holds a held-out prompt.
    """
    from ssd_eagle.assets import DEFAULT_MODEL, load_model
    from ssd_eagle.models.draft_lm import draft_vocab_ids, is_compact_draft_lm, load_draft_lm
    from train.data import build_dataset, load_conversations
    from train.features import TargetFeatureExtractor
    from train.ttt import chain_masks, ttt_unroll

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    draft_dir = Path(draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    is_eagle = is_eagle3_head(draft_dir)
    recorded = ((config.get("ssd_eagle") or {}).get("shared_from_target") or {}).get("target")
    torch_dtype = resolve_dtype(dtype, "cpu")
    target_model, tokenizer = load_model(target or recorded or DEFAULT_MODEL, dtype=torch_dtype)
    if is_eagle:
        head = load_eagle3(draft_dir, target_config=target_model.config, dtype=torch_dtype)
        head.set_embeddings(target_model.get_input_embeddings())
        aux_ids, draft_ids = head.config.aux_layer_ids, head.draft_target_ids
    elif is_compact_draft_lm(draft_dir) or has_checkpoint(draft_dir):
        draft = load_draft_lm(draft_dir, target_model, dtype=torch_dtype)
        aux_ids, draft_ids, steps = None, draft_vocab_ids(draft.config), 1
    else:
        raise ValueError(f"{draft_dir}: no EAGLE-3 head or draft LM weights there")
    rows = load_conversations(data)
    rows = random.Random(seed).sample(rows, min(conversations, len(rows)))
    dataset, _ = build_dataset([r["messages"] for r in rows], tokenizer, max_length=max_length, shuffle_seed=None,
                               progress=False)
    extractor = TargetFeatureExtractor(target_model, aux_ids, 1, max_length)
    w = target_model.get_output_embeddings().weight
    sums = torch.zeros(steps, len(temperatures), len(scales), dtype=torch.float64)
    positions = [0] * steps
    for sample in tqdm(dataset, desc="calibrate", disable=not progress):
        batch = extractor([{"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]}])
        chains = chain_masks(batch.loss_mask, steps)
        if is_eagle:  # step i of the chain started at t predicts position t + 1 + i's next token
            outs = ttt_unroll(head, batch.input_ids, batch.aux_hidden, steps, keep=chains[1] if steps > 1 else None)
            scored = []
            for i, out in enumerate(outs):
                b, row = (out.valid & chains[i].gather(1, out.positions)).nonzero(as_tuple=True)
                scored.append((head.compute_logits(out.hidden[b, row]), b, out.positions[b, row] + 1 + i))
        else:  # position t's logits predict x_{t+1}, as the target's at t do
            b, t = chains[0].nonzero(as_tuple=True)
            t = t + 1
            logits = draft(batch.input_ids).logits
            scored = [(logits[b, t] if draft_ids is None else logits[b, t][:, draft_ids], b, t)]
        for i, (z_draft, b, s_idx) in enumerate(scored):
            z_target = batch.last_hidden[b, s_idx].to(w.dtype) @ w.T
            sums[i] += acceptance_by_scale(z_draft, z_target, draft_ids, temperatures, scales)
            positions[i] += len(b)
    alpha = sums / torch.tensor(positions, dtype=torch.float64).clamp_min(1).view(-1, 1, 1)
    return Calibration(tuple(temperatures), tuple(scales), alpha, positions)


def record(draft_dir: str | Path, scale: float) -> None:
    """Write ``scale`` into ``draft_dir/config.json``'s ``ssd_eagle`` block (atomically)."""
    path = Path(draft_dir) / "config.json"
    doc = json.loads(path.read_text())
    doc.setdefault("ssd_eagle", {})[TEMPERATURE_SCALE_KEY] = scale
    with atomic_write(path) as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="an EAGLE-3 export or a draft LM folder")
    ap.add_argument("--data", required=True, help="training conversations (jsonl[.gz]); held-out prompts are refused")
    ap.add_argument("--conversations", type=int, default=64, help="seeded sample of the data's conversations")
    ap.add_argument("--steps", type=int, default=3, help="EAGLE-3 draft steps scored (a draft LM scores one)")
    ap.add_argument("--temperatures", type=_floats, default=DEFAULT_TEMPERATURES)
    ap.add_argument("--scales", type=_floats, default=DEFAULT_SCALES)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default=None, help="the target model (default: the one the draft records)")
    ap.add_argument("--write", action="store_true", help="record the best s in the draft's config.json")
    args = ap.parse_args(argv)
    result = calibrate(args.draft, args.data, conversations=args.conversations, steps=args.steps,
                       temperatures=args.temperatures, scales=args.scales, max_length=args.max_length,
                       dtype=args.dtype, seed=args.seed, target=args.target)
    print(f"mean acceptance chance per draft step, temperature and s ({result.positions} positions):")
    print(result.table())
    if args.write:
        record(args.draft, result.best)
        print(f"wrote {TEMPERATURE_SCALE_KEY} = {result.best} to {Path(args.draft) / 'config.json'}")


if __name__ == "__main__":
    main()
