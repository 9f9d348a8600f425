"""A fixed-size pool of worker processes that run reward functions, each call under a hard deadline.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot cancel a running call, so a function
stuck in C code would hold a worker forever. Here the parent owns every worker: it sends one job,
waits for the reply with a deadline, and on a miss SIGKILLs the worker and starts a replacement.
Workers come from a fork server that has already imported the functions' modules, so a replacement
is a fork (milliseconds), not a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from rlfleet.errors import Unavailable
from rlfleet_reward.reward_function import ScoreFn
from rlfleet_reward.worker import READY, Job, Reply, worker_main

logger = logging.getLogger(__name__)

# After SIGKILL or a closed pipe a worker is gone within milliseconds; this only bounds the wait.
_EXIT_WAIT_SECONDS = 5.0
_EXIT_STATUS_WAIT_SECONDS = 1.0
# A fork of the preloaded fork server is ready in milliseconds; the first start also imports modules.
_READY_WAIT_SECONDS = 60.0
_RESPAWN_BACKOFF_SECONDS = 1.0


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
    waited: float = 0.0  # time the job queued for an idle worker, before `seconds` started


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection


class WorkerPool:
    """`size` worker processes; `run` takes the next idle one, so at most `size` jobs run at once."""

    def __init__(self, functions: Mapping[str, ScoreFn], size: int, preload: Iterable[str] = ()) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got size={size}")
        self.size = size
        self._functions = dict(functions)
        self._context = multiprocessing.get_context("forkserver")
        # The fork server is one per process: the first pool to start it decides what it preloads.
        modules = {fn.__module__ for fn in self._functions.values()} | {worker_main.__module__, *preload}
        self._context.set_forkserver_preload(sorted(modules))
        self._workers: set[_Worker] = set()
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._busy = 0
        self._waiting = 0
        self._closed = False

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def waiting(self) -> int:
        """Jobs queued for an idle worker: above zero, the pool is saturated."""
        return self._waiting

    @property
    def live(self) -> int:
        return len(self._workers)

    def start(self) -> None:
        """Starts the fork server (importing the functions' modules once) and every worker."""
        for _ in range(self.size):
            worker = self._start_worker()
            try:
                ready = worker.conn.poll(_READY_WAIT_SECONDS) and worker.conn.recv() == READY
            except (EOFError, OSError):
                ready = False
            self._check_ready(worker, ready)
            self._idle.put_nowait(worker)
        logger.info("reward worker pool started: %d workers", self.size)

    async def run(self, job: Job, timeout: float) -> JobResult:
        """Runs `job` on the next idle worker; its deadline counts from when the worker gets it.

        The wait for an idle worker needs no deadline of its own: every job ahead of this one ends
        by its deadline, so the wait is bounded by the work queued before it.
        """
        queued = time.monotonic()
        self._waiting += 1
        try:
            worker = await self._idle.get()
        finally:
            self._waiting -= 1
        waited = time.monotonic() - queued
        if worker is None:
            self._idle.put_nowait(None)  # wakes the next waiter too
            raise Unavailable("the reward worker pool is shut down")
        self._busy += 1
        started = time.monotonic()
        healthy = False
        try:
            reply = await self._call(worker, job, timeout)
            healthy = True
        except TimeoutError:
            logger.warning("%s exceeded its %g s limit; replacing worker %d", job.function, timeout, worker.process.pid)
            return JobResult(
                JobStatus.TIMEOUT, error=f"exceeded its {timeout:g} s time limit", seconds=timeout, waited=waited
            )
        except (EOFError, OSError):
            # The pipe closes a moment before the exit status is known; wait that moment, bounded.
            await asyncio.to_thread(worker.process.join, _EXIT_STATUS_WAIT_SECONDS)
            code = worker.process.exitcode
            return JobResult(
                JobStatus.ERROR,
                error=f"the worker process running it died (exit code {code})",
                seconds=time.monotonic() - started,
                waited=waited,
            )
        finally:
            self._busy -= 1
            if healthy:
                self._idle.put_nowait(worker)
            else:
                # Timed out, died, or the caller went away mid-job: the worker's state is unknown.
                self._replace(worker)
        seconds = time.monotonic() - started
        if reply.error:
            return JobResult(JobStatus.ERROR, error=reply.error, seconds=seconds, waited=waited)
        return JobResult(JobStatus.OK, score=reply.score, parts=reply.parts or {}, seconds=seconds, waited=waited)

    async def close(self) -> None:
        """Stops every worker: closing its pipe ends an idle one; a busy one is killed."""
        if self._closed:
            return
        self._closed = True
        idle = set()
        while not self._idle.empty():
            idle.add(self._idle.get_nowait())
        self._idle.put_nowait(None)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        workers = list(self._workers)
        self._workers.clear()
        for worker in workers:
            if worker not in idle:
                # Still busy after the servers' grace period: nobody is waiting for its reply.
                worker.process.kill()
            worker.conn.close()
        await asyncio.gather(*(self._reap(worker) for worker in workers))
        logger.info("reward worker pool stopped")

    async def _call(self, worker: _Worker, job: Job, timeout: float) -> Reply:
        # An idle worker is blocked in recv(), so a large job drains as fast as it is written.
        worker.conn.send(job)
        await _readable(worker.conn, timeout)
        reply = worker.conn.recv()
        assert isinstance(reply, Reply), f"worker sent a {type(reply).__name__}"
        return reply

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=worker_main, args=(child_conn, self._functions), name="rlfleet-reward-worker", daemon=True
        )
        process.start()
        child_conn.close()
        worker = _Worker(process, parent_conn)
        self._workers.add(worker)
        return worker

    def _check_ready(self, worker: _Worker, ready: bool) -> None:
        """A worker that did not say READY is removed, so one that cannot start fails loudly, once."""
        if ready:
            return
        self._workers.discard(worker)
        worker.process.kill()
        worker.conn.close()
        raise RuntimeError(f"a reward worker failed to start (exit code {worker.process.exitcode}); see the log")

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
                except (TimeoutError, EOFError, OSError):
                    ready = False
                self._check_ready(fresh, ready)
            except Exception:  # noqa: BLE001 - logged; the pool keeps trying so it heals on its own
                logger.exception("could not start a reward worker; retrying in %g s", _RESPAWN_BACKOFF_SECONDS)
                await asyncio.sleep(_RESPAWN_BACKOFF_SECONDS)
                continue
            self._idle.put_nowait(fresh)
            return

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
        await asyncio.wait_for(ready, timeout)
    finally:
        loop.remove_reader(fd)
