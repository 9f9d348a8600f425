"""Command-line help that states each option's default, for the `rlfleet` command and the services' subcommands."""

from __future__ import annotations

import argparse
from typing import Any


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends with the option's default, unless the help already speaks of it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not action.option_strings or unset or "default" in text:
            return action.help
        shown = str(action.default).replace("%", "%%")  # the help is a %-format string
        return f"{text} (default {shown})" if text else f"(default {shown})"


class CommandParser(argparse.ArgumentParser):
    """Every parser of the `rlfleet` command, subcommands' included, shows defaults in its help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)
