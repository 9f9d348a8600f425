"""`rlfleet ... --help` states each option's default, at every level of subcommands."""

from __future__ import annotations

import argparse

import pytest

from rlfleet.cli.main import build_parser


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The parser and its subcommands' parsers, each with the words that reach it."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += parsers(sub, (*path, name))
    return found


def test_every_option_with_a_default_shows_it() -> None:
    checked = 0
    for path, parser in parsers(build_parser()):
        text = " ".join(parser.format_help().split())  # the help as one line, wrapping undone
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS) or action.default is False:
                continue
            assert action.help, f"rlfleet {' '.join(path)} {action.option_strings[0]} has no help"
            stated = "default" in action.help  # in the option's own words, e.g. "(default: the model path)"
            assert stated or f"(default {action.default})" in text, (
                f"rlfleet {' '.join(path)} {action.option_strings[0]}: default {action.default} not shown"
            )
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["model", "init"], "seed of the random initialisation (default 0)"),
        (["data", "arithmetic"], "digits per operand (1-9) (default 2)"),
        (["submit"], "seconds to wait for connecting and for each answer; a watch starts only once"),
        (["watch"], "then waits up to 60 s for each event or keep-alive (default 30.0)"),
        (["cancel"], "seconds to wait for connecting and for each answer (default 30.0)"),  # no watch to speak of
        (["down"], "the state directory `rlfleet up` used (default .rlfleet)"),
        (["runs"], "only runs in this state: queued, running, stalled, succeeded, failed, cancelled (stalled: running"),
    ],
)
def test_help_text(argv: list[str], shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    assert shown in " ".join(capsys.readouterr().out.split())
