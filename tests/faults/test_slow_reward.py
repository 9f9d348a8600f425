"""A reward function that turns slow in the middle of a run (a remote reward model that answers some
items long after the run's time limit): those items time out at the hub, their groups are filtered
under a named reason and replaced by fresh prompts, and the run completes. And a fast reward model
must not time out just because the hub is busy with other items."""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from google.protobuf import json_format

from rlfleet.local_fleet import LocalFleet
from rlfleet.v1.reward_pb2 import RewardSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.faults]

TIME_LIMIT_S = 8.0
"""The run's reward time limit per item: well above a fast answer (milliseconds) on a loaded machine,
far below a slow one."""
SLOW_ANSWER_S = 30.0
"""How long a slow item takes: far past the time limit, so only the hub's deadline ends the wait."""


@dataclass
class RewardModel:
    """An HTTP reward model: exact match against the label; once `slow` is set, a third of the prompts
    (chosen by a hash, so the same ones every run) are answered only after SLOW_ANSWER_S."""

    url: str
    slow: threading.Event = field(default_factory=threading.Event)
    slow_requests: int = 0


@pytest.fixture
def reward_model(reward_model_port: int) -> Iterator[RewardModel]:
    model = RewardModel(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
            try:
                item = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            except ValueError:  # the hub gave up on the request while sending it
                return
            if model.slow.is_set() and zlib.crc32(item["prompt"].encode()) % 3 == 0:
                model.slow_requests += 1
                time.sleep(SLOW_ANSWER_S)
            body = json.dumps({"score": float(item["response"].strip() == item["label"].strip())}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the hub stopped waiting at its time limit
                pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet, the signature is fixed
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 256  # a listen backlog like real servers' (uvicorn: 2048), not http.server's 5

    server = Server(("127.0.0.1", reward_model_port), Handler)
    server.daemon_threads = True
    model.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    thread = threading.Thread(target=server.serve_forever, name="reward model", daemon=True)
    thread.start()
    yield model
    server.shutdown()
    server.server_close()


def test_slow_reward_items_time_out_and_are_replaced(fault_fleet: LocalFleet, runs, reward_model: RewardModel) -> None:
    spec = runs.spec("slow reward function")
    remote = {"function": "remote", "params": {"url": reward_model.url, "deadline_seconds": SLOW_ANSWER_S}}
    spec.reward.CopyFrom(json_format.ParseDict({"terms": [remote], "timeout_seconds": TIME_LIMIT_S}, RewardSpec()))
    _, ledger = runs.survive("slow reward function", reward_model.slow.set, spec)
    assert reward_model.slow_requests > 0, "no item was slow: the case tested nothing"
    assert ledger.by_reason.get("any_failed", 0) > 0, f"no group was filtered for its timed-out items: {ledger}"


def test_fast_remote_items_in_one_batch_meet_their_time_limit(
    fault_fleet: LocalFleet, reward_model: RewardModel
) -> None:
    spec = {"terms": [{"function": "remote", "params": {"url": reward_model.url}}], "timeout_seconds": 1.0}
    items = [{"id": str(i), "prompt": f"{i}+1=", "response": str(i + 1), "label": str(i + 1)} for i in range(64)]
    answer = httpx.post(f"{fault_fleet.reward_url}/score", json={"spec": spec, "items": items}, timeout=60)
    assert answer.status_code == 200, answer.text
    statuses = [result["status"] for result in answer.json()["results"]]
    assert statuses == ["SCORE_STATUS_OK"] * len(items), {s: statuses.count(s) for s in set(statuses)}
