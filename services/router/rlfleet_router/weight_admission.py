"""The rejoin rule: an engine enters routing only holding the fleet's current weight load.

A version label does not name weights: every run starts at "0", engines boot as "0", and one run's "2"
is not another's. So the rule does not compare labels. An engine that enters routing (new, taken out,
restarted, hung and back: it forgot its load when it left) loads the fleet's target first, unless the
router saw it apply that very load (`Worker.weight_load`) and it does not report holding part of a version
since. Two exceptions, both on what the engine reports (`ServedWeights`, its version and model path):
  * with no target (nothing was loaded through this router: engines on their boot weights, or a router
    that restarted and so knows nothing of the fleet) it joins on what it reports, as the router knows no
    better. An engine a weight update group left holding part of a version does not: it waits for the
    next fleet update, stranded. Nor does one that reports holding part of a version (`ServedWeights.partial`:
    it took buckets through a router that restarted since, under its old label);
  * an engine a fleet update gave up waiting for that now reports that update's version and path finished
    it (SGLang ends a load whose caller left): the version becomes the fleet's, rather than the engine
    being loaded back to the older one (`FleetWeights.adopt`).

It also enters routing in line with the fleet's generation pause (`FleetPause.match`): an engine the
router paused that missed the continue (it was out of routing, or hung, when the continue was fanned
out) is sent /continue_generation, else it would hold every request routed to it; one that joins while
the fleet is paused is sent the fleet's /pause_generation, and the fleet's continue, which goes to every
engine, reaches it like the others.

The engine enters routing under the fleet's weight lock, and only if it holds the current load and is in
line with the current pause at that moment, so neither a fleet update nor a pause or continue can slip in
between and leave it routable on the previous one. Its slow calls (reading what it serves, loading the
target, the pause or continue) happen outside the lock: one slow engine holds up no fleet update and no
other admission; a fleet update, pause or continue that began meanwhile sends it round again. Stranded
engines that a fleet update loads (`FleetWeights.update_fleet`) enter routing through `rejoin`, in line
with the pause the same way.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.errors import Unavailable
from rlfleet_router.busy_engines import LOADING
from rlfleet_router.fleet_pause import FleetPause
from rlfleet_router.weights import DISK_UPDATE_ROUTE, FleetWeights, ServedWeights, WeightTarget
from rlfleet_router.workers import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

STOPPED = "its admission stopped"
ADMIT_ROUNDS = 3
"""Rounds of loading and matching the fleet's pause an engine may do to rejoin, when the fleet's version or pause
moves on meanwhile."""


class Admission:
    def __init__(self, weights: FleetWeights, workers: WorkerRegistry, pauses: FleetPause) -> None:
        self._weights = weights
        self._workers = workers
        self._pauses = pauses

    async def admit(self, worker: Worker) -> None:
        """Brings `worker` to the fleet's target, then into routing; Unavailable if it cannot get there, or
        was removed from the fleet."""
        weights = self._weights
        if weights.busy.reason(worker) == LOADING:
            raise Unavailable("a weight request of the router is still pending at this engine; it rejoins after it")
        reported_at = worker.weight_load  # the fleet load last recorded at the engine when `served` was read
        served = await self._workers.while_member(worker, weights.served_weights(worker), STOPPED)
        matched: int | None = None  # the pause turn the engine was last brought in line with
        for _ in range(ADMIT_ROUNDS):
            async with weights.lock:
                if worker.weight_load == reported_at:
                    worker.weight_version, worker.model_path = served.version, served.model_path  # as it reports now
                else:  # a fleet load reached the engine after it reported: what that load recorded is newer
                    served, reported_at = ServedWeights(worker.weight_version, worker.model_path), worker.weight_load
                self._adopt_if_finished(worker, served)
                target, load = weights.target, weights.loads
                if served.partial and (target is None or target.request_body is None):
                    # Paused mid-version by a trainer the router may not know of: its probes may not pass again
                    # before that trainer's disk fallback, which takes stranded engines along.
                    weights.stranded[worker.id] = worker
                if target is None and worker.id in weights.stranded:
                    held = (
                        "reports holding part of a weight version (buckets of one whose last bucket it has not applied)"
                        if served.partial
                        else "may hold part of a weight version (its weight update group broke)"
                    )
                    raise Unavailable(
                        f"this engine {held} and the fleet has no version to load into it; the next fleet weight "
                        "update brings it back"
                    )
                holds = (target is None or worker.weight_load == load) and not served.partial
                if holds and matched is not None and self._enters(worker, matched):
                    return
                if not holds:
                    assert target is not None
                    if target.request_body is None:
                        raise Unavailable(
                            f"the fleet serves weight version {target.version!r}, received over a weight update "
                            "group; its disk copy is not registered yet, so this engine cannot load it"
                        )
                    # Loaded by this admission from here on (no await before `busy.loading`): no fleet update takes it.
                    weights.stranded.pop(worker.id, None)
            if not holds:
                assert target is not None
                served = await self._load(worker, served, target, load)
                reported_at = worker.weight_load
            # Paused or continued only holding a whole version: an engine holding part of one must not generate.
            matched = await self._workers.while_member(worker, self._pauses.match(worker), STOPPED)
        raise Unavailable(
            f"the fleet's weight version or generation pause changed {ADMIT_ROUNDS} times while this engine "
            "rejoined; it tries again after its next successful probe"
        )

    async def rejoin(self, loaded: list[Worker]) -> None:
        """Brings into routing the stranded engines a fleet update has just `loaded` whole (call with the weight
        lock held), each once in line with the fleet's pause; one that is not stays out and rejoins by `admit`."""
        matched = await asyncio.gather(*(self._match_or_none(w) for w in loaded))
        for worker, turn in zip(loaded, matched, strict=True):
            if turn is not None:
                self._enters(worker, turn)

    def _enters(self, worker: Worker, turn: int) -> bool:
        """Brings `worker`, holding the fleet's load and in line with its pause at `turn`, into routing (call with
        the weight lock held), unless the pause moved since; True unless it must be matched again."""
        if not self._pauses.joins(worker, turn):
            return False
        if self._workers.contains(worker):
            self._workers.admit(worker)
        return True

    async def _match_or_none(self, worker: Worker) -> int | None:
        try:
            return await self._pauses.match(worker)
        except Unavailable as exc:
            logger.warning("worker %s loaded the fleet's weights but stays out of routing: %s", worker.url, exc)
            return None

    async def _load(self, worker: Worker, served: ServedWeights, target: WeightTarget, load: int) -> ServedWeights:
        """Loads `target`, fleet load `load`, into `worker`, which serves `served`; returns what it serves then."""
        weights = self._weights
        request_body = target.request_body
        assert request_body is not None, "a target without a disk copy cannot be loaded"
        logger.info(
            "worker %s serves weight version %r (from %s), the fleet %r: loading it before it rejoins",
            worker.url,
            served.version,
            served.model_path,
            target.version,
        )
        with weights.busy.loading([worker]):
            load_call = weights.load_from_disk(worker, request_body)
            result = await self._workers.while_member(worker, load_call, STOPPED)
        if not result.success:
            raise Unavailable(f"could not load weight version {target.version!r}: {result.message}")
        weights.loaded(DISK_UPDATE_ROUTE, request_body, [worker])
        weights.record_served(worker, target, load)
        return ServedWeights(target.version, target.model_path)

    def _adopt_if_finished(self, worker: Worker, served: ServedWeights) -> None:
        """Records that `worker` holds the last unconfirmed fleet update (call with the lock held) if it is one
        that update did not hear back from and it reports that update's version and model path."""
        unconfirmed = self._weights.unconfirmed
        if unconfirmed is None or worker.id not in unconfirmed.engines:
            return
        target = unconfirmed.target
        if served != ServedWeights(target.version, target.model_path):
            return
        load = unconfirmed.adopted_as
        if load is None:
            logger.warning(
                "worker %s serves weight version %r, which the fleet update gave up waiting for: it is the fleet's "
                "version now (was %r)",
                worker.url,
                target.version,
                self._weights.version,
            )
            load = self._weights.adopt(unconfirmed)
        self._weights.record_served(worker, target, load)
