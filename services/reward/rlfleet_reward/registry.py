"""The reward functions a hub serves, by name, filled from the `rlfleet.reward_functions` entry points.

A package adds a function by declaring an entry point whose value is a `RewardFunction`:

    [project.entry-points."rlfleet.reward_functions"]
    my_reward = "my_package.my_module:MY_REWARD"

Tests (or an embedding program) pass extra functions to `Registry.from_entry_points(extra=...)`
instead of registering them globally.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points

from rlfleet.errors import InvalidInput
from rlfleet_reward.reward_function import RewardFunction, ScoreFn

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rlfleet.reward_functions"


class Registry:
    """An immutable name -> RewardFunction mapping with caller-facing lookups."""

    def __init__(self, functions: Mapping[str, RewardFunction]) -> None:
        for name, function in functions.items():
            if not isinstance(function, RewardFunction):
                raise TypeError(f"reward function {name!r} is a {type(function).__name__}, not a RewardFunction")
        self._functions = dict(sorted(functions.items()))

    @classmethod
    def from_entry_points(cls, extra: Mapping[str, RewardFunction] | None = None) -> Registry:
        """Loads every entry point of the group; `extra` adds functions but may not shadow one."""
        functions: dict[str, RewardFunction] = {}
        for point in entry_points(group=ENTRY_POINT_GROUP):
            loaded = point.load()
            if not isinstance(loaded, RewardFunction):
                raise TypeError(
                    f"entry point {point.name} = {point.value!r} in group {ENTRY_POINT_GROUP} is a "
                    f"{type(loaded).__name__}; it must name a RewardFunction"
                )
            functions[point.name] = loaded
        for name, function in (extra or {}).items():
            if name in functions:
                raise ValueError(f"reward function {name!r} is already registered by an entry point")
            functions[name] = function
        logger.info("reward functions: %s", ", ".join(sorted(functions)))
        return cls(functions)

    def get(self, name: str) -> RewardFunction:
        try:
            return self._functions[name]
        except KeyError:
            raise InvalidInput(f"unknown reward function {name!r}; known: {', '.join(self._functions)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)

    def items(self) -> Iterator[tuple[str, RewardFunction]]:
        return iter(self._functions.items())

    def pool_functions(self) -> dict[str, ScoreFn]:
        """What runs in worker processes, by function name: each plain function, and each `async def`
        function's `finish`."""
        pooled: dict[str, ScoreFn] = {}
        for name, function in self._functions.items():
            if not function.waits_on_io:
                pooled[name] = function.fn  # type: ignore[assignment]  # a plain function
            elif function.finish is not None:
                pooled[name] = function.finish
        return pooled
