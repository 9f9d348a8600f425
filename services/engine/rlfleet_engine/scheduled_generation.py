"""What both engine cores (the model's `EngineCore` and the `sim` backend's `SimEngineCore`) do alike over
their schedulers: refuse a request whose rid is already in flight, answer a generate request whole or as a
stream from the outputs its jobs deliver, abort the jobs a caller leaves, pass abort, pause (in SGLang's
modes) and resume on to the scheduler, describe the engine (SGLang's /get_model_info and /get_server_info),
and refuse a disk weight load that names no directory or is in a format the engines do not read.

Outputs arrive per request as (index of the job in the request, SGLang-shaped output), the latest unread one of
each job (`LatestOutputs`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Protocol

from rlfleet.errors import InvalidInput
from rlfleet_engine import __version__
from rlfleet_engine.config import EngineConfig, blank_path_problem
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.latest_outputs import LatestOutputs
from rlfleet_engine.metrics import EngineMetrics
from rlfleet_engine.schemas import GenerateRequest, PauseMode, UpdateWeightsFromDiskRequest

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "auto", "safetensors")
PAUSE_WAIT_S = 10.0
"""Bound on how long a pause waits for the step under way to end and, in "abort" mode, for its aborts to be
answered. Both happen between two steps, within one step unless a weight load holds the scheduler; past the
bound the pause answers anyway, and no step starts after the one under way (the aborts still run first)."""


def check_disk_load(req: UpdateWeightsFromDiskRequest) -> None:
    """InvalidInput unless the load names a directory and reads a Hugging Face checkpoint's safetensors, as both
    cores take it; checked before the load aborts or holds any request."""
    problem = blank_path_problem("model_path", req.model_path)
    if problem is not None:
        raise InvalidInput(problem)
    if req.load_format not in LOAD_FORMATS:
        raise InvalidInput(f"load_format {req.load_format!r} is not supported; use 'auto' or 'safetensors'")


class JobScheduler(Protocol):
    @property
    def weight_version(self) -> str: ...

    @property
    def peak_batch_size(self) -> int: ...

    @property
    def paused(self) -> bool: ...

    def counts(self) -> tuple[int, int]:
        """Requests running, requests waiting."""
        ...

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """Aborts the job `rid` and those whose rid starts with `rid_` (SGLang's /abort_request), or all."""
        ...

    def abort_jobs(self, jobs: Sequence[GenerationJob]) -> None:
        """Aborts exactly `jobs`."""
        ...

    def set_paused(self, paused: bool) -> None: ...

    def between_steps(self) -> Awaitable[object]:
        """Completes once every step begun before the call has ended (the barrier of a pause)."""
        ...


class ModelFacts(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    def describe(self) -> dict[str, Any]:
        """Model facts for /get_model_info (model_type, architectures, ...)."""
        ...


class ScheduledGeneration(ABC):
    config: EngineConfig
    model_path: str
    backend: ModelFacts
    metrics: EngineMetrics
    scheduler: JobScheduler
    in_flight: dict[str, GenerationJob]
    """Submitted jobs by rid, until their request is answered (one aborted there and not yet finished, until the
    next submission)."""
    _paused_at: float | None = None
    """time.monotonic() of the /pause_generation in force, if any."""

    @abstractmethod
    def _submit(self, req: GenerateRequest) -> tuple[Sequence[GenerationJob], LatestOutputs]:
        """Checks `req`, hands its jobs (one per prompt and sample) to the scheduler, returns them and their outputs."""

    def _claim_rids(self, jobs: Sequence[GenerationJob]) -> None:
        """Records `jobs` as in flight; refuses them all if one's rid already is, as SGLang does: aborts go by
        rid, so a client leaving would otherwise abort another client's request too."""
        self.in_flight = {rid: job for rid, job in self.in_flight.items() if job.finish is None}
        taken = next((job.rid for job in jobs if job.rid in self.in_flight), None)
        if taken is not None:
            raise InvalidInput(f"Duplicate request ID detected: {taken}")
        self.in_flight.update((job.rid, job) for job in jobs)

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    async def generate(self, req: GenerateRequest) -> dict[str, Any] | list[dict[str, Any]]:
        """Runs `req` to the end; a single prompt with n == 1 answers one object, anything else a list."""
        jobs, queue = self._submit(req)
        results: list[dict[str, Any] | None] = [None] * len(jobs)
        try:
            while any(r is None for r in results):
                index, out = await queue.get()
                if out["meta_info"]["finish_reason"] is not None:
                    results[index] = out
        finally:
            self._abort_unfinished(jobs)
            self._forget(jobs)
        done = [r for r in results if r is not None]
        return done[0] if len(jobs) == 1 and not req.is_batch else done

    def generate_stream(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Submits `req` now (so bad input raises before a response starts) and returns its output stream.

        Chunks are cumulative, as SGLang streams by default; batch chunks carry the item's `index`.
        """
        jobs, queue = self._submit(req)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            pending = len(jobs)
            try:
                while pending:
                    index, out = await queue.get()
                    if len(jobs) > 1 or req.is_batch:
                        out["index"] = index
                    if out["meta_info"]["finish_reason"] is not None:
                        pending -= 1
                    yield out
            finally:
                self._abort_unfinished(jobs)
                self._forget(jobs)

        return chunks()

    def _abort_unfinished(self, jobs: Sequence[GenerationJob]) -> None:
        # A caller that went away (disconnect, cancellation) should not keep a batch row busy. Its own jobs only:
        # an abort by rid would also take another request's, whose rid is this one's plus `_<k>`.
        unfinished = [job for job in jobs if job.finish is None]
        if unfinished:
            self.scheduler.abort_jobs(unfinished)

    def _forget(self, jobs: Sequence[GenerationJob]) -> None:
        """Lets a request's finished jobs go once it is answered: they hold its prompt and outputs."""
        for job in jobs:
            if job.finish is not None and self.in_flight.get(job.rid) is job:
                del self.in_flight[job.rid]

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """SGLang's /abort_request: the request `rid` and a batch's `rid_<k>`, or all. An empty rid names none (by
        prefix it would name every rid starting with "_")."""
        if rid or abort_all:
            self.scheduler.abort(rid, abort_all)

    def flush_cache(self) -> bool:
        """POST /flush_cache: empties the prefix cache, as SGLang does, only with no request running or waiting
        (their blocks are in use); False, nothing done, otherwise."""
        running, waiting = self.scheduler.counts()
        if running or waiting:
            return False
        self._empty_cache()
        return True

    @abstractmethod
    def _empty_cache(self) -> None:
        """Empties the prefix cache."""

    async def pause(self, mode: PauseMode) -> None:
        """SGLang's /pause_generation: nothing is admitted or decoded until `resume`; requests sent meanwhile wait.

        A barrier: it returns once the step under way (if any) has ended, so no token comes out after it,
        least of all one labelled with a version loaded during the pause. "abort" first ends every request in
        flight, running or waiting, as /abort_request with abort_all does (each answered with the tokens it has),
        and returns once they are answered. "retract" and "in_place" hold them where they are (what becomes of
        their KV cache on a weight load is the backend's: see its `update_weights_from_disk`).
        Bounded by PAUSE_WAIT_S.
        """
        self._paused_at = time.monotonic()
        self.scheduler.set_paused(True)
        deadline = time.monotonic() + PAUSE_WAIT_S
        if mode == "abort":
            # The jobs submitted before this call, not abort_all: a request sent once the pause is in force waits.
            ending = [job for job in self.in_flight.values() if job.finish is None]
            self.scheduler.abort_jobs(ending)
            while any(job.finish is None for job in ending):
                if time.monotonic() > deadline:
                    logger.warning("paused; %d aborted requests not answered within %.0fs", len(ending), PAUSE_WAIT_S)
                    return
                await asyncio.sleep(0.005)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self.scheduler.between_steps()
        except TimeoutError:
            logger.warning("paused; the step under way did not end within %.0fs", PAUSE_WAIT_S)

    def resume(self) -> None:
        self._paused_at = None
        self.scheduler.set_paused(False)

    def paused_too_long(self) -> bool:
        """True once generation has been paused for over `config.max_pause_s` (see there why that is unhealthy)."""
        return self._paused_at is not None and time.monotonic() - self._paused_at > self.config.max_pause_s

    def model_info(self) -> dict[str, Any]:
        facts = self.backend.describe()
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.config.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": facts.get("model_type"),
            "architectures": facts.get("architectures"),
        }

    def server_info(self) -> dict[str, Any]:
        running, waiting = self.scheduler.counts()
        context = self.backend.context_length
        return {
            **self.config.model_dump(),
            "model_path": self.model_path,
            "weight_version": self.weight_version,
            "context_length": context,
            "dp_size": 1,
            "tp_size": 1,
            "pp_size": 1,
            "max_req_input_len": context - 1,
            "max_total_num_tokens": context * self.config.max_running_requests,
            "internal_states": [
                {
                    "num_running_reqs": running,
                    "num_queue_reqs": waiting,
                    "peak_batch_size": self.scheduler.peak_batch_size,
                    "paused": self.scheduler.paused,
                    "last_gen_throughput": self.metrics.last_gen_throughput,
                }
            ],
            "version": __version__,
            "engine": "rlfleet-engine",
        }
