"""``load_model(progress=False)`` hides transformers' and the hub's progress bars for that load only: both global
settings are as they were afterwards, whether the load succeeded or raised, and whichever of them was off."""

from __future__ import annotations

import pytest
from huggingface_hub import utils as hub_utils
from transformers.utils import logging as hf_logging

from ssd_eagle.assets import load_model


@pytest.fixture
def restore_bars():
    yield
    hf_logging.enable_progress_bar()  # (also turns the hub's back on)


@pytest.mark.parametrize("transformers_on, hub_on", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("progress", [False, True])
def test_a_load_leaves_both_progress_settings_as_they_were(transformers_on, hub_on, progress, restore_bars,
                                                           tmp_path):
    (hf_logging.enable_progress_bar if transformers_on else hf_logging.disable_progress_bar)()
    (hub_utils.enable_progress_bars if hub_on else hub_utils.disable_progress_bars)()
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing"), progress=progress)  # the load raises inside the block
    assert hf_logging.is_progress_bar_enabled() is transformers_on
    assert hub_utils.are_progress_bars_disabled() is not hub_on


def test_no_progress_data_load_hides_datasets_bars_and_restores_them(tmp_path, capsys):
    import datasets

    from train.conversations import load_conversations

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    datasets.enable_progress_bars()
    convs = load_conversations(rows, progress=False)
    assert [m["content"] for m in convs[0]["messages"]] == ["hi", "yo"]
    assert "Generating train split" not in capsys.readouterr().err
    assert datasets.is_progress_bar_enabled()
