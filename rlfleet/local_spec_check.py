"""The checks of a submit that a fleet started from here would make and that need none of its services.

`rlfleet demo` makes them before its minutes of model creation, SFT warm start and fleet start: a spec the
orchestrator would refuse at submit is refused at once. Its services run in this environment and directory, so
the names they know are the entry points registered here (read, not loaded), and a relative dataset path is
resolved against this directory. What needs a service (a reward function's params, the model) stays theirs.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import arithmetic_heldout, relative_note, resolve, validate
from rlfleet.v1.runs_pb2 import RunSpec

# The entry-point groups the services' registries are filled from (a test checks they are the services' own).
REWARD_FUNCTIONS = "rlfleet.reward_functions"
ROLLOUT_FUNCTIONS = "rlfleet.rollout_functions"
ENVIRONMENTS = "rlfleet.rollout.environments"
GROUP_FILTERS = "rlfleet.rollout.group_filters"


def registered(group: str) -> list[str]:
    """The names registered in entry-point `group` in this environment, sorted."""
    return sorted({point.name for point in entry_points(group=group)})


def check_spec_here(spec: RunSpec) -> None:
    """InvalidInput naming the first field that the fleet would refuse at submit, as far as it can be told here."""
    resolved = resolve(spec)
    validate(resolved)
    ro = resolved.rollout
    _require_registered(ro.function, ROLLOUT_FUNCTIONS, "rollout.function", "rollout function")
    if ro.HasField("multi_turn"):
        _require_registered(ro.multi_turn.environment, ENVIRONMENTS, "rollout.multi_turn.environment", "environment")
    for i, name in enumerate(ro.filters):
        _require_registered(name, GROUP_FILTERS, f"rollout.filters[{i}]", "group filter")
    for i, term in enumerate(resolved.reward.terms):
        _require_registered(term.function, REWARD_FUNCTIONS, f"reward.terms[{i}].function", "reward function")
    source = resolved.dataset.WhichOneof("source")
    if source == "arithmetic":
        arithmetic_heldout(resolved.dataset)
    else:
        files = getattr(resolved.dataset, source)
        for field, path in (("path", files.path), ("eval_path", files.eval_path)):
            if path and not Path(path).exists():
                note = relative_note(path, "the fleet")
                raise InvalidInput(f"dataset.{source}.{field}: {path!r} does not exist{note}")


def _require_registered(name: str, group: str, field: str, what: str) -> None:
    known = registered(group)
    if name not in known:
        raise InvalidInput(f"{field}: unknown {what} {name!r}; known: {', '.join(known)}")
