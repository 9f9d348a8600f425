"""A finished directory put in place of another: the old one stays whole until the new one is there, and writers of
one name each stage their own."""

from __future__ import annotations

import os
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
