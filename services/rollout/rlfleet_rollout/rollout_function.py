"""Rollout functions and environments by name, filled from entry points and checked when a run is submitted.

A rollout function turns one prompt into one scored SampleGroup of `rollout.group_size` samples:

    async def my_rollout(ctx: RolloutContext, request: GroupRequest) -> SampleGroup:
        ...  # ctx.generate / ctx.generate_turn, ctx.score, then build_sample and finish_group

    # pyproject.toml of the package that holds it
    [project.entry-points."rlfleet.rollout_functions"]
    my_rollout = "my_package.rollouts:my_rollout"

A run names it in `rollout.function`; environments (`rollout.multi_turn.environment`, see
`environment.py`) come from the group `rlfleet.rollout.environments`. An unknown name is refused
at submit, naming the known ones, not hours into the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Protocol

from rlfleet.errors import InvalidInput
from rlfleet.v1.runs_pb2 import RolloutSpec
from rlfleet.v1.samples_pb2 import SampleGroup
from rlfleet_rollout.environment import ENTRY_POINT_GROUP as ENVIRONMENT_GROUP
from rlfleet_rollout.environment import Environment
from rlfleet_rollout.group_producer import GroupRequest, RolloutContext

FUNCTION_GROUP = "rlfleet.rollout_functions"


class RolloutFunction(Protocol):
    async def __call__(self, ctx: RolloutContext, request: GroupRequest) -> SampleGroup: ...


class RolloutRegistry:
    def __init__(self, functions: Mapping[str, RolloutFunction], environments: Mapping[str, Environment]) -> None:
        for name, env in environments.items():
            if isinstance(env, type):  # the protocol check passes a class: its reply is an unbound function
                raise TypeError(
                    f"environment {name!r} is the class {env.__name__}, not an instance of it: register an object, "
                    f"e.g. `{name} = {env.__name__}()`"
                )
            if not isinstance(env, Environment):
                raise TypeError(f"environment {name!r} is a {type(env).__name__} without a reply(prompt, turns) method")
        self._functions = dict(functions)
        self._environments = dict(environments)

    @classmethod
    def from_entry_points(cls) -> RolloutRegistry:
        return cls(
            {ep.name: ep.load() for ep in entry_points(group=FUNCTION_GROUP)},
            {ep.name: ep.load() for ep in entry_points(group=ENVIRONMENT_GROUP)},
        )

    def check(self, rollout: RolloutSpec) -> None:
        """InvalidInput naming the field when the spec names a function or environment that is not registered."""
        if rollout.function not in self._functions:
            raise InvalidInput(
                f"rollout.function: unknown rollout function {rollout.function!r}; known: {sorted(self._functions)}"
            )
        name = rollout.multi_turn.environment
        if rollout.HasField("multi_turn") and name not in self._environments:
            raise InvalidInput(
                f"rollout.multi_turn.environment: unknown environment {name!r}; known: {sorted(self._environments)}"
            )

    def function(self, name: str) -> RolloutFunction:
        return self._functions[name]

    def environment(self, name: str) -> Environment | None:
        """The environment registered as `name`; None for "" (a run without one)."""
        return self._environments[name] if name else None
