"""A fixed-size pool of worker processes that run reward functions, each call under a hard deadline.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot cancel a running call, so a function
stuck in C code would hold a worker forever. Here the parent owns every worker: it sends a chunk of
items, collects the replies, and when an item overruns its limit SIGKILLs the worker, scores that
item alone as a TIMEOUT, and hands the chunk's unanswered items to the next idle worker. Workers come
from a fork server that has already imported the functions' modules, so a replacement is a fork
(milliseconds), not a fresh interpreter.

Chunks keep the hub's event loop out of the way: a message or two per chunk rather than a round trip
per item, so the workers, not the hub, use the cores. A chunk is about 0.2 s of work (`chunk_sizes`), and a
worker that finishes one goes to the lane that has waited longest (`idle_workers`), so a request behind a
large batch waits for a chunk, not for the batch.

A worker counts as live once it has said READY. When no worker is live and the last
`_FAILED_STARTS_BEFORE_UNAVAILABLE` attempts to start one in a row failed (the fork server can no longer
import a function's module, say), the pool is down: calls waiting for a worker, and every new one, fail at
once with Unavailable naming the last error, rather than wait for a worker that may never come. The pool keeps
trying to start workers meanwhile, and serves again as soon as one starts.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from rlfleet.errors import Unavailable
from rlfleet_reward.chunk_call import ChunkCall, ChunkEnd
from rlfleet_reward.chunk_sizes import ChunkSizes
from rlfleet_reward.idle_workers import IdleWorkers
from rlfleet_reward.reward_function import RewardInput, ScoreFn
from rlfleet_reward.sandbox_memory import MemoryBudget, WorkerMemory, shared_cell
from rlfleet_reward.worker import READY, Chunk, Progress, Reply, worker_main

logger = logging.getLogger(__name__)

# After SIGKILL or a closed pipe a worker is gone within milliseconds; this only bounds the wait.
_EXIT_WAIT_SECONDS = 5.0
_EXIT_STATUS_WAIT_SECONDS = 1.0
# A fork of the preloaded fork server is ready in milliseconds; the first start also imports modules.
_READY_WAIT_SECONDS = 60.0
_RESPAWN_BACKOFF_SECONDS = 1.0
# Failed starts in a row, with no worker live, before waiting callers are told the pool is down: one failure
# can be bad luck (a worker OOM-killed while starting), several in a row mean no worker will start soon.
_FAILED_STARTS_BEFORE_UNAVAILABLE = 3


class JobStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class JobResult:
    status: JobStatus
    score: float = 0.0
    parts: Mapping[str, float] = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0

    @classmethod
    def from_reply(cls, reply: Reply, seconds: float) -> JobResult:
        if reply.timed_out:
            return cls(JobStatus.TIMEOUT, error=reply.error, seconds=seconds)
        if reply.error:
            return cls(JobStatus.ERROR, error=reply.error, seconds=seconds)
        return cls(JobStatus.OK, score=reply.score, parts=reply.parts or {}, seconds=seconds)


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    progress: Progress
    memory: WorkerMemory


class WorkerPool:
    """`size` worker processes; at most `size` chunks run at once, each on its own worker. With a `memory_budget`,
    each worker's sandboxed tests are held to its share of it (`sandbox_memory`)."""

    def __init__(
        self,
        functions: Mapping[str, ScoreFn],
        size: int,
        preload: Iterable[str] = (),
        memory_budget: MemoryBudget | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got size={size}")
        if memory_budget is not None and memory_budget.workers != size:
            raise ValueError(f"the memory budget is split among {memory_budget.workers} workers, the pool has {size}")
        self.size = size
        self.memory_budget = memory_budget
        self._functions = dict(functions)
        self._context = multiprocessing.get_context("forkserver")
        # The fork server is one per process: the first pool to start it decides what it preloads.
        modules = {fn.__module__ for fn in self._functions.values()} | {worker_main.__module__, *preload}
        self._context.set_forkserver_preload(sorted(modules))
        self._workers: set[_Worker] = set()  # live: said READY
        self._starting: set[_Worker] = set()
        self._failed_starts = 0  # in a row
        self._down: Unavailable | None = None
        self._idle: IdleWorkers[_Worker] = IdleWorkers(self._watch, self._unwatch)
        self._chunk_sizes = ChunkSizes()
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: dict[int, deque[int]] = {}  # by id(): each run's items not yet handed to a worker
        self._busy = 0
        self._closed = False
        # Called with the seconds each chunk waited for an idle worker (a metric, say).
        self.on_wait: Callable[[float], None] | None = None

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def waiting(self) -> int:
        """Items not yet handed to a worker: above zero, the pool is saturated."""
        return sum(len(queued) for queued in self._queued.values())

    @property
    def live(self) -> int:
        """Workers that said READY and have not died since."""
        return len(self._workers)

    @property
    def sandbox_memory_held(self) -> int:
        """Bytes the sandboxed tests running now may hold together (what each worker's test may hold, summed)."""
        return sum(worker.memory.held_bytes for worker in self._workers)

    @property
    def down(self) -> Unavailable | None:
        """Why the pool fails every call now (no live worker, and starting one keeps failing); None when it serves."""
        return self._down

    def start(self) -> None:
        """Starts the fork server (importing the functions' modules once) and every worker; call it on the
        event loop that will use the pool, which watches the idle workers."""
        for _ in range(self.size):
            worker = self._start_worker()
            try:
                ready = worker.conn.poll(_READY_WAIT_SECONDS) and worker.conn.recv() == READY
            except (EOFError, OSError):
                worker.process.join(_EXIT_STATUS_WAIT_SECONDS)  # it closed its pipe exiting: for its exit code
                ready = False
            self._check_ready(worker, ready)
            self._release(worker)
        logger.info("reward worker pool started: %d workers", self.size)

    async def run(
        self, function: str, params: Mapping[str, Any], samples: Sequence[RewardInput], timeout: float
    ) -> list[JobResult]:
        """Scores every sample with `function`; one result per sample, in order.

        Each sample's `timeout` counts from when its worker starts it, so queueing behind a large
        batch never causes a TIMEOUT. The wait for idle workers needs no deadline of its own: every
        chunk ahead ends by its items' deadlines, so the wait is bounded by the work queued before.
        """
        results: list[JobResult | None] = [None] * len(samples)
        queued = deque(range(len(samples)))
        self._queued[id(queued)] = queued
        try:
            lanes = min(self.size, len(samples))
            await asyncio.gather(
                *(self._lane(function, params, samples, timeout, queued, results) for _ in range(lanes))
            )
        finally:
            del self._queued[id(queued)]
        assert all(result is not None for result in results), "every item was scored"
        return results  # type: ignore[return-value]

    async def _lane(
        self,
        function: str,
        params: Mapping[str, Any],
        samples: Sequence[RewardInput],
        timeout: float,
        queued: deque[int],
        results: list[JobResult | None],
    ) -> None:
        """Takes an idle worker and the next chunk of `queued`, until none is left."""
        timed = False
        while queued:
            worker = await self._acquire()
            if not queued:  # the other lanes took the rest meanwhile
                self._release(worker)
                return
            size = self._chunk_sizes.size(function, len(queued), self.size, timed)
            indices = [queued.popleft() for _ in range(size)]
            scored = await self._run_chunk(worker, Chunk(function, params, [samples[i] for i in indices]), timeout)
            self._chunk_sizes.observe(function, (result.seconds for result in scored.values()))
            timed = timed or bool(scored)
            for position, result in scored.items():
                results[indices[position]] = result
            # After a timeout or a dead worker, the items left without a result go back to the front.
            queued.extendleft(reversed([index for position, index in enumerate(indices) if position not in scored]))

    async def _acquire(self) -> _Worker:
        asked = time.monotonic()
        while True:
            if self._down is not None:
                raise Unavailable(str(self._down))  # a fresh one per call: each gets its own traceback
            worker = await self._idle.get()
            if worker not in self._workers:
                continue  # handed over as the pool closed, which killed it
            if worker.conn.poll():
                # An idle worker sends nothing: a readable pipe is its EOF, a death not noticed yet.
                self._lost_while_idle(worker)
                continue
            break
        if self.on_wait is not None:
            self.on_wait(time.monotonic() - asked)
        return worker

    async def _run_chunk(self, worker: _Worker, chunk: Chunk, timeout: float) -> dict[int, JobResult]:
        """Results by position in the chunk: every item's, or, when an item timed out or killed its
        worker, that item's and those of the items answered before it; none when the worker was gone
        before the chunk reached it."""
        self._busy += 1
        outcome = None
        try:
            outcome = await ChunkCall(worker.conn, worker.progress, chunk, timeout).run()
            if outcome.end is ChunkEnd.DIED:
                # The pipe closes a moment before the exit status is known; wait that moment, bounded.
                await asyncio.to_thread(worker.process.join, _EXIT_STATUS_WAIT_SECONDS)
        finally:
            self._busy -= 1
            if outcome is not None and outcome.end is ChunkEnd.DONE:
                self._release(worker)
            else:
                # Timed out, died, or the caller went away mid-chunk: the worker's state is unknown.
                self._replace(worker)
        results = {
            position: JobResult.from_reply(reply, reply.seconds) for position, reply in enumerate(outcome.replies)
        }
        if outcome.end is ChunkEnd.TIMEOUT:
            pid = worker.process.pid
            logger.warning("%s exceeded its %g s limit; replaced worker %d", chunk.function, timeout, pid)
            error = f"exceeded its {timeout:g} s time limit"
            results[outcome.culprit] = JobResult(JobStatus.TIMEOUT, error=error, seconds=timeout)
        elif outcome.end is ChunkEnd.DIED:
            error = f"the worker process running it died (exit code {worker.process.exitcode})"
            seconds = time.monotonic() - outcome.started
            results[outcome.culprit] = JobResult(JobStatus.ERROR, error=error, seconds=seconds)
        elif outcome.end is ChunkEnd.LOST:
            logger.warning("reward worker %d was gone before it got a chunk; replaced it", worker.process.pid)
        return results

    async def close(self) -> None:
        """Stops every worker: closing its pipe ends an idle one; a busy one is killed."""
        if self._closed:
            return
        self._closed = True
        idle = set(self._idle.close(Unavailable("the reward worker pool is shut down")))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        workers = [*self._workers, *self._starting]  # a worker cut off while starting is not idle: killed
        self._workers.clear()
        self._starting.clear()
        for worker in workers:
            if worker not in idle:
                # Still busy after the servers' grace period: nobody is waiting for its reply.
                worker.process.kill()
            worker.conn.close()
        await asyncio.gather(*(self._reap(worker) for worker in workers))
        logger.info("reward worker pool stopped")

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        progress = Progress(self._context.RawArray("d", 2))
        memory = WorkerMemory(shared_cell(self._context), self.memory_budget)
        process = self._context.Process(
            target=worker_main,
            args=(child_conn, self._functions, progress, logging.getLogger().getEffectiveLevel(), memory),
            name="rlfleet-reward-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        worker = _Worker(process, parent_conn, progress, memory)
        self._starting.add(worker)
        return worker

    def _check_ready(self, worker: _Worker, ready: bool) -> None:
        """A worker that said READY is live; one that did not is stopped, so one that cannot start fails loudly,
        once."""
        self._starting.discard(worker)
        if ready:
            self._workers.add(worker)
            return
        worker.process.kill()
        worker.conn.close()
        raise RuntimeError(f"a reward worker failed to start (exit code {worker.process.exitcode}); see the log")

    def _release(self, worker: _Worker) -> None:
        """Gives `worker` to the lane that has waited longest, or makes it idle."""
        self._idle.put(worker)

    def _watch(self, worker: _Worker) -> None:
        """Watches an idle worker's pipe: a worker killed while idle (the OOM killer, an operator) is replaced
        at once, so /health counts only live workers and no item is sent to a dead one."""
        asyncio.get_running_loop().add_reader(worker.conn.fileno(), self._lost_while_idle, worker)

    def _unwatch(self, worker: _Worker) -> None:
        asyncio.get_running_loop().remove_reader(worker.conn.fileno())

    def _lost_while_idle(self, worker: _Worker) -> None:
        if worker not in self._workers:
            return
        self._idle.discard(worker)  # stops watching it
        logger.warning("reward worker %d died while idle; replacing it", worker.process.pid)
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        self._workers.discard(worker)
        if worker.process.exitcode is None:
            worker.process.kill()
        worker.conn.close()
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._reap_and_respawn(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_and_respawn(self, worker: _Worker) -> None:
        await self._reap(worker)
        while True:
            try:
                fresh = self._start_worker()
                try:
                    await _readable(fresh.conn, _READY_WAIT_SECONDS)
                    ready = fresh.conn.recv() == READY
                except (EOFError, OSError):
                    await asyncio.to_thread(fresh.process.join, _EXIT_STATUS_WAIT_SECONDS)  # for its exit code
                    ready = False
                except TimeoutError:
                    ready = False
                self._check_ready(fresh, ready)
            except Exception as exc:  # noqa: BLE001 - logged; the pool keeps trying so it heals on its own
                logger.exception("could not start a reward worker; retrying in %g s", _RESPAWN_BACKOFF_SECONDS)
                self._start_failed(exc)
                await asyncio.sleep(_RESPAWN_BACKOFF_SECONDS)
                continue
            self._failed_starts = 0
            if self._down is not None:
                logger.info("a reward worker started again; the pool serves again")
                self._down = None
            self._release(fresh)
            return

    def _start_failed(self, error: Exception) -> None:
        """Counts a failed start; past the limit, with no worker live, fails every call waiting for a worker."""
        self._failed_starts += 1
        if self._workers or self._failed_starts < _FAILED_STARTS_BEFORE_UNAVAILABLE:
            return
        self._down = Unavailable(
            f"no reward worker is running: the last {self._failed_starts} attempts to start one failed (last error: "
            f"{error or type(error).__name__}); the hub keeps trying every {_RESPAWN_BACKOFF_SECONDS:g} s"
        )
        self._idle.fail_waiters(self._down)

    async def _reap(self, worker: _Worker) -> None:
        await asyncio.to_thread(worker.process.join, _EXIT_WAIT_SECONDS)
        if worker.process.exitcode is None:
            logger.warning("reward worker %d did not exit; killing it", worker.process.pid)
            worker.process.kill()
            await asyncio.to_thread(worker.process.join, _EXIT_WAIT_SECONDS)


async def _readable(conn: Connection, timeout: float) -> None:
    """Waits until `conn` has data (or EOF) without blocking the event loop; TimeoutError after `timeout`."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = conn.fileno()
    loop.add_reader(fd, on_readable)
    try:
        async with asyncio.timeout(timeout):
            await ready
    finally:
        loop.remove_reader(fd)
