"""Training precision and resumption on tiny EAGLE-3 and draft-LM runs (one-rank gloo world, in this process): a
bf16 step (torch.autocast over float32 master weights, and DeepSpeed's bf16 section) equals the float32 step within
1e-2 relative, and a run interrupted after its checkpoint continues the uninterrupted run's loss curve."""

from __future__ import annotations

import pytest
import torch

from train_helpers import run_trainer, tiny_config, write_tiny_setup


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return write_tiny_setup(tmp_path_factory.mktemp("tiny"), num_convs=16)


def _losses(out) -> dict[int, float]:
    from train.tracking import read_metrics
    return {r["step"]: r["loss"] for r in read_metrics(out)[0]}


@pytest.mark.parametrize("draft,precision", [("eagle3", {"autocast": "bfloat16"}), ("eagle3", {"dtype": "bfloat16"}),
                                             ("draft_lm", {"autocast": "bfloat16"}),
                                             ("draft_lm", {"dtype": "bfloat16"})],
                         ids=["eagle3-autocast", "eagle3-deepspeed", "draft_lm-autocast", "draft_lm-deepspeed"])
def test_a_bf16_training_step_equals_float32(tiny_setup, tmp_path, draft, precision):
    """Two optimizer steps from the same initialisation: the loss before (step 1) and after (step 2) the first
    update agree within 1e-2 relative."""
    values = tiny_config(tiny_setup, tmp_path / "f32", max_steps=2, save_every=2, eval_every=0, heldout_data=None,
                         report_to=["none"], warmup_steps=0, draft=draft)
    run_trainer(**values)
    low, _ = run_trainer(**dict(values, output_dir=str(tmp_path / "bf16"), **precision))
    if "autocast" in precision:
        assert low.autocast_dtype == torch.bfloat16 and next(low.module.parameters()).dtype == torch.float32
    ref_loss, low_loss = _losses(tmp_path / "f32"), _losses(tmp_path / "bf16")
    for step in (1, 2):
        assert low_loss[step] == pytest.approx(ref_loss[step], rel=1e-2), (step, ref_loss, low_loss)
    assert ref_loss[1] != low_loss[1]  # the bf16 path did run in bf16


def test_resume_after_an_interruption_continues_the_loss_curve(tiny_setup, tmp_path, monkeypatch):
    """Run A trains 6 steps; run B dies at step 5 (checkpoint at 3), is relaunched, and resumes from step 3:
    its losses of steps 4-6 (and the logged steps 1-3) equal A's."""
    import train.train_draft as train_draft

    values = tiny_config(tiny_setup, tmp_path / "a", max_steps=6, save_every=3, eval_every=0, heldout_data=None,
                         report_to=["none"])
    run_trainer(**values)
    real_log = train_draft.Tracker.log

    def dies_at_step_5(self, record):
        real_log(self, record)
        if record["step"] == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_draft.Tracker, "log", dies_at_step_5)
    b = dict(values, output_dir=str(tmp_path / "b"))
    with pytest.raises(KeyboardInterrupt):
        run_trainer(**b)
    monkeypatch.setattr(train_draft.Tracker, "log", real_log)
    resumed, result = run_trainer(**b)
    assert resumed.resume_dir.name == "step-00000003" and result["step"] == 6
    raw = [line for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert len(raw) == 8  # steps 4 and 5 were logged twice; the later record (after the resume) counts
    a, b_losses = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(b_losses) == list(range(1, 7))
    for step in range(1, 7):
        assert b_losses[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), (step, a, b_losses)
