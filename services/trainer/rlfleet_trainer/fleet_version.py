"""Keeps the fleet on the run's weight version while the trainer waits for groups.

The router holds the fleet's version in memory only: one that restarted knows none (GET /weight_version
answers null) and admits each engine on what that engine reports, so an engine that restarted meanwhile
on its boot weights would serve rollouts beside engines on the run's version. While it waits for groups,
the trainer asks the router every `fleet_check_s` which version the fleet serves; when that is not the
run's, it loads the run's version again from its directory, which brings every engine to it. Not while no
complete directory holds the run's version: a disk copy under way registers it itself (through a restarted
router too), and one that failed fails the run at its next publish, checkpoint or end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rlfleet.errors import Conflict, Unavailable
from rlfleet_trainer.active_run import ActiveRun
from rlfleet_trainer.metrics import TrainerMetrics
from rlfleet_trainer.router_client import RouterClient

logger = logging.getLogger(__name__)

QUESTION_TIMEOUT_S = 5.0
"""Bound on asking the router its version: a router that does not answer is asked again at the next check."""


class FleetVersionCheck:
    def __init__(
        self,
        router: RouterClient,
        interval_s: float,
        metrics: TrainerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._interval_s = interval_s
        self._metrics = metrics
        self._clock = clock
        self._next = clock() + interval_s

    def __call__(self, run: ActiveRun) -> None:
        """Once every interval (never when the interval is 0): loads the run's version again if the router
        reports another one, or none."""
        if self._interval_s <= 0 or self._clock() < self._next or run.weights_version != run.weight_version:
            return
        self._next = self._clock() + self._interval_s
        expected = str(run.weight_version)
        try:
            served = self._router.served_version(min(QUESTION_TIMEOUT_S, self._interval_s))
        except Unavailable as exc:
            logger.warning("could not ask the router which weight version the fleet serves: %s", exc)
            return
        if served == expected:
            return
        logger.warning(
            "the router reports weight version %s, not run %s's %s (it restarted, or another load went through "
            "it); loading version %s from %s again",
            "none" if served is None else repr(served),
            run.run_id,
            expected,
            expected,
            run.weights_path,
            extra={"run_id": run.run_id},
        )
        try:
            self._router.load_weights(run.weights_path, run.weight_version)
        except (Unavailable, Conflict) as exc:
            logger.warning("loading weight version %s again failed (tried again at the next check): %s", expected, exc)
            return
        self._metrics.fleet_reloads.inc()
