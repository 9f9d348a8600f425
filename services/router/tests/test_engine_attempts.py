"""The requests in flight at each engine: their load, and their interruption when the engine fails."""

from __future__ import annotations

from rlfleet_router.engine_attempts import EngineAttempts, EngineFailed
from rlfleet_router.workers import Worker


def test_an_engine_failure_interrupts_only_its_attempts_under_way() -> None:
    attempts = EngineAttempts()
    failed, other = Worker(url="http://a:1"), Worker(url="http://b:1")
    done, running, elsewhere = attempts.start(failed, 10), attempts.start(failed, 20), attempts.start(other, 5)
    assert (failed.in_flight, failed.in_flight_tokens) == (2, 30)
    done.end()
    done.end()  # once only
    assert (failed.in_flight, failed.in_flight_tokens) == (1, 20)
    failed.last_error = "/health_generate: ReadTimeout"
    attempts.engine_failed(failed)
    assert isinstance(running.interrupt.error, EngineFailed) and "ReadTimeout" in str(running.interrupt.error)
    assert done.interrupt.error is None and elsewhere.interrupt.error is None


def test_engines_without_attempts_leave_no_entry() -> None:
    attempts = EngineAttempts()
    workers = [Worker(url=f"http://pod-{i}:1") for i in range(3)]
    for worker in workers:
        attempts.start(worker, 1).end()
    assert attempts._waiting == {}
    assert all(w.in_flight == 0 and w.in_flight_tokens == 0 for w in workers)
