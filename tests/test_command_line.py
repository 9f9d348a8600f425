"""`command_line`: the argv of a child service from its flags."""

from __future__ import annotations

from pathlib import Path

from rlfleet.processes import command_line


def test_flags_follow_the_head_in_order_with_dashes_and_strings() -> None:
    argv = command_line(
        "py", "-m", "svc", model_path=Path("/m"), port=30001, worker_urls=["http://a", "http://b"], save=""
    )
    assert argv == [
        "py", "-m", "svc", "--model-path", "/m", "--port", "30001", "--worker-urls", "http://a", "http://b",
        "--save", "",
    ]  # fmt: skip


def test_no_flags_is_the_head() -> None:
    assert command_line("redis-server") == ["redis-server"]


def test_a_value_starting_with_a_dash_is_joined_to_its_flag() -> None:
    """`--ops -+` is a flag with no value to argparse: a warm start on subtraction first failed to start."""
    assert command_line("sft", ops="-+", digits=2) == ["sft", "--ops=-+", "--digits", "2"]
