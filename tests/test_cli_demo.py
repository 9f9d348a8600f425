"""`rlfleet demo`: it deletes only a previous demo's directory (or one the user says it may), and each demo
has Redis options like `rlfleet up` and a key prefix of its own, removed afterwards; its watch prints a
progress line only when it changes."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from rlfleet.cli.demo import MARKER, delete_keys, fleet_config, recreate, watch
from rlfleet.cli.main import build_parser
from rlfleet.runs_client import RunsClient
from rlfleet.v1.runs_pb2 import Run, RunProgress, RunState


def demo_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *argv])


def test_a_directory_that_is_not_a_demo_is_refused_and_kept(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    demo = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(precious)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert f"is not a previous demo's directory (it has no {MARKER})" in demo.stderr and "--overwrite" in demo.stderr
    assert (precious / "notes.txt").read_text() == "mine"


def test_a_previous_demo_an_empty_or_a_missing_directory_is_recreated_with_the_marker(tmp_path: Path) -> None:
    previous = tmp_path / "previous"
    recreate(previous, overwrite=False)
    (previous / "summary.json").write_text("{}")
    recreate(previous, overwrite=False)
    assert [p.name for p in previous.iterdir()] == [MARKER]
    (tmp_path / "empty").mkdir()
    recreate(tmp_path / "empty", overwrite=False)
    assert (tmp_path / "empty" / MARKER).exists()


def test_a_demo_from_before_the_marker_is_recognised_by_what_it_holds(tmp_path: Path) -> None:
    old = tmp_path / "old"
    for name in ("base", "sft", "fleet"):
        (old / name).mkdir(parents=True)
    (old / "summary.json").write_text("{}")
    recreate(old, overwrite=False)
    assert [p.name for p in old.iterdir()] == [MARKER]
    (old / "summary.json").write_text("{}")
    (old / "notes.txt").write_text("mine")
    (old / MARKER).unlink()
    with pytest.raises(FileExistsError):
        recreate(old, overwrite=False)


def test_overwrite_deletes_any_directory(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        recreate(other, overwrite=False)
    recreate(other, overwrite=True)
    assert [p.name for p in other.iterdir()] == [MARKER]


def test_each_demo_has_its_own_redis_prefix_unless_given_one(tmp_path: Path) -> None:
    first, second = (fleet_config(demo_args(), tmp_path) for _ in range(2))
    assert first.redis_prefix.startswith("rlfleet-demo-") and first.redis_prefix != second.redis_prefix
    assert first.redis_url is None  # as `rlfleet up`: 127.0.0.1:6379, started when none answers
    given = fleet_config(demo_args("--redis-url", "redis://127.0.0.1:6379/5", "--redis-prefix", "mine:"), tmp_path)
    assert (given.redis_url, given.redis_prefix) == ("redis://127.0.0.1:6379/5", "mine:")


def test_the_demos_keys_and_only_they_are_deleted(redis_client: redis.Redis, redis_prefix: str) -> None:
    url = redis_client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/{url.get('db', 0)}"
    redis_client.set(f"{redis_prefix}demo:run:1", "x")
    redis_client.set(f"{redis_prefix}other", "y")
    delete_keys(redis_url, f"{redis_prefix}demo:")
    assert redis_client.get(f"{redis_prefix}demo:run:1") is None
    assert redis_client.get(f"{redis_prefix}other") == b"y"


class ScriptedRuns:
    """The two calls the demo's watch makes, answered from a list of run events."""

    def __init__(self, events: list[Run]) -> None:
        self.events = events

    def get(self, run_id: str) -> Run:
        return self.events[0]

    def watch(self, run_id: str) -> Iterator[Run]:
        yield from self.events


def test_the_demo_prints_a_progress_line_only_when_it_changes(capsys: pytest.CaptureFixture) -> None:
    running, done = RunState.RUN_STATE_RUNNING, RunState.RUN_STATE_SUCCEEDED
    events = [
        Run(id="run-1", state=state, progress=RunProgress(step=step, total_steps=2, groups_produced=4 * step))
        for step, state in [(0, running), (1, running), (1, running), (1, running), (2, running), (2, done)]
    ]
    final, _, _ = watch(cast(RunsClient, ScriptedRuns(events)), "run-1")
    assert final.state == done
    lines = capsys.readouterr().out.splitlines()
    assert [re.findall(r"step (\S+) .* (\w+)$", line)[0] for line in lines] == [
        ("0/2", "running"),
        ("1/2", "running"),
        ("2/2", "running"),
        ("2/2", "succeeded"),
    ]
