"""What the trainer builds for its config (train.prepare): offline features that survive an interruption and are keyed
by target/aux/dtype/length, the held-out set regenerated only when its recipe changes; and the training curves
(train.tracking): tracker scalars, the duplicate steps of a resumed log, and the learning-curve PNG."""

from __future__ import annotations

import json

import pytest
import torch

from train.config import config_from_dict
from train_helpers import tiny_config, write_tiny_setup


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    return write_tiny_setup(tmp_path_factory.mktemp("tiny"), num_convs=12)


@pytest.fixture(scope="module")
def target(tiny_setup):
    from ssd_eagle.assets import load_model
    return load_model(tiny_setup["target"], dtype=torch.float32)


def _offline(tiny_setup, tmp_path, **overrides):
    values = dict(mode="offline", features_dir=str(tmp_path / "features"), feature_dtype="float32")
    return config_from_dict(tiny_config(tiny_setup, tmp_path / "run", **{**values, **overrides}))


class _Interrupt(Exception):
    pass


def test_an_interrupted_feature_build_continues_where_it_stopped(tiny_setup, target, tmp_path, monkeypatch):
    import train.features as features
    from train.features import FeatureStore
    from train.precompute_features import feature_key, missing_conversations, write_features

    model, tok = target
    cfg = _offline(tiny_setup, tmp_path)
    key = feature_key(cfg, model.config.get_text_config())
    total, todo = missing_conversations(cfg, key)
    assert total == len(todo) == 12
    real = features.write_feature_shards
    calls = []

    def killed_after_five(samples, extractor, *args, **kwargs):  # the process dies while the 6th sample runs
        def dying(batch):
            calls.append(len(batch))
            if len(calls) == 6:
                raise _Interrupt
            return extractor(batch)
        dying.aux_layer_ids, dying.lm_head_weight = extractor.aux_layer_ids, extractor.lm_head_weight
        return real(samples, dying, *args, **dict(kwargs, samples_per_shard=2))

    monkeypatch.setattr(features, "write_feature_shards", killed_after_five)
    with pytest.raises(_Interrupt):
        write_features(cfg, todo, model, tok, key, run="a")
    monkeypatch.setattr(features, "write_feature_shards", real)
    assert len(FeatureStore(cfg.features_dir, matching=key)) == 4  # two complete shards of two survived
    _, rest = missing_conversations(cfg, key)
    assert len(rest) == 8
    assert write_features(cfg, rest, model, tok, key, run="b")["samples"] == 8
    assert missing_conversations(cfg, key)[1] == []
    store = FeatureStore(cfg.features_dir, matching=key)
    assert len(store) == 12 and len({e["conv"] for e in store.samples}) == 12


def test_features_are_keyed_by_dtype_and_length(tiny_setup, target, tmp_path):
    from train.features import FeatureStore
    from train.precompute_features import feature_key, missing_conversations, write_features

    model, tok = target
    text_config = model.config.get_text_config()
    f32 = _offline(tiny_setup, tmp_path)
    write_features(f32, missing_conversations(f32, feature_key(f32, text_config))[1], model, tok,
                   feature_key(f32, text_config), run="a")
    for changed in (_offline(tiny_setup, tmp_path, feature_dtype="bfloat16"),
                    _offline(tiny_setup, tmp_path, max_length=64),
                    _offline(tiny_setup, tmp_path, target_dtype="bfloat16")):
        key = feature_key(changed, text_config)
        assert len(missing_conversations(changed, key)[1]) == 12  # nothing of another key is reused
    bf16 = _offline(tiny_setup, tmp_path, feature_dtype="bfloat16")
    key = feature_key(bf16, text_config)
    write_features(bf16, missing_conversations(bf16, key)[1], model, tok, key, run="b")
    store = FeatureStore(bf16.features_dir, matching=key)
    assert len(store) == 12 and store.get(0)["last_hidden"].dtype == torch.bfloat16
    assert FeatureStore(f32.features_dir, matching=feature_key(f32, text_config)).get(0)["last_hidden"].dtype \
        == torch.float32
    with pytest.raises(ValueError, match="differs from the directory's other runs"):
        FeatureStore(f32.features_dir)  # without a key, mixed runs are still refused


