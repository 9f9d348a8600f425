"""Putting a finished directory (a weight version, a checkpoint) in place of another of the same name.

The new directory's files are flushed to disk before it is renamed into place, so a machine that loses power
just after never comes back with a complete-looking directory of empty or partial files (a checkpoint whose
stream groups were already acknowledged). The directory it replaces is moved aside first and deleted last:
the name then lacks a directory only between two renames, instead of for as long as a tree takes to delete,
which an engine loading that version meanwhile would meet as a missing directory.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def replace_directory(new: Path, dest: Path) -> None:
    """Makes the finished directory `new` (a sibling of `dest`) be `dest`, durably; an existing `dest` is replaced."""
    _sync_tree(new)
    aside = dest.parent / f".{dest.name}.replaced-{uuid.uuid4().hex[:12]}"  # this call's own, beside any other's
    if dest.exists():
        dest.rename(aside)
    new.rename(dest)
    _sync(dest.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _sync_tree(root: Path) -> None:
    for folder, _dirs, files in os.walk(root):
        for name in files:
            _sync(Path(folder) / name)
        _sync(Path(folder))


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
