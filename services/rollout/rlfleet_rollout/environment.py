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

After every model turn, `reply` gets the episode's prompt and the text of every model turn so far,
and returns the text that enters the conversation next (a tool's output, a user's follow-up) or
None to end the episode. The returned text is tokenized and appended to the model's own tokens; it
is trained with loss mask 0. The last model turn is what the reward functions score.

`reply` is called in a worker thread of the orchestrator's `ReplyPool`, so a slow tool does not hold
up generation, and several episodes may call it at once: an environment that keeps state guards it.
An exception from it, or a reply that takes longer than the pool's time limit, fails that episode's
sample (its error names the turn and the cause), not the run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Protocol, runtime_checkable

from rlfleet_rollout.datasets import Prompt

ENTRY_POINT_GROUP = "rlfleet.rollout.environments"

_Job = tuple[Future[str | None], Callable[[], str | None]]


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
    thread until it returns. The pool bounds how many can hang; replies beyond it wait for a thread, within
    their time.
    """

    def __init__(self, threads: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"environment-reply-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    async def reply(self, env: Environment, prompt: Prompt, turns: Sequence[str]) -> str | None:
        """`env.reply(prompt, turns)` on one of the pool's threads; ReplyTimeout when it has not returned (or not
        found a free thread) within timeout_s."""
        job: Future[str | None] = Future()
        self._jobs.put((job, partial(env.reply, prompt, list(turns))))
        answer = asyncio.wrap_future(job)
        try:
            done, _ = await asyncio.wait({answer}, timeout=self.timeout_s)
        finally:
            answer.cancel()  # a reply still waiting for a thread is dropped; a running one runs on, unheard
        if not done:
            raise ReplyTimeout(f"environment did not reply within {self.timeout_s:g}s")
        return answer.result()

    def close(self) -> None:
        """Ends the idle threads, waiting for none: a hung reply's thread ends with the process."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():  # its episode stopped waiting
                continue
            try:
                future.set_result(call())
            except Exception as exc:  # noqa: BLE001 - handed to the episode, which fails its sample
                future.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - a tool's sys.exit is its episode's failure, not ours
                # Handed on as it is, SystemExit would end the orchestrator, and CancelledError look like a stop.
                future.set_exception(RuntimeError(f"raised {type(exc).__name__}{exc.args!r}"))
