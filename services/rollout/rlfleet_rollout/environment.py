"""Environments: what answers the model between the turns of a `multi_turn` rollout.

An environment is an object with one method, registered under a name in the entry-point group
`rlfleet.rollout.environments` and chosen by a run's `rollout.multi_turn.environment`:

    class Echo:
        def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
            return None if len(turns) > 1 else f"\\nyou said {turns[-1]!r}; again:"

    echo = Echo()

    # pyproject.toml of the package that holds it
    [project.entry-points."rlfleet.rollout.environments"]
    echo = "my_package.echo:echo"

After every model turn, `reply` gets the episode's prompt and the text of every model turn so far
(as the conversation goes on with it: a stop string that ended a turn is in its text, though the
engine cuts it from the text it answers with), and returns the text that enters the conversation
next (a tool's output, a user's follow-up) or None to end the episode. The returned text is
tokenized and appended to the model's own tokens; it is trained with loss mask 0. The last model
turn is what the reward functions score.

`reply` is called in a worker thread of the orchestrator's `ReplyPool`, so a slow tool does not hold
up generation, and several episodes may call it at once: an environment that keeps state guards it.
An exception from it, or a reply that takes longer than the pool's time limit, fails that episode's
sample (its error names the turn and the cause), not the run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

from rlfleet_rollout.datasets import Prompt

ENTRY_POINT_GROUP = "rlfleet.rollout.environments"

HUNG_PER_THREAD = 4
"""Replies hung past their time (each keeps its thread) the pool replaces, per thread it has."""
START_MARGIN = 0.1
"""A reply that waited for a thread until less than this share of its time is left is dropped, not started: its
episode gives up on it moments later, and against a backend that hangs it would take the thread (one that replaced
a hung reply's picks up the replies queued with it) and count as one more hung reply."""


@dataclass
class _Job:
    future: Future[str | None]
    call: Callable[[], str | None]
    start_by: float  # time.monotonic() past which it is dropped rather than started (START_MARGIN of its time left)
    replaced: bool = False  # overran its time and another thread took its thread's place (under the pool's lock)


@runtime_checkable
class Environment(Protocol):
    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None: ...


class ReplyTimeout(Exception):
    """An environment did not reply within the pool's time limit."""


class ReplyPool:
    """The threads environment replies run on, at most `threads` of them, and how long one reply may take.

    Not asyncio's default executor, which the run loop's Redis calls and Submit share: slow replies held those
    up, and a few hung ones stopped them. Not a ThreadPoolExecutor either: the interpreter joins its threads at
    exit, even after shutdown(wait=False), so one hung reply kept the orchestrator from stopping; these are
    daemon threads. A thread cannot be killed: a reply that overruns its time fails its episode but keeps its
    thread until it returns, and another thread takes its place (its own ends when the reply returns), so a few
    hung replies do not fail every later one of every run. Up to HUNG_PER_THREAD x `threads` hung replies are
    replaced; past that, a reply that finds no free thread within its time says so.
    """

    def __init__(self, threads: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = threads  # threads taking jobs: the pool's size
        self._hung = 0  # replies past their time whose threads were replaced
        self._max_hung = HUNG_PER_THREAD * threads
        self._started = 0
        for _ in range(threads):
            self._start_thread()

    def _start_thread(self) -> None:
        self._started += 1
        name = f"environment-reply-{self._started}"
        threading.Thread(target=self._work, name=name, daemon=True).start()

    async def reply(self, env: Environment, prompt: Prompt, turns: Sequence[str]) -> str | None:
        """`env.reply(prompt, turns)` on one of the pool's threads; ReplyTimeout when it has not returned (or not
        found a free thread) within timeout_s."""
        start_by = time.monotonic() + (1 - START_MARGIN) * self.timeout_s
        job = _Job(Future(), partial(env.reply, prompt, list(turns)), start_by)
        self._jobs.put(job)
        answer = asyncio.wrap_future(job.future)
        try:
            done, _ = await asyncio.wait({answer}, timeout=self.timeout_s)
        finally:
            answer.cancel()  # a reply still waiting for a thread is dropped; a running one runs on, unheard
        if not done or job.future.cancelled():  # cancelled: a thread found it too late to start (START_MARGIN)
            message = f"environment did not reply within {self.timeout_s:g}s"
            if job.future.running():
                self._replace(job)
            elif self._hung >= self._max_hung:
                message += (
                    f" (no thread was free: {self._hung} replies are hung, each holding a thread, which cannot be"
                    " stopped; mend the environment's backend, or restart the orchestrator)"
                )
            raise ReplyTimeout(message)
        return answer.result()

    def _replace(self, job: _Job) -> None:
        """`job` overran its time on its thread: another thread takes that one's place, up to the bound."""
        with self._lock:
            if job.future.done() or self._hung >= self._max_hung:
                return
            job.replaced = True
            self._hung += 1
            self._start_thread()

    def close(self) -> None:
        """Ends the idle threads, waiting for none: a hung reply's thread ends with the process."""
        with self._lock:
            threads, self._threads = self._threads, 0
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if time.monotonic() >= job.start_by:  # its episode is about to give up on it, or gave up
                job.future.cancel()
            if not job.future.set_running_or_notify_cancel():  # its episode stopped waiting
                continue
            try:
                job.future.set_result(job.call())
            except Exception as exc:  # noqa: BLE001 - handed to the episode, which fails its sample
                job.future.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - a tool's sys.exit is its episode's failure, not ours
                # Handed on as it is, SystemExit would end the orchestrator, and CancelledError look like a stop.
                job.future.set_exception(RuntimeError(f"raised {type(exc).__name__}{exc.args!r}"))
            with self._lock:
                if job.replaced:  # another thread took this one's place while the reply hung
                    self._hung -= 1
                    return
