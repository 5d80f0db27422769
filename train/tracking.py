"""Training curves: the metrics window the trainer reduces over ranks, the trackers it logs to, and the PNG of a
run's learning curve.

Every record goes to ``<output_dir>/metrics.jsonl`` (rank 0) and, per ``report_to`` (as transformers' trainer
names it), to TensorBoard (``torch.utils.tensorboard``, event files in ``<output_dir>/tensorboard``) and wandb
(``wandb.init(project=..., dir=output_dir)``; the project is ``WANDB_PROJECT`` or ``ssd-eagle``). Scalars:
``train/loss``, ``train/step_loss/<i>`` and ``train/step_acc/<i>`` per TTT step ``i`` (top-1 agreement with the target's argmax),
``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``, ``heldout/tau`` and ``heldout/acc/<i>``, SpecForge's
tracker layout. A resumed run purges the TensorBoard events past its checkpoint (they are trained again).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from train.distributed import all_reduce

TRACKERS = ("tensorboard", "wandb")


class MetricsWindow:
    """Sums over the micro-steps since the last log: loss, per-TTT-step cross-entropy, correct and counted tokens
    (and the Saguaro non-stall mass), tokens and compute seconds."""

    def __init__(self, num_steps: int):
        self.k = num_steps
        self.reset()

    def reset(self) -> None:
        self.loss, self.micro, self.tokens, self.seconds = 0.0, 0, 0, 0.0
        self.ce, self.correct, self.count, self.nonstall = (torch.zeros(self.k, dtype=torch.float64)
                                                            for _ in range(4))

    def add(self, loss, step_loss, correct, count, nonstall, tokens: int, seconds: float) -> None:
        """One micro-step: ``loss`` scalar, ``step_loss``/``correct``/``count``/``nonstall`` [K] (``nonstall`` may
        be None), ``tokens`` in the batch, ``seconds`` of compute."""
        self.loss += float(loss.detach())
        self.micro += 1
        self.ce += (step_loss.detach().double() * count.double()).cpu()
        self.correct += correct.double().cpu()
        self.count += count.double().cpu()
        if nonstall is not None:
            self.nonstall += nonstall.double().cpu()
        self.tokens += tokens
        self.seconds += seconds

    def reduce(self, with_nonstall: bool) -> dict:
        """The window's metrics over all ranks (every rank must call), then :meth:`reset`.

        Returns:
            ``{"loss", "step_loss" [K], "step_acc" [K], "num_tokens", "tokens_per_s"}`` (+ ``"step_nonstall"``);
            tokens/s counts every rank's tokens over the slowest rank's compute time.
        """
        k = self.k
        sums = all_reduce([self.loss, self.micro, self.tokens, *self.ce.tolist(), *self.correct.tolist(),
                           *self.count.tolist(), *self.nonstall.tolist()])
        dt = float(all_reduce([self.seconds], dist.ReduceOp.MAX)[0])
        ce, cor, cnt = sums[3:3 + k], sums[3 + k:3 + 2 * k], sums[3 + 2 * k:3 + 3 * k]
        out = {"loss": sums[0].item() / max(sums[1].item(), 1), "step_loss": (ce / cnt.clamp_min(1)).tolist(),
               "step_acc": (cor / cnt.clamp_min(1)).tolist(), "num_tokens": int(sums[2]),
               "tokens_per_s": sums[2].item() / max(dt, 1e-9)}
        if with_nonstall:
            out["step_nonstall"] = (sums[3 + 3 * k:] / cnt.clamp_min(1)).tolist()
        self.reset()
        return out


def wandb_configured() -> bool:
    """wandb is installed and has somewhere to log: an API key, a ``WANDB_MODE`` (e.g. ``offline``), or a login
    in ``~/.netrc``."""
    if importlib.util.find_spec("wandb") is None:
        return False
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def resolve_trackers(report_to: list[str]) -> list[str]:
    """The trackers ``report_to`` asks for (``"auto"``: those installed, and configured for wandb).

    Raises:
        ValueError: a tracker asked for by name is not installed (the message says what to install).
    """
    if "none" in report_to:
        return []
    if "auto" in report_to:
        found = ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []
        return found + (["wandb"] if wandb_configured() else [])
    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if name in report_to and importlib.util.find_spec(module) is None:
            raise ValueError(f"report_to: {name} is not installed (pip install {module})")
    return [t for t in TRACKERS if t in report_to]


def scalars(record: dict) -> dict[str, float]:
    """The tracker scalars of one ``metrics.jsonl`` record (module docstring)."""
    out = {}
    if "heldout_tau" in record:
        out["heldout/tau"] = record["heldout_tau"]
        out.update({f"heldout/acc/{i}": a for i, a in enumerate(record.get("heldout_acc", []))})
        return out
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "epoch"):
        if record.get(key) is not None:
            out[f"train/{key}"] = record[key]
    for key in ("step_loss", "step_acc", "step_nonstall"):
        out.update({f"train/{key}/{i}": v for i, v in enumerate(record.get(key, []))})
    return out


class Tracker:
    """Rank 0's logger: ``metrics.jsonl`` plus the trackers of ``report_to`` (other ranks log nothing).

    Args:
        out_dir: the run's output directory.
        report_to: the config's ``report_to``.
        config: the resolved training config (sent to wandb).
        rank: this process's rank.
        start_step: the step the run resumes from (TensorBoard events after it are purged).
    """

    def __init__(self, out_dir: str | os.PathLike, report_to: list[str], config: dict, rank: int,
                 start_step: int = 0):
        self.out = Path(out_dir)
        self.rank = rank
        self.tb = self.wandb = None
        if rank != 0:
            return
        trackers = resolve_trackers(report_to)
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if "wandb" in trackers:
            import wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "ssd-eagle"), dir=str(self.out),
                                    config=config, resume="allow")

    def log(self, record: dict) -> None:
        """Append ``record`` (with its ``step``) to ``metrics.jsonl`` and send its scalars to the trackers."""
        if self.rank != 0:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        values = scalars(record)
        if self.tb is not None:
            for name, value in values.items():
                self.tb.add_scalar(name, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


# ----------------------------------------------------------------------------------------------------------------
# the learning-curve PNG

def read_metrics(run_dir: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """``(training records, held-out records)`` of ``<run_dir>/metrics.jsonl`` by step; where an interrupted run
    logged a step twice (before and after its resume), the later record wins.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a training output_dir?")
    train: dict[int, dict] = {}
    held: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (held if "heldout_tau" in record else train)[record["step"]] = record
    return [train[s] for s in sorted(train)], [held[s] for s in sorted(held)]


def plot_learning_curve(run_dir: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Write the learning curve of a run (its ``metrics.jsonl``) as a PNG: loss, top-1 accuracy per TTT step, and
    the held-out tau against optimizer steps (matplotlib, the ``bench`` extra).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: no training record in it.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ssd_eagle.io import atomic_write

    train, held = read_metrics(run_dir)
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training records")
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in train])
    axes[0].set(title="training loss", xlabel="optimizer step")
    for i in range(len(train[-1]["step_acc"])):
        axes[1].plot(steps, [r["step_acc"][i] for r in train], label=f"step {i}")
    axes[1].set(title="top-1 accuracy per TTT step", xlabel="optimizer step")
    axes[1].legend(fontsize="small")
    if held:
        axes[2].plot([r["step"] for r in held], [r["heldout_tau"] for r in held], marker="o")
        axes[2].set(title=f"held-out tau (teacher-forced, K={held[-1]['heldout_num_draft']})",
                    xlabel="optimizer step")
    else:
        axes[2].set(title="held-out tau (not logged)")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out_png)
    with atomic_write(out) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return out
