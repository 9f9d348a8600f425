"""The batching loop: one worker thread that owns the backend and advances every running sequence together.

Each iteration, between two decode steps, the loop
  1. runs queued aborts, then control operations (weight loads),
  2. admits waiting jobs, first come first served, up to --max-running-requests and while their prefill
     fits --max-prefill-tokens (`prefill_budget`; the first always does): they are prefilled together,
     left-padded, and merged into the running batch (continuous batching), and their first token is sampled,
  3. runs one decode step over all running rows with per-row sampling parameters,
  4. publishes outputs and drops finished rows.
While paused (/pause_generation) only step 1 runs, so a weight load can happen with requests held; a pause
waits for the iteration under way (`between_steps`), so no token comes out once it has answered.
Other threads talk to the loop only through the thread-safe methods below.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from rlfleet.errors import RlfleetError
from rlfleet_engine.backend import GenerationBackend
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.metrics import EngineMetrics
from rlfleet_engine.prefill_budget import PrefillBatch, prefill_batches
from rlfleet_engine.sampler import sample
from rlfleet_engine.stop_conditions import FinishReason, token_finish

logger = logging.getLogger(__name__)

# How long the idle loop sleeps before re-checking for work it was not woken for.
_IDLE_WAIT_S = 0.5


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Scheduler:
    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        metrics: EngineMetrics,
        max_running_requests: int,
        max_prefill_tokens: int,
        weight_version: str,
        seed: int,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.generator = torch.Generator().manual_seed(seed)
        self.peak_batch_size = 0
        self.last_step_at = time.monotonic()
        self._waiting: deque[GenerationJob] = deque()
        self._running: list[GenerationJob] = []
        self._aborts: list[Callable[[GenerationJob], bool]] = []  # each says which jobs it aborts
        self._control: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._paused = False
        self._stopping = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    # ---- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def counts(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        return len(self._running), len(self._waiting)

    def submit(self, jobs: Sequence[GenerationJob]) -> None:
        with self._wake:
            self._waiting.extend(jobs)
            self._wake.notify()

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """Finishes the job `rid` (and `rid_<i>` of a batch) with an abort finish_reason."""
        self._queue_abort(lambda job: abort_all or job.rid == rid or job.rid.startswith(f"{rid}_"))

    def abort_jobs(self, jobs: Sequence[GenerationJob]) -> None:
        """Finishes exactly `jobs` with an abort finish_reason, whatever other jobs' rids look like."""
        own = set(jobs)
        self._queue_abort(lambda job: job in own)

    def _queue_abort(self, matches: Callable[[GenerationJob], bool]) -> None:
        with self._wake:
            self._aborts.append(matches)
            self._wake.notify()

    def set_paused(self, paused: bool) -> None:
        with self._wake:
            self._paused = paused
            self._wake.notify()

    def between_steps(self) -> Awaitable[object]:
        """On the asyncio loop: completes once the step under way (if any) has ended. A control operation runs
        between two steps, in the iteration that reads `paused` as it takes it: after a `set_paused(True)`, once
        this no-op has run, no step is under way and none starts until `set_paused(False)`."""
        return asyncio.wrap_future(self.call(lambda: None))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Runs `fn` in the scheduler thread between two steps (even while paused); its result lands in the future.
        Cancelling the future keeps `fn` from running only if it has not started (`Future.cancel()` says which)."""
        future: Future[Any] = Future()
        with self._wake:
            self._control.append((fn, future))
            self._wake.notify()
        return future

    def load_weights(self, load: Callable[[GenerationBackend], None], weight_version: str | None) -> int:
        """In the scheduler thread only (via `call`): `load` changes the backend's weights (from disk or
        received tensors), then the running rows' KV is recomputed.

        Running requests are held, not dropped: their cache is rebuilt under the new weights, so every
        token they sample afterwards comes from the new version, and their output lists both versions
        (`weight_versions`). A load with abort_all_requests has already aborted them (aborts run before
        control operations), so they were answered with the old version alone. Returns how many
        requests were held.
        """
        load(self.backend)
        if self._running:
            self.backend.keep([])
            sequences = [[*job.input_ids, *job.output_ids[:-1]] for job in self._running]
            for batch in prefill_batches(sequences, self.max_prefill_tokens):  # rows appended in order
                self.backend.add(batch)
        if weight_version is not None:
            self.weight_version = weight_version
        return len(self._running)

    # ---- the scheduler thread ------------------------------------------------------------------

    def _loop(self) -> None:
        logger.info("scheduler started (max %d running requests)", self.max_running_requests)
        while not self._stopping:
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - a failed step must fail its requests, not kill the engine
                logger.exception("scheduler step failed; aborting the running batch")
                self._fail_running("internal error in the engine; see its log")
        logger.info("scheduler stopped")

    def _iterate(self) -> None:
        with self._wake:
            if not self._control and not self._aborts and (self._paused or not (self._waiting or self._running)):
                self._wake.wait(_IDLE_WAIT_S)
            control = list(self._control)
            self._control.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
            paused = self._paused
        # Aborts first: a weight load with abort_all_requests queues its abort before the load, and the
        # aborted requests must be answered with the version that produced their tokens.
        if aborts:
            self._apply_aborts(aborts)
        for fn, future in control:
            self._run_control(fn, future)
        if control and not paused:
            with self._wake:  # a pause may have come during a long control operation (a weight load)
                paused = self._paused
        if not paused:
            self._admit()
            if self._running:
                self._decode_step()
        self._update_gauges()

    def _run_control(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        """Runs `fn` unless its caller gave up first (cancelled the future). Once it runs the future can no
        longer be cancelled, so its real outcome is always what the future holds."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except RlfleetError as exc:
            future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who reports it
            logger.exception("control operation failed")
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _admit(self) -> None:
        admitted = self._take_prefill_batch()
        if not admitted:
            return
        for job in [j for j in admitted if j.params.max_new_tokens == 0]:
            job.finish_with(FinishReason("length", length=0))
            self._publish(job)
        admitted = [j for j in admitted if j.finish is None]
        if not admitted:
            return
        # Running before the prefill, so a failing prefill fails these requests too instead of losing them.
        self._running.extend(admitted)
        logits = self.backend.add([job.input_ids for job in admitted])  # (n, V)
        self.metrics.prompt_tokens.inc(sum(len(job.input_ids) for job in admitted if job.log_metrics))
        self._advance(admitted, logits)

    def _take_prefill_batch(self) -> list[GenerationJob]:
        """Takes waiting jobs in order while batch slots last and their prefill fits `max_prefill_tokens` (the
        first always does). The first that does not fit stops the ones behind it, so a long prompt is not starved
        by shorter ones that would keep fitting. A job asking for no token takes a slot but no prefill."""
        taken: list[GenerationJob] = []
        batch = PrefillBatch(self.max_prefill_tokens)
        with self._wake:
            while self._waiting and len(self._running) + len(taken) < self.max_running_requests:
                job = self._waiting[0]
                if job.params.max_new_tokens and not batch.take(job.input_ids):
                    break
                taken.append(self._waiting.popleft())
        return taken

    def _decode_step(self) -> None:
        batch = len(self._running)
        self.peak_batch_size = max(self.peak_batch_size, batch)
        self.metrics.decode_batch_size.observe(batch)
        logits = self.backend.step([job.output_ids[-1] for job in self._running])  # (B, V)
        self._advance(list(self._running), logits)

    def _advance(self, jobs: list[GenerationJob], logits: torch.Tensor) -> None:
        """Samples one token for each of `jobs` (one row of `logits` each), drops finished rows, publishes. A finished
        job leaves the running batch before its answer is published: a client that has its whole answer and asks
        /flush_cache at once found it still running ("pending requests"), as often as the scheduler thread was slow
        to come back."""
        drawn = sample(
            logits,
            [job.params for job in jobs],
            generator=self.generator,
            top_logprobs_nums=[job.top_logprobs_num for job in jobs],
            row_generators=[job.generator for job in jobs],
        )
        self.metrics.observe_token_gaps(jobs)
        for i, job in enumerate(jobs):
            job.append(drawn.token_ids[i], drawn.logprobs[i], drawn.top_logprobs[i], self.weight_version)
            reason = token_finish(job.output_ids, job.params, self.backend.eos_token_ids)
            if reason is None:
                reason = job.check_stop_strings(self.tokenizer)
            if reason is not None:
                job.finish_with(reason)
        if any(job.finish is not None for job in jobs):
            self._drop_finished()
        for job in jobs:
            if job.finish is not None or job.stream:
                self._publish(job)
        if counted := sum(job.log_metrics for job in jobs):  # not the health probe's token
            self.metrics.observe_generated(counted)
        self.last_step_at = time.monotonic()

    def _drop_finished(self) -> None:
        keep = [i for i, job in enumerate(self._running) if job.finish is None]
        self.backend.keep(keep)
        self._running = [self._running[i] for i in keep]

    def _apply_aborts(self, aborts: list[Callable[[GenerationJob], bool]]) -> None:
        def matches(job: GenerationJob) -> bool:
            return any(abort(job) for abort in aborts)

        with self._wake:
            dropped = [job for job in self._waiting if matches(job)]
            self._waiting = deque(job for job in self._waiting if not matches(job))
        for job in dropped:
            job.finish_with(FinishReason("abort", message="Abort in waiting queue"))
            self._publish(job)
        running = [job for job in self._running if matches(job)]
        for job in running:
            job.finish_with(FinishReason("abort", message="Abort in running batch"))
            self._publish(job)
        if running:
            self._drop_finished()

    def _fail_running(self, message: str) -> None:
        for job in self._running:
            if job.finish is None:
                job.finish_with(FinishReason("abort", message=message))
                self._publish(job)
        self._running = []
        try:
            self.backend.keep([])
        except Exception:  # noqa: BLE001 - the batch is gone either way
            logger.exception("could not clear the backend after a failed step")

    def _publish(self, job: GenerationJob) -> None:
        try:
            job.deliver(job.output(self.tokenizer, self.weight_version))
        except Exception:  # noqa: BLE001 - one broken receiver must not stop the batch
            logger.exception("could not deliver output of %s", job.rid)
        if job.finish is not None and job.log_metrics:
            self.metrics.observe_finished(job)

    def _update_gauges(self) -> None:
        self.metrics.num_running_reqs.set(len(self._running))
        self.metrics.num_queue_reqs.set(len(self._waiting))
        self.metrics.num_used_tokens.set(sum(len(j.input_ids) + len(j.output_ids) for j in self._running))
