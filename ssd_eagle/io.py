"""Atomic writes: a file or a folder appears at its path complete, or not at all.

Every checkpoint, export, converted model, feature shard, index and manifest of the project is written through
:func:`atomic_write`: the content goes to a hidden temporary sibling (same directory, so the final rename never
crosses a file system), which then replaces the destination. A crash or an exception leaves the previous content
(or nothing) and removes the temporary. Permissions are normalised to shareable ones (files 0644, folders 0755):
``safetensors`` writes 0600 files and ``mkdtemp`` 0700 folders.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _tmp_sibling(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{uuid.uuid4().hex}"


def _share(path: Path) -> None:
    if path.is_dir():
        os.chmod(path, 0o755)
        for p in path.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
    else:
        os.chmod(path, 0o644)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def move_into_place(tmp: str | os.PathLike, path: str | os.PathLike, *, keep_existing: bool = False) -> Path:
    """Move a finished file or folder ``tmp`` onto ``path`` (same file system) and return ``path``.

    A file replaces ``path`` in one ``os.replace``. A folder cannot be swapped in one call: an existing ``path`` is
    renamed aside, ``tmp`` renamed in, and the old folder deleted (a crash between the two renames leaves the old
    folder under ``.<name>.old-*``, never a half-written ``path``). With ``keep_existing``, a ``path`` that exists
    (another process finished first) is kept and ``tmp`` deleted. Permissions are normalised (module docstring).

    Raises:
        OSError: the rename failed (``tmp`` is left in place for the caller to clean up).
    """
    tmp, path = Path(tmp), Path(path)
    _share(tmp)
    if keep_existing and path.exists():
        _remove(tmp)
        return path
    if not tmp.is_dir():
        os.replace(tmp, path)
        return path
    old = None
    if path.exists():
        old = _tmp_sibling(path, "old")
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if keep_existing and path.exists():  # another process renamed its folder in between
            _remove(tmp)
        else:
            if old is not None and not path.exists():
                os.replace(old, path)
            raise
    if old is not None:
        _remove(old)
    return path


@contextmanager
def atomic_write(path: str | os.PathLike, *, folder: bool = False, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on a clean exit it replaces ``path`` (:func:`move_into_place`).

    Args:
        path: the destination file or folder; its parent directories are created.
        folder: yield an empty temporary folder (else a file path that does not exist yet: create it).
        keep_existing: if ``path`` exists once the write is done, keep it and discard the new content (a cache
            that two processes may fill at once).

    Raises:
        whatever the ``with`` body raises (the temporary is removed, ``path`` untouched); ``OSError`` from the rename.

    Example::

        with atomic_write(out_dir, folder=True) as tmp:
            model.save_pretrained(tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path, "tmp")
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        move_into_place(tmp, path, keep_existing=keep_existing)
    finally:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
