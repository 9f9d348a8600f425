"""Command-line flags that fill a service's pydantic settings, declared as one table of `Flag`s.

argparse only collects strings; the settings class converts and validates them, so a flag accepts
exactly what its `RLFLEET_<SVC>_<FIELD>` variable accepts. Only the flags given on the command line
reach the settings: the environment, then the defaults, fill every other field. Nothing here imports
a service's settings class, so a service can parse its flags (and answer `--help`) before it imports
anything heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

Settings = TypeVar("Settings", bound=BaseSettings)


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the settings field it sets."""

    name: str
    """The flag as typed, e.g. `--health-check-timeout`."""
    help: str
    field: str = ""
    """The settings field it sets; unset: the flag's name with '_' for '-' (`--grpc-port` sets `grpc_port`)."""
    kind: Literal["value", "switch", "list"] = "value"
    """`value` takes one string; `switch` takes none and sets the field to true; `list` takes any number."""
    metavar: str | None = None
    """What --help calls the value; unset: the field's name in capitals."""

    def __post_init__(self) -> None:
        assert self.name.startswith("--"), f"flag {self.name!r} must start with '--'"
        if not self.field:
            object.__setattr__(self, "field", self.name.removeprefix("--").replace("-", "_"))


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    """Adds `flags` to `parser` (or to a subcommand's parser); a flag not given sets no attribute."""
    for flag in flags:
        common: dict[str, Any] = {"dest": flag.field, "default": argparse.SUPPRESS, "help": flag.help}
        if flag.kind == "switch":
            parser.add_argument(flag.name, action="store_true", **common)
        else:
            nargs = "*" if flag.kind == "list" else None
            parser.add_argument(flag.name, nargs=nargs, metavar=flag.metavar, **common)


def settings_from_flags(
    settings_class: type[Settings], flags: Sequence[Flag], args: argparse.Namespace, parser: argparse.ArgumentParser
) -> Settings:
    """The settings from the `flags` given in `args`, over the environment and the defaults.

    Settings that fail validation end the program through `parser.error` (exit status 2), naming
    each wrong field, the flag or variable it came from, and the problem.
    """
    given = {flag.field: getattr(args, flag.field) for flag in flags if hasattr(args, flag.field)}
    try:
        return settings_class(**given)
    except ValidationError as exc:
        parser.error(_problems(exc, flags, given, settings_class.model_config.get("env_prefix", "")))


def _problems(exc: ValidationError, flags: Sequence[Flag], given: dict[str, Any], env_prefix: str) -> str:
    flag_names = {flag.field: flag.name for flag in flags}
    problems = []
    for error in exc.errors():
        if not error["loc"]:  # a check across fields
            problems.append(f"config: {error['msg']}")
            continue
        field = str(error["loc"][0])
        where = ".".join(map(str, error["loc"]))
        if field in given:
            problems.append(f"{where} ({flag_names[field]} {error['input']!r}): {error['msg']}")
        else:
            sources = [flag_names[field]] if field in flag_names else []
            problems.append(f"{where} ({' or '.join([*sources, (env_prefix + field).upper()])}): {error['msg']}")
    return "; ".join(problems)
