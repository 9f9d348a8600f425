"""Task lifetimes: a batch of coroutines that stops together on the first failure, cancelling a task so
that it really ends, a short clean-up that a cancellation does not cut short, and the failure of a task beside
another reported as it happens.

A task can outlive one cancellation. On Python 3.11, asyncio.wait_for returns its awaitable's result when
a cancellation arrives just as that awaitable finishes, and the cancellation is lost; redis-py's asyncio
client sends every command through wait_for, so a task cancelled during a Redis command can run on as if
nothing happened. `cancel_and_wait` therefore cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How long a cancelled task may run on before it is cancelled again.
RECANCEL_EVERY_S = 0.5
# Bound on the end of a batch's other tasks once one has failed: each one's clean-up (a trajectory deleted at the
# router, FORGET_TIMEOUT_S) fits in it, and a task that ignores its cancellation holds the step no longer.
GATHER_STOP_WITHIN_S = 10.0


async def gather_cancelling(
    coros: list[Coroutine[Any, Any, T]], stop_within_s: float = GATHER_STOP_WITHIN_S
) -> list[T]:
    """Results in order; on the first exception (or cancellation) the unfinished ones are cancelled and waited for,
    for at most `stop_within_s`, before it is raised: their clean-up is done before the caller moves on, not during
    its next step or never (a task nobody awaits any more is dropped at the loop's end)."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        running = await cancel_all_and_wait(tasks, stop_within_s)
        if running:
            logger.error(
                "%d of %d tasks did not end within %gs of their cancellation; left running: %s",
                len(running),
                len(tasks),
                stop_within_s,
                ", ".join(sorted(task.get_name() for task in running)),
            )


async def cancel_and_wait(task: asyncio.Task[Any], within_s: float | None = None) -> bool:
    """Cancels `task`, again every RECANCEL_EVERY_S while it runs on, until it has ended (True) or `within_s`
    has passed (False). A cancellation of the caller meanwhile is held until then and raised after, so a
    task is never left running by a caller that was itself cancelled while it waited."""
    return not await cancel_all_and_wait([task], within_s)


async def cancel_all_and_wait(tasks: list[asyncio.Task[Any]], within_s: float | None = None) -> set[asyncio.Task[Any]]:
    """`cancel_and_wait` of several tasks at once, within one bound; the tasks still running then."""
    deadline = None if within_s is None else time.monotonic() + within_s
    interrupted = False
    running = {task for task in tasks if not task.done()}
    while running:
        wait = RECANCEL_EVERY_S if deadline is None else min(RECANCEL_EVERY_S, deadline - time.monotonic())
        if wait <= 0:
            break
        for task in running:
            task.cancel()
        try:
            _, running = await asyncio.wait(running, timeout=wait)
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError
    return running


async def finish(coro: Coroutine[Any, Any, T], within_s: float) -> T:
    """`coro`'s result, run to its end even when the caller is cancelled meanwhile (the cancellation is held until
    then and raised after), for at most `within_s`: then it is cancelled (TimeoutError). For a clean-up that a
    shutdown, which cancels repeatedly (cancel_and_wait), must not cut short."""
    task = asyncio.ensure_future(coro)
    deadline = time.monotonic() + within_s
    interrupted = False
    while not task.done():
        wait = deadline - time.monotonic()
        if wait <= 0:
            await cancel_and_wait(task)
            break
        try:
            await asyncio.wait({task}, timeout=wait)
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError
    if task.cancelled():
        raise TimeoutError(f"not done within {within_s:g}s")
    return task.result()


def on_failure(task: asyncio.Task[Any], report: Callable[[BaseException], None]) -> None:
    """Calls `report` with the exception that ends `task`, if one does (not a cancellation), as soon as it ends. The
    exception is retrieved then, once: a task nobody awaits (one beside the task that matters, cancelled when that
    one ends) fails visibly when it fails, and asyncio does not log it again, later, as never retrieved."""

    def done(ended: asyncio.Task[Any]) -> None:
        failure = None if ended.cancelled() else ended.exception()
        if failure is not None:
            report(failure)

    task.add_done_callback(done)


def log_task_failure(log: logging.Logger, run_id: str, what: str, failure: BaseException, outcome: str = "") -> None:
    """Logs, once and with its traceback, that the task of run `run_id` doing `what` failed (an `on_failure`
    report); `outcome` says what follows from it."""
    log.error(
        "run %s: %s failed (%s: %s)%s",
        run_id,
        what,
        type(failure).__name__,
        failure,
        outcome,
        exc_info=failure,
        extra={"run_id": run_id},
    )
