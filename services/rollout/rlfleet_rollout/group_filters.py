"""Group filters: named rules that keep a scored SampleGroup away from the trainer (the step refills it).

A filter is a function `(group) -> bool`, True when the group should be dropped, registered under
a name in the `rlfleet.rollout.group_filters` entry-point group:

    [project.entry-points."rlfleet.rollout.group_filters"]
    my_filter = "my_package.filters:my_filter"

Runs name the filters they want in `rollout.filters`; unknown names are refused at submit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Protocol

from rlfleet.errors import InvalidInput
from rlfleet.v1.samples_pb2 import SampleGroup, SampleStatus

ENTRY_POINT_GROUP = "rlfleet.rollout.group_filters"
# Samples with no response to train or reward to count: generation or scoring failed, or was cut off.
UNUSABLE = (SampleStatus.SAMPLE_STATUS_FAILED, SampleStatus.SAMPLE_STATUS_ABORTED)


class GroupFilter(Protocol):
    def __call__(self, group: SampleGroup) -> bool: ...


def usable_rewards(group: SampleGroup) -> list[float]:
    return [s.reward for s in group.samples if s.status not in UNUSABLE]


def zero_variance(group: SampleGroup) -> bool:
    """Every usable sample earned the same reward: group-relative advantages are all zero."""
    rewards = usable_rewards(group)
    return len(rewards) < 2 or max(rewards) == min(rewards)


def all_failed(group: SampleGroup) -> bool:
    """No sample could be generated and scored."""
    return not usable_rewards(group)


def any_failed(group: SampleGroup) -> bool:
    """At least one sample could not be generated or scored."""
    return any(s.status in UNUSABLE for s in group.samples)


def all_truncated(group: SampleGroup) -> bool:
    """Every sample was cut at max_new_tokens."""
    return all(s.status == SampleStatus.SAMPLE_STATUS_TRUNCATED for s in group.samples)


class FilterRegistry:
    def __init__(self, filters: Mapping[str, GroupFilter]) -> None:
        self._filters = dict(filters)

    @classmethod
    def from_entry_points(cls, extra: Mapping[str, GroupFilter] | None = None) -> FilterRegistry:
        found: dict[str, GroupFilter] = {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}
        found.update(extra or {})
        return cls(found)

    def names(self) -> list[str]:
        return sorted(self._filters)

    def check(self, names: Sequence[str]) -> None:
        """InvalidInput naming `rollout.filters[i]` for the first unknown name."""
        for i, name in enumerate(names):
            if name not in self._filters:
                raise InvalidInput(f"rollout.filters[{i}]: unknown group filter {name!r}; known: {self.names()}")

    def reason_to_drop(self, names: Sequence[str], group: SampleGroup) -> str | None:
        """The name of the first filter in `names` that drops `group`, None if it passes them all."""
        for name in names:
            if self._filters[name](group):
                return name
        return None
