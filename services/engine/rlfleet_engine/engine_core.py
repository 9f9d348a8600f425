"""The transport-free engine: turns API requests into scheduler jobs and scheduler outputs into SGLang's answers.

Everything here runs on the asyncio loop and never touches the model; the scheduler thread does.
Outputs cross from that thread to the loop through `call_soon_threadsafe` onto the request's `LatestOutputs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from prometheus_client import CollectorRegistry

from rlfleet.errors import DeadlineExceeded
from rlfleet_engine.backend import GenerationBackend
from rlfleet_engine.config import EngineConfig
from rlfleet_engine.distributed_weights import WeightReceiver
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.latest_outputs import LatestOutputs
from rlfleet_engine.metrics import EngineMetrics
from rlfleet_engine.request_expansion import expand
from rlfleet_engine.sampler import seeded_generator
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.scheduled_generation import ScheduledGeneration, check_disk_load
from rlfleet_engine.scheduler import Scheduler
from rlfleet_engine.schemas import GenerateRequest, UpdateWeightsFromDiskRequest, UpdateWeightsFromDistributedRequest

# Bound on a weight load, including the wait for the current step to end.
WEIGHT_LOAD_TIMEOUT_S = 300.0


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class EngineCore(ScheduledGeneration):
    backend: GenerationBackend
    scheduler: Scheduler

    def __init__(
        self,
        config: EngineConfig,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_path = config.model_path
        self.metrics = EngineMetrics(registry, config.served_model_name or config.model_path)
        self.in_flight = {}
        self.scheduler = Scheduler(
            backend,
            tokenizer,
            self.metrics,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            weight_version=config.weight_version,
            seed=config.random_seed,
        )
        # A backend that declares no parameters (a test's stand-in) has versions taken unchecked, as the sim's are.
        parameter_names = getattr(backend, "parameter_names", None)
        self.weight_receiver = WeightReceiver(
            check=backend.check_tensors,
            apply=self._load_received,
            abort_all=lambda: self.scheduler.abort("", abort_all=True),
            timeout_s=self.config.weight_group_timeout_s,
            parameters=None if parameter_names is None else parameter_names(),
        )

    @property
    def weights_partial(self) -> bool:
        """Whether the weights hold part of a version sent in buckets, under the old label (`WeightReceiver`)."""
        return self.weight_receiver.partial

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # ---- generation ----------------------------------------------------------------------------

    def _submit(self, req: GenerateRequest) -> tuple[list[GenerationJob], LatestOutputs]:
        specs = expand(req, self.tokenizer, self.backend.vocab_size, self.backend.context_length)
        loop = asyncio.get_running_loop()
        queue = LatestOutputs()

        def deliverer(index: int):  # noqa: ANN202 - a closure per job
            def deliver(out: dict[str, Any]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closing: nobody is waiting any more
                    loop.call_soon_threadsafe(queue.put_nowait, (index, out))

            return deliver

        jobs = [
            GenerationJob(
                rid=spec.rid,
                input_ids=spec.input_ids,
                params=spec.params,
                deliver=deliverer(k),
                return_logprob=spec.return_logprob,
                top_logprobs_num=spec.top_logprobs_num,
                return_text_in_logprobs=req.return_text_in_logprobs,
                stream=req.stream,
                log_metrics=req.log_metrics,
                generator=seeded_generator(spec.params.sampling_seed, spec.sample_index),
            )
            for k, spec in enumerate(specs)
        ]
        self._claim_rids(jobs)
        self.scheduler.submit(jobs)
        return jobs, queue

    def _empty_cache(self) -> None:
        """Nothing to drop: no prefix cache is kept across requests."""

    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        check_disk_load(req)
        if req.abort_all_requests:
            self.scheduler.abort("", abort_all=True)

        def load_from_disk(backend: GenerationBackend) -> None:
            backend.load_weights(req.model_path)
            self.model_path = req.model_path  # here, not after the await: a load that outlives its caller ends too

        held = await self._load(load_from_disk, req.weight_version, req.model_path)
        self.weight_receiver.whole_version_loaded()
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": held}

    async def _load_received(self, tensors: dict[str, torch.Tensor], req: UpdateWeightsFromDistributedRequest) -> int:
        source = f"weight update group {req.group_name!r}"
        return await self._load(lambda backend: backend.load_tensors(tensors, source), req.weight_version, source)

    async def _load(self, load: Callable[[GenerationBackend], None], version: str | None, source: str) -> int:
        """Runs `load` between two decode steps; returns how many running requests it held.

        Past WEIGHT_LOAD_TIMEOUT_S the caller is answered DeadlineExceeded. A load that has not started by
        then never will; one that has started cannot be stopped halfway (that would leave a mix of two
        versions), so it runs to its end and the answer says so."""
        future = self.scheduler.call(lambda: self.scheduler.load_weights(load, version))
        try:
            async with asyncio.timeout(WEIGHT_LOAD_TIMEOUT_S):
                return int(await asyncio.wrap_future(future))
        except TimeoutError as exc:
            if future.cancel():  # True only if it had not started: then it never will
                raise DeadlineExceeded(
                    f"loading weights from {source} did not start within {WEIGHT_LOAD_TIMEOUT_S:.0f}s (the scheduler "
                    "was busy with another operation); nothing was loaded"
                ) from exc
            if future.done():  # it ended just now
                return int(future.result())
            raise DeadlineExceeded(
                f"loading weights from {source} took over {WEIGHT_LOAD_TIMEOUT_S:.0f}s and is still in progress (a "
                "started load runs to its end); GET /get_model_info shows the weight version once it has ended"
            ) from exc

    async def health_generate(self) -> bool:
        """True if the scheduler produces a token within the health-check timeout (or is busy doing so), or
        generation has been paused for no longer than `config.max_pause_s`."""
        timeout = self.config.health_check_timeout_s
        if not self.scheduler.alive():
            return False
        if self.scheduler.paused:
            return not self.paused_too_long()
        running, _ = self.scheduler.counts()
        if running and time.monotonic() - self.scheduler.last_step_at < timeout:
            return True
        req = GenerateRequest(
            input_ids=[0],
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            log_metrics=False,
        )
        try:
            async with asyncio.timeout(timeout):
                await self.generate(req)
        except TimeoutError:
            return False
        return True
