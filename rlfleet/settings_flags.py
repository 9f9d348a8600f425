"""Command-line flags that fill a service's pydantic settings, declared as one table of `Flag`s.

argparse only collects strings; the settings class converts and validates them, so a flag accepts
exactly what its `RLFLEET_<SVC>_<FIELD>` variable accepts. Only the flags given on the command line
reach the settings: the environment, then the defaults, fill every other field. `--help` names every
setting's variable (after its flag's help, or in the epilog for a setting without a flag), and a
variable under the settings' prefix that names no setting is refused, since pydantic-settings would
ignore it. Nothing here imports a service's settings class: the service passes it in, so that class
stays light (pydantic only) and the service imports anything heavy once its settings are good.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsError

from rlfleet.settings_env import setting_variables, unknown_variables

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


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], settings_class: type[BaseSettings]) -> None:
    """Adds `flags` to `parser` (or to a subcommand's parser); a flag not given sets no attribute.

    Each flag's help ends with the variable of its setting, and the epilog lists the settings of
    `settings_class` that have no flag, so `--help` names every variable the service reads.
    """
    variables = setting_variables(settings_class)
    for flag in flags:
        help_text = f"{flag.help} (env {variables[flag.field]})"
        common: dict[str, Any] = {"dest": flag.field, "default": argparse.SUPPRESS, "help": help_text}
        if flag.kind == "switch":
            parser.add_argument(flag.name, action="store_true", **common)
        else:
            nargs = "*" if flag.kind == "list" else None
            parser.add_argument(flag.name, nargs=nargs, metavar=flag.metavar, **common)
    assert parser.epilog is None, "add_flags writes the epilog"
    flagged = {flag.field for flag in flags}
    prefix = settings_class.model_config.get("env_prefix", "")
    lines = [f"A flag wins over its variable. Every {prefix}* variable must name a setting, or the program stops."]
    unflagged = [(name, field) for name, field in settings_class.model_fields.items() if name not in flagged]
    if unflagged:
        lines += ["", "settings without a flag:"]
        for name, field in unflagged:
            lines += [f"  {variables[name]}", f"      {_described(field)}"]
    parser.epilog = "\n".join(lines)
    parser.formatter_class = _LinesKept


def settings_from_flags(
    settings_class: type[Settings], flags: Sequence[Flag], args: argparse.Namespace, parser: argparse.ArgumentParser
) -> Settings:
    """The settings from the `flags` given in `args`, over the environment and the defaults.

    A variable under the settings' prefix that names no setting, and settings that fail validation,
    end the program through `parser.error` (exit status 2), naming the variable (with the settings it
    may have meant), or each wrong field, the flag or variable it came from, and the problem.
    """
    if unknown := unknown_variables(settings_class, os.environ):
        parser.error(_unknown(unknown, settings_class.model_config.get("env_prefix", "")))
    given = {flag.field: getattr(args, flag.field) for flag in flags if hasattr(args, flag.field)}
    env_prefix = settings_class.model_config.get("env_prefix", "")
    try:
        return settings_class(**given)
    except ValidationError as exc:
        parser.error(_problems(exc, flags, given, env_prefix))
    except SettingsError as exc:
        parser.error(_unparsed(exc, flags, setting_variables(settings_class)))


def _unparsed(exc: SettingsError, flags: Sequence[Flag], variables: Mapping[str, str]) -> str:
    """A variable pydantic-settings could not read: one of a list or mapping, which it takes as JSON only."""
    found = re.search(r'field "([^"]+)"', str(exc))
    if found is None or found.group(1) not in variables:
        return str(exc)
    field = found.group(1)
    variable = variables[field]
    flag = next((f.name for f in flags if f.field == field), None)
    value = os.environ.get(variable, "")
    cause = f" ({exc.__cause__})" if exc.__cause__ else ""
    where = f"{flag} or {variable}" if flag else variable
    return (
        f"{field} ({where}): {value[:80]!r} is not JSON{cause}; a variable holding a list or a mapping is written "
        'in JSON, e.g. ["http://a:8000", "http://b:8000"]'
        + (f", or give {flag} one value after another" if flag else "")
    )


class _LinesKept(argparse.HelpFormatter):
    """Help whose description and epilog keep their line breaks and indents, each line wrapped on its own."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        filled = []
        for line in text.splitlines():
            hang = indent + line[: len(line) - len(line.lstrip())]
            filled.append(textwrap.fill(" ".join(line.split()), width, initial_indent=hang, subsequent_indent=hang))
        return "\n".join(filled)


def _described(field: FieldInfo) -> str:
    text = " ".join((field.description or "").split()).rstrip(".")
    shown = field.default is not None and not field.is_required() and field.default_factory is None
    return f"{text} (default {field.default})" if shown else text


def _unknown(unknown: Mapping[str, list[str]], env_prefix: str) -> str:
    problems = [
        f"environment variable {name} is not a setting" + (f" (did you mean {' or '.join(close)}?)" if close else "")
        for name, close in unknown.items()
    ]
    return f"{'; '.join(problems)}; --help lists every {env_prefix}* variable"


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