def test_heldout_set_is_generated_once_per_recipe(tiny_setup, tmp_path, monkeypatch):
    import train.heldout as heldout
    from train.distributed import init_distributed
    from train.prepare import ensure_heldout, heldout_recipe

    init_distributed()
    made = []

    def fake_generate(path, **kwargs):
        made.append(kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
        return 1

    monkeypatch.setattr(heldout, "generate_heldout", fake_generate)
    path = tmp_path / "heldout" / "mt.jsonl"
    cfg = config_from_dict(tiny_config(tiny_setup, tmp_path / "run", heldout_data=str(path), heldout_samples=8))
    assert ensure_heldout(cfg, 0) == path
    assert made[-1]["every"] == 10 and made[-1]["limit"] == 8 and made[-1]["model"] == cfg.target
    assert json.loads(path.with_name("mt.jsonl.meta.json").read_text()) == heldout_recipe(cfg)
    assert ensure_heldout(cfg, 0) is None and len(made) == 1  # reused
    more = config_from_dict(dict(cfg.to_dict(), heldout_samples=16))
    assert ensure_heldout(more, 0) == path and made[-1]["limit"] == 16  # another recipe: rebuilt
    own = config_from_dict(dict(cfg.to_dict(), heldout_data=tiny_setup["heldout"], heldout_samples=40))
    assert ensure_heldout(own, 0) is None and len(made) == 2  # a file made by hand is used as it is


# ----------------------------------------------------------------------------------------------------------------
# training curves

def test_tracker_scalars_and_learning_curve_png(tmp_path, monkeypatch):
    from train.tracking import Tracker, plot_learning_curve, read_metrics, resolve_trackers, scalars

    record = {"step": 3, "loss": 2.5, "step_acc": [0.5, 0.25], "step_loss": [1.0, 2.0], "lr": 1e-3,
              "grad_norm": None, "tokens_per_s": 100.0}
    assert scalars(record) == {"train/loss": 2.5, "train/lr": 1e-3, "train/tokens_per_s": 100.0,
                               "train/step_loss/0": 1.0, "train/step_loss/1": 2.0, "train/step_acc/0": 0.5,
                               "train/step_acc/1": 0.25}
    assert scalars({"step": 3, "heldout_tau": 1.5, "heldout_acc": [0.4]}) == {"heldout/tau": 1.5,
                                                                               "heldout/acc/0": 0.4}
    assert resolve_trackers(["none"]) == [] and resolve_trackers(["tensorboard"]) == ["tensorboard"]
    tracker = Tracker(tmp_path, ["tensorboard"], {}, rank=0)
    for step in (1, 2, 3, 2, 3, 4):  # steps 2-3 logged again after a resume from step 1
        tracker.log(dict(record, step=step, loss=float(step)))
    tracker.log({"step": 4, "heldout_tau": 1.5, "heldout_acc": [0.4, 0.2], "heldout_num_draft": 7})
    tracker.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert {"train/loss", "train/step_acc/1", "heldout/tau"} <= set(events.Tags()["scalars"])
    train, held = read_metrics(tmp_path)
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in held] == [4]
    png = plot_learning_curve(tmp_path, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name))
    with pytest.raises(ValueError, match="wandb is not installed"):
        resolve_trackers(["wandb"])
    assert resolve_trackers(["auto"]) == ["tensorboard"]  # installed here; wandb only when installed and configured


def test_features_record_the_target_dtype_and_old_indexes_read_as_float32(tiny_setup, target, tmp_path):
    """Features of a bf16 target are their own run (the server's dtype, issue 14); an index written before the
    target's dtype was recorded matches a float32 key."""
    import json

    from train.features import FeatureStore
    from train.precompute_features import feature_key, missing_conversations, write_features

    model, tok = target
    text_config = model.config.get_text_config()
    f32 = _offline(tiny_setup, tmp_path)
    key = feature_key(f32, text_config)
    assert key["target_dtype"] == "float32"
    index = write_features(f32, missing_conversations(f32, key)[1], model, tok, key, run="a")["index"]
    doc = json.loads(open(index).read())
    assert doc["meta"]["target_dtype"] == "float32"
    del doc["meta"]["target_dtype"]  # as written by an older version
    open(index, "w").write(json.dumps(doc))
    assert len(FeatureStore(f32.features_dir, matching=key)) == 12
    bf16_target = _offline(tiny_setup, tmp_path, target_dtype="bfloat16")
    bkey = feature_key(bf16_target, text_config)
    from ssd_eagle.assets import load_model
    bf16_model, _ = load_model(tiny_setup["target"], dtype=torch.bfloat16)
    write_features(bf16_target, missing_conversations(bf16_target, bkey)[1], bf16_model, tok, bkey, run="b")
    store = FeatureStore(bf16_target.features_dir, matching=bkey)
    assert len(store) == 12 and store.meta["target_dtype"] == "bfloat16"
    assert missing_conversations(bf16_target, bkey)[1] == []
