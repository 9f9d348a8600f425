"""A self-healing fleet: an engine killed under load is restarted, loads the fleet's weights, and rejoins.

Three `sim` engines (processes started here, adopted by the router) behind a router process whose
`local` restarter starts engines from a command template. One engine is SIGKILLed while clients keep
sending requests: no client request may fail, and the engine must come back on the fleet's weight
version and take traffic again.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rlfleet.processes import ServiceProcess, free_port

pytestmark = pytest.mark.e2e

SIM_COMMAND = (
    f"{sys.executable} -m rlfleet_engine --backend sim --model-path sim --host {{host}} --port {{port}} "
    "--sim-decode-ms-per-step 2"
)


def test_killed_engine_is_restarted_on_the_fleets_weights_and_no_request_fails(
    start_process: Callable[[str, list[str]], ServiceProcess], tmp_path: Path
) -> None:
    ports = [free_port() for _ in range(3)]
    engines = [start_process(f"engine-{p}", SIM_COMMAND.format(host="127.0.0.1", port=p).split()) for p in ports]
    for engine, port in zip(engines, ports, strict=True):
        engine.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
    router_port = free_port()
    router = start_process(
        "router",
        [
            sys.executable, "-m", "rlfleet_router", "--port", str(router_port),
            "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports),
            "--policy", "round_robin",
            "--health-check-interval-secs", "0.2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--retry-initial-backoff-ms", "20",
            "--restarter", "local", "--local-engine-command", SIM_COMMAND,
            "--local-engine-log-dir", str(tmp_path / "restarted"),
            "--restart-timeout-secs", "30", "--request-timeout-secs", "30",
        ],
    )  # fmt: skip
    router.wait_healthy(f"http://127.0.0.1:{router_port}/health", timeout=30)
    client = httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=30, trust_env=False)

    def workers() -> list[dict[str, object]]:
        return client.get("/workers").json()["workers"]

    deadline = time.monotonic() + 15
    while sum(bool(w["healthy"]) for w in workers()) < 3:
        assert time.monotonic() < deadline, workers()
        time.sleep(0.1)
    loaded = client.post("/update_weights_from_disk", json={"model_path": "/ckpt/step-7", "weight_version": 7})
    assert loaded.status_code == 200, loaded.text

    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def load(seed: int) -> None:
        nonlocal answered
        with httpx.Client(base_url=client.base_url, timeout=30, trust_env=False) as own:
            k = 0
            while not stop.is_set():
                k += 1
                body = {"text": f"client {seed} request {k}: ", "sampling_params": {"max_new_tokens": 40},
                        "rid": f"c{seed}-{k}"}  # fmt: skip
                try:
                    answer = own.post("/generate", json=body)
                except httpx.HTTPError as exc:
                    failures.append(f"{body['rid']}: {type(exc).__name__}")
                    continue
                if answer.status_code != 200 or answer.json()["meta_info"]["id"] != body["rid"]:
                    failures.append(f"{body['rid']}: HTTP {answer.status_code} {answer.text[:200]}")
                answered += 1

    clients = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
    for thread in clients:
        thread.start()
    time.sleep(0.5)
    victim_url = f"http://127.0.0.1:{ports[0]}"
    engines[0].kill()

    # The replacement process answers /health first; the router must admit it within 15 s of that.
    healthy_at = None
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"engine not back in routing: {workers()}\n{router.log_tail()}"
        if healthy_at is None:
            try:
                if httpx.get(victim_url + "/health", timeout=1).status_code == 200:
                    healthy_at = time.monotonic()
            except httpx.HTTPError:
                pass
        victim = next(w for w in workers() if w["url"] == victim_url)
        if victim["healthy"] and victim["restarts"]:
            break
        time.sleep(0.05)
    assert healthy_at is not None and time.monotonic() - healthy_at < 15
    time.sleep(1.0)  # traffic on the healed fleet
    stop.set()
    for thread in clients:
        thread.join(timeout=30)

    assert not failures, failures[:5]
    assert answered > 50
    assert victim["weight_version"] == "7"
    info = httpx.get(victim_url + "/get_model_info", timeout=5).json()
    assert info["weight_version"] == "7" and info["model_path"] == "/ckpt/step-7", "loaded before taking traffic"
    served = [client.post("/generate", json={"text": f"after {i}", "sampling_params": {"max_new_tokens": 2}})
              for i in range(6)]  # fmt: skip
    assert victim_url in {a.headers["x-rlfleet-engine"] for a in served}
    metrics = client.get("/metrics").text
    assert f'rlfleet_router_engine_restarts_total{{engine="{victim_url}",result="success"}}' in metrics
    assert f'rlfleet_router_engine_state{{engine="{victim_url}",state="healthy"}} 1.0' in metrics
    client.close()
    # uvicorn re-raises the SIGTERM it handled once shut down; SIGKILL (-9) would mean it hung.
    assert router.stop(timeout=15) in (0, -signal.SIGTERM)
    # The router stops the engine it started: the port is free again.
    with pytest.raises(httpx.HTTPError):
        httpx.get(victim_url + "/health", timeout=2)
