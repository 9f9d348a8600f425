"""A finished directory put in place of another: the old one stays whole until the new one is there, and writers of
one name each stage their own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlfleet_trainer import directory_swap, weights
from rlfleet_trainer.directory_swap import replace_directory
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.weights import prune_versions, save_version


def _tree(files: dict[str, str], at: Path) -> Path:
    for name, text in files.items():
        (at / name).parent.mkdir(parents=True, exist_ok=True)
        (at / name).write_text(text)
    return at


def test_a_directory_replaces_another_and_nothing_is_left_beside_it(tmp_path: Path) -> None:
    dest = _tree({"model.safetensors": "old", "stale.json": "x"}, tmp_path / "v3")
    new = _tree({"model.safetensors": "new", "nested/config.json": "{}"}, tmp_path / ".v3.tmp")

    replace_directory(new, dest)

    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "model.safetensors",
        "nested/config.json",
    ]
    assert (dest / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]


def test_a_new_directory_takes_a_free_name(tmp_path: Path) -> None:
    replace_directory(_tree({"a": "1"}, tmp_path / ".v1.tmp"), tmp_path / "v1")
    assert (tmp_path / "v1" / "a").read_text() == "1"


def test_the_old_directory_is_whole_until_the_new_one_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting the old tree first left the name empty for as long as that took; an engine loading it then failed."""
    dest = _tree({"model.safetensors": "old"}, tmp_path / "v3")
    new = _tree({"model.safetensors": "new"}, tmp_path / ".v3.tmp")
    seen: list[str] = []
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        # At each rename, what a reader of v3 finds: the old files whole, or the new ones.
        if (tmp_path / "v3").exists():
            seen.append((tmp_path / "v3" / "model.safetensors").read_text())
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    replace_directory(new, dest)
    assert seen == ["old"]
    assert (dest / "model.safetensors").read_text() == "new"


def test_every_file_is_flushed_to_disk_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    new = _tree({"model.safetensors": "new", "nested/config.json": "{}"}, tmp_path / ".v1.tmp")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(directory_swap.os, "fsync", fsync)
    replace_directory(new, tmp_path / "v1")
    assert {str(new / "model.safetensors"), str(new / "nested" / "config.json"), str(new)} <= set(synced)
    assert str(tmp_path) in synced  # the rename itself


def test_two_writers_of_one_version_each_write_their_own_whole_directory(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk copy given up at its bound can still be writing a version when the run resumed after it writes the
    same one: with one staging name, the second writer deleted the first's files, which then failed (or put the
    second's half-written files in place)."""
    model = load_policy(small_model_dir)
    paused, resume = threading.Event(), threading.Event()
    real_files = weights.tokenizer_files

    def tokenizer_files(source: Path) -> list[Path]:
        if threading.current_thread().name == "late-copy":  # its weights are written: it pauses before the rest
            paused.set()
            assert resume.wait(30)
        return real_files(source)

    monkeypatch.setattr(weights, "tokenizer_files", tokenizer_files)
    failures: list[BaseException] = []

    def late_copy() -> None:
        try:
            save_version(model, tmp_path, 1, small_model_dir)
        except Exception as exc:  # noqa: BLE001 - the test reads whatever the late writer met
            failures.append(exc)

    late = threading.Thread(target=late_copy, name="late-copy")
    late.start()
    assert paused.wait(30)
    assert save_version(model, tmp_path, 1, small_model_dir) == tmp_path / "v1"
    assert load_policy(tmp_path / "v1").config.vocab_size == model.config.vocab_size
    resume.set()
    late.join(30)
    assert not late.is_alive() and failures == []
    assert load_policy(tmp_path / "v1").config.vocab_size == model.config.vocab_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"], "a writer left its staging directory"


def test_pruning_deletes_what_writes_of_older_versions_left(tmp_path: Path) -> None:
    for name in ("v1", ".v1.tmp-0123", ".v1.replaced-4567", ".v1.tmp", "v2", ".v2.tmp-89ab", "v10", "run.json"):
        (tmp_path / name).mkdir()
    prune_versions(tmp_path, keep_from=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v2.tmp-89ab", "run.json", "v10", "v2"]


def test_pruning_deletes_what_ended_writes_of_kept_versions_left_and_never_a_live_writers(tmp_path: Path) -> None:
    """A crash mid-write of the newest version left a copy of it beside it until that version was pruned (never, for a
    run's last): deleted now, unless its writer may still be writing it (a live process's; this process's is the late
    copy's test below) or it is the only whole copy of its version (set aside by a replace that never put the new one
    in place)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(30)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        names = (
            "v4",
            "v5",
            f".v5.tmp-{ended.pid}-0a1b2c3d-0123",  # its process crashed mid-write
            f".v5.tmp-{os.getpid()}-0a1b2c3d-4567",  # an earlier process that had this pid (a restarted container)
            f".v5.tmp-{alive.pid}-0a1b2c3d-cdef",  # a live process's writer
            ".v5.tmp-89abcdef0123",  # staged before writers were named: its writer is unknown
            ".v5.replaced-4567",  # set aside, its replacement v5 in place
            ".v6.replaced-89ab",  # set aside, its replacement never put in place: the only v6
            f".v4.tmp-{ended.pid}-0a1b2c3d-0123",
            "run.json",
        )
        for name in names:
            (tmp_path / name).mkdir()
        prune_versions(tmp_path, keep_from=5)
    finally:
        alive.kill()
        alive.wait(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            "v5",
            f".v5.tmp-{alive.pid}-0a1b2c3d-cdef",
            ".v5.tmp-89abcdef0123",
            ".v6.replaced-89ab",
            "run.json",
        ]
    )


def test_pruning_while_a_late_copy_writes_the_newest_version_leaves_it_to_finish(
    small_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk copy of version 1 given up at its bound may still be writing it when the run prunes after a step."""
    model = load_policy(small_model_dir)
    paused, resume = threading.Event(), threading.Event()
    real_files = weights.tokenizer_files

    def tokenizer_files(source: Path) -> list[Path]:
        if threading.current_thread().name == "late-copy":
            paused.set()
            assert resume.wait(30)
        return real_files(source)

    monkeypatch.setattr(weights, "tokenizer_files", tokenizer_files)
    late = threading.Thread(target=save_version, args=(model, tmp_path, 1, small_model_dir), name="late-copy")
    late.start()
    assert paused.wait(30)
    prune_versions(tmp_path, keep_from=1)
    resume.set()
    late.join(30)
    assert not late.is_alive()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    assert load_policy(tmp_path / "v1").config.vocab_size == model.config.vocab_size
