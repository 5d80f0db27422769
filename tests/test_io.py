"""``atomic_write``: the destination is the old content or the new one, never a partial write."""

from __future__ import annotations

import stat

import pytest

from ssd_eagle.io import atomic_write, move_into_place


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_file_replaced_and_shared(tmp_path):
    path = tmp_path / "sub" / "doc.json"
    with atomic_write(path) as tmp:
        assert not tmp.exists() and tmp.parent == path.parent and tmp.name.startswith(".")
        tmp.write_text("one")
        tmp.chmod(0o600)
    assert path.read_text() == "one" and _mode(path) == 0o644
    with atomic_write(path) as tmp:
        tmp.write_text("two")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["doc.json"]


def test_error_keeps_the_old_content_and_removes_the_temporary(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["doc.txt"]


def test_folder_replaced_whole(tmp_path):
    out = tmp_path / "export"
    with atomic_write(out, folder=True) as tmp:
        assert tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "a.txt").write_text("a")
        (tmp / "nested").mkdir()
        (tmp / "nested" / "b.bin").write_bytes(b"b")
        (tmp / "nested" / "b.bin").chmod(0o600)
    assert (out / "a.txt").read_text() == "a" and _mode(out / "nested" / "b.bin") == 0o644
    assert _mode(out) == 0o755 and _mode(out / "nested") == 0o755
    with atomic_write(out, folder=True) as tmp:
        (tmp / "c.txt").write_text("c")
    assert sorted(p.name for p in out.iterdir()) == ["c.txt"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary or old folder left

    with pytest.raises(ValueError):
        with atomic_write(out, folder=True) as tmp:
            (tmp / "d.txt").write_text("d")
            raise ValueError("bad")
    assert sorted(p.name for p in out.iterdir()) == ["c.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_keep_existing_keeps_the_first_writer(tmp_path):
    out = tmp_path / "cache"
    with atomic_write(out, folder=True, keep_existing=True) as tmp:
        (tmp / "theirs").write_text("first")
        with atomic_write(out, folder=True) as inner:  # another process finishes first
            (inner / "ours").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["ours"]
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_move_into_place_replaces_a_finished_folder(tmp_path):
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "old").write_text("x")
    src = tmp_path / ".tmp-step"
    src.mkdir()
    (src / "new").write_text("y")
    assert move_into_place(src, tmp_path / "step") == tmp_path / "step"
    assert sorted(p.name for p in (tmp_path / "step").iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["step"]
