"""The orchestrator's threads for environment replies: a reply is bounded in time, an environment's own
exception reaches its episode as raised, hung replies have their threads replaced (up to a bound), and the process
exits without waiting for them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import pytest

from rlfleet_rollout import environment
from rlfleet_rollout.datasets import Prompt
from rlfleet_rollout.environment import ReplyPool, ReplyTimeout

PROMPT = Prompt(prompt="1+2=", answer="3")


class Hangs:
    """A tool whose backend stopped answering: each reply waits until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        self.calls += 1
        self.release.wait(timeout=30)
        return None


def test_replies_past_their_time_are_given_up_and_those_waiting_for_a_thread_are_never_run() -> None:
    env, pool = Hangs(), ReplyPool(threads=2, timeout_s=0.3)

    async def main() -> tuple[list[BaseException | str | None], float]:
        replies = await asyncio.gather(*[pool.reply(env, PROMPT, ["3"]) for _ in range(5)], return_exceptions=True)
        started = time.monotonic()
        await asyncio.to_thread(int)  # asyncio's default executor, which the run loop's Redis calls use, is free
        return replies, time.monotonic() - started

    try:
        replies, default_executor_wait = asyncio.run(main())
        assert [str(r) for r in replies] == ["environment did not reply within 0.3s"] * 5
        assert all(isinstance(r, ReplyTimeout) for r in replies)
        assert env.calls == 2, "the three replies that found no free thread are dropped, not run later"
        assert default_executor_wait < 1.0
    finally:
        env.release.set()
        pool.close()


def test_a_reply_nearly_out_of_time_is_dropped_not_started_by_the_thread_replacing_a_hung_one() -> None:
    """The thread that takes a hung reply's place picks up the reply queued behind it; one sent 20 ms after the
    hung one had 20 ms of its 300 left. Started, it hung too: one more thread held, one more hung reply counted."""
    env, pool = Hangs(), ReplyPool(threads=1, timeout_s=0.3)

    async def main() -> list[BaseException | str | None]:
        first = asyncio.ensure_future(pool.reply(env, PROMPT, ["3"]))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(pool.reply(env, PROMPT, ["3"]))
        return await asyncio.gather(first, second, return_exceptions=True)

    try:
        replies = asyncio.run(main())
        assert all(isinstance(r, ReplyTimeout) for r in replies), replies
        time.sleep(0.1)  # the replacing thread has had time to start what it would start
        assert env.calls == 1, "the reply with 7% of its time left was started"
    finally:
        env.release.set()
        pool.close()


def reply_threads() -> int:
    return len([t for t in threading.enumerate() if t.name.startswith("environment-reply")])


class Answers:
    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        return "ok"


def test_a_hung_reply_s_thread_is_replaced_so_later_replies_are_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hung replies on a pool of two threads failed every later reply of every run, a healthy environment's
    too, until the orchestrator restarted. A replaced thread ends once its reply returns; past the bound of
    replaced ones, a reply finding no thread says why."""
    monkeypatch.setattr(environment, "HUNG_PER_THREAD", 1)
    hangs, pool = Hangs(), ReplyPool(threads=2, timeout_s=0.3)

    async def hang(count: int) -> list[BaseException | str | None]:
        return await asyncio.gather(*[pool.reply(hangs, PROMPT, ["3"]) for _ in range(count)], return_exceptions=True)

    try:
        assert all(isinstance(r, ReplyTimeout) for r in asyncio.run(hang(2)))
        assert asyncio.run(pool.reply(Answers(), PROMPT, ["3"])) == "ok", "the hung replies' threads were replaced"
        assert all(isinstance(r, ReplyTimeout) for r in asyncio.run(hang(2)))  # 4 hung: past the bound of 2
        with pytest.raises(ReplyTimeout, match="2 replies are hung, each holding a thread"):
            asyncio.run(pool.reply(Answers(), PROMPT, ["3"]))
        hangs.release.set()  # the backend answers again: the replaced threads end, the pool is whole
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and reply_threads() > 2:
            time.sleep(0.02)
        assert reply_threads() == 2
        assert asyncio.run(pool.reply(Answers(), PROMPT, ["3"])) == "ok"
    finally:
        hangs.release.set()
        pool.close()


class Raises:
    def reply(self, prompt: Prompt, turns: Sequence[str]) -> str | None:
        raise TimeoutError("the tool's backend timed out")


def test_an_environments_own_exception_reaches_its_caller_as_raised() -> None:
    pool = ReplyPool(threads=1, timeout_s=5)
    try:
        with pytest.raises(TimeoutError, match="the tool's backend timed out") as raised:
            asyncio.run(pool.reply(Raises(), PROMPT, ["3"]))
        assert not isinstance(raised.value, ReplyTimeout)
    finally:
        pool.close()


def test_the_process_exits_without_waiting_for_a_hung_reply() -> None:
    """A ThreadPoolExecutor's threads are joined at exit even after shutdown(wait=False): one hung reply kept the
    orchestrator from stopping."""
    script = (
        "import asyncio, time\n"
        "from rlfleet_rollout.datasets import Prompt\n"
        "from rlfleet_rollout.environment import ReplyPool, ReplyTimeout\n"
        "class Hangs:\n"
        "    def reply(self, prompt, turns):\n"
        "        time.sleep(60)\n"
        "pool = ReplyPool(threads=1, timeout_s=0.1)\n"
        "try:\n"
        "    asyncio.run(pool.reply(Hangs(), Prompt('1+2=', '3'), []))\n"
        "except ReplyTimeout:\n"
        "    pool.close()\n"
    )
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    assert time.monotonic() - started < 20
