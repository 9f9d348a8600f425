"""Putting a finished directory (a weight version, a checkpoint, an export) in place of another of the same name.

The new directory's files are flushed to disk before it is renamed into place, so a machine that loses power
just after never comes back with a complete-looking directory of empty or partial files (a checkpoint whose
stream groups were already acknowledged). The directory it replaces is moved aside first and deleted last:
the name then lacks a directory only between two renames, instead of for as long as a tree takes to delete,
which an engine loading that version meanwhile would meet as a missing directory. `place_directory` puts one
where no other is (an export), and never replaces one.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path


def replace_directory(new: Path, dest: Path) -> None:
    """Makes the finished directory `new` (a sibling of `dest`) be `dest`, durably; an existing `dest` is replaced."""
    sync_tree(new)
    aside = dest.parent / f".{dest.name}.replaced-{uuid.uuid4().hex[:12]}"  # this call's own, beside any other's
    if dest.exists():
        dest.rename(aside)
    new.rename(dest)
    sync_path(dest.parent)
    shutil.rmtree(aside, ignore_errors=True)


def place_directory(new: Path, dest: Path) -> None:
    """Makes the finished directory `new` (a sibling of `dest`) be `dest`, durably, where no `dest` is or an empty
    one: FileExistsError if `dest` is a file or holds any, which are left as they are (what another writer put
    there since the caller looked is not replaced)."""
    sync_tree(new)
    try:
        new.rename(dest)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise FileExistsError(exc.errno, "is not an empty directory", str(dest)) from exc
        raise
    sync_path(dest.parent)


def sync_tree(root: Path) -> None:
    """Flushes every file and directory under `root` to disk."""
    for folder, _dirs, files in os.walk(root):
        for name in files:
            sync_path(Path(folder) / name)
        sync_path(Path(folder))


def sync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
