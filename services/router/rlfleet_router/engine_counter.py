"""A Prometheus counter labelled by engine whose series exist only while the router has that engine.

prometheus' `labels()` creates whatever series it is asked for. A request, stream, probe or restart that ends
after its engine left the fleet (removed with requests still in flight there) would count under the engine's URL
and so bring back the series `RouterMetrics.forget_engine` had just dropped, for as long as the router runs:
engines that come and go by pod IP would add series without end. Here only `add` creates series, and a count for
an engine the router does not have (any more) goes nowhere.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter


class EngineCounter:
    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        *,
        by: str | None = None,
        values: Sequence[str] = (),
    ) -> None:
        """A counter labelled `engine`, and `by` when given, which takes each of `values` (all created at 0)."""
        assert (by is None) == (not values), "a second label needs its values: every series starts at 0"
        self._name = name
        self._counter = Counter(name, documentation, ["engine"] if by is None else ["engine", by], registry=registry)
        self._values: tuple[tuple[str, ...], ...] = tuple((v,) for v in values) if by is not None else ((),)
        # By label values, engine first: a lookup on the generation path, where `labels()` validates and locks.
        self._children: dict[tuple[str, ...], Counter] = {}

    def add(self, engine: str) -> None:
        """Creates `engine`'s series at 0 (those it has keep their values)."""
        for values in self._values:
            key = (engine, *values)
            if key not in self._children:
                self._children[key] = self._counter.labels(*key)

    def forget(self, engine: str) -> None:
        """Drops `engine`'s series; counts for it go nowhere until it is added again."""
        for values in self._values:
            self._children.pop((engine, *values), None)
        self._counter.remove_by_labels({"engine": engine})

    def inc(self, engine: str, *values: str, amount: float = 1.0) -> None:
        """Counts `amount` for `engine` (and the value of `by`), if the router has the engine."""
        child = self._children.get((engine, *values))
        if child is None:
            assert values in self._values, f"{self._name}: {values} are not among its label values"
            return
        child.inc(amount)
