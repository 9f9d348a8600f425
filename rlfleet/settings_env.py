"""The environment variables of a service's settings class: the variable of each setting, and the
variables under the class's prefix that set nothing.

pydantic-settings ignores a variable that names no field, even under `extra="forbid"`, so a misspelled
`RLFLEET_ROLLOUT_STEP_TIMEOUT` (the setting is `..._STEP_TIMEOUT_S`) would silently change nothing.
rlfleet's settings are read as pydantic-settings reads them by default: a field's variable is the
prefix and the field's name, in any case; a class that reads them otherwise (aliases, a nested
delimiter, case-sensitive names) is refused here rather than checked by a rule that does not hold for it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping

from pydantic_settings import BaseSettings

# Kubernetes gives every pod variables named after each Service of its namespace: with the chart's
# names (`helm install rlfleet` makes Service `rlfleet-router`) they fall under a service's own prefix,
# e.g. RLFLEET_ROUTER_SERVICE_HOST, RLFLEET_ROUTER_PORT_30000_TCP_ADDR, RLFLEET_TRAINER_PORT=tcp://...
_SERVICE_LINK = re.compile(r"(\w+_)?(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)")
_SERVICE_LINK_PORT = re.compile(r"(\w+_)?PORT")  # its value is tcp://host:port, unlike a setting's
_CLOSE = 0.6  # difflib's own cutoff for a close match
_ABOUT_AS_CLOSE = 0.05


def setting_variables(settings_class: type[BaseSettings]) -> dict[str, str]:
    """Field name -> the variable that sets it, as a user writes it."""
    prefix = _prefix(settings_class)
    return {name: f"{prefix}{name}".upper() for name in settings_class.model_fields}


def unknown_variables(settings_class: type[BaseSettings], environ: Mapping[str, str]) -> dict[str, list[str]]:
    """Each variable of `environ` under the class's prefix that sets no field -> the closest real variables
    (best first, possibly none)."""
    prefix = _prefix(settings_class).upper()
    if not prefix:  # without a prefix every variable of the process would be suspect
        return {}
    known = set(setting_variables(settings_class).values())
    unknown: dict[str, list[str]] = {}
    for variable, value in environ.items():
        name = variable.upper()
        if not name.startswith(prefix) or name in known:
            continue
        rest = name.removeprefix(prefix)
        if not _is_service_link(rest, value):
            unknown[variable] = _closest(rest, prefix, known)
    return unknown


def _prefix(settings_class: type[BaseSettings]) -> str:
    config = settings_class.model_config
    aliased = [name for name, f in settings_class.model_fields.items() if f.alias or f.validation_alias]
    if config.get("case_sensitive") or config.get("env_nested_delimiter") or aliased:
        raise TypeError(
            f"{settings_class.__name__}: variables are checked as prefix + field name in any case; this class "
            f"reads them otherwise (case_sensitive, env_nested_delimiter, or aliases on {aliased})"
        )
    return config.get("env_prefix", "")


def _is_service_link(rest: str, value: str) -> bool:
    """Whether `PREFIX_<rest>=<value>` is a Kubernetes service link (see above)."""
    if _SERVICE_LINK.fullmatch(rest):
        return True
    return bool(_SERVICE_LINK_PORT.fullmatch(rest)) and value.lower().startswith(("tcp://", "udp://", "sctp://"))


def _closest(rest: str, prefix: str, variables: Iterable[str]) -> list[str]:
    # Compared without the prefix they share, which would make any two names look alike; only the
    # closest and any about as close, so a near miss gets one answer, not a list of every *_TIMEOUT_S.
    scored = sorted(
        ((difflib.SequenceMatcher(None, rest, v.removeprefix(prefix)).ratio(), v) for v in variables),
        reverse=True,
    )
    if not scored or scored[0][0] < _CLOSE:
        return []
    return [v for score, v in scored[:3] if score >= scored[0][0] - _ABOUT_AS_CLOSE]
