"""A run the trainer can never finish fails at once with the reason: one of its groups was set aside
(deleted from the stream while pending, here) and every step takes exactly groups_per_step groups,
so waiting would only wait out the step timeout."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis
from rollout_test_support import spec_json, start_fake_fleet, start_orchestrator, wait_for_state, wait_until

from rlfleet.sample_stream import SampleStream


@pytest.mark.e2e
def test_a_run_short_of_a_group_fails_at_once_naming_it(
    redis_client: redis.Redis, redis_prefix: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    fleet = start_fake_fleet(redis_client, redis_prefix)
    orchestrator = None
    try:
        orchestrator = start_orchestrator(fleet, tmp_path / "rollout.log")  # step timeout 30 s
        fleet.trainer.paused.set()
        url = orchestrator.url
        run_id = httpx.post(f"{url}/v1/runs", json=spec_json(tokenizer_dir), timeout=10).json()["id"]
        stream = SampleStream(redis_client, run_id, prefix=redis_prefix)
        wait_until(lambda: stream.length() == 2, 20, "step 0's groups on the stream")
        [taken] = stream.read("fake-trainer", count=1)
        redis_client.xdel(stream.key, taken.entry_id)  # gone while pending on the trainer

        started = time.monotonic()
        fleet.trainer.paused.clear()
        final = wait_for_state(url, run_id, {"RUN_STATE_SUCCEEDED", "RUN_STATE_FAILED"}, timeout=20)
        assert final["state"] == "RUN_STATE_FAILED"
        assert time.monotonic() - started < 10, "the run waited for a group that can never come"
        error = final["error"]
        assert f"stream entry {taken.entry_id}: entry was deleted while pending" in error, error
        assert stream.dead_key in error
        wait_until(lambda: run_id in fleet.trainer.stop_calls, 10, "StopRun of the failed run")
    finally:
        if orchestrator is not None:
            orchestrator.process.stop(timeout=15)
        fleet.stop()
