"""The router as a real process: in front of fake engines, and in front of real rlfleet engines.

The real-engine test serves the tiny model on CPU; it loads weights from disk for real, so the
weight fan-out and the rejoin rule are checked end to end.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from router_fakes import FakeEngine

from rlfleet.processes import ServiceProcess, free_port

pytestmark = pytest.mark.e2e

STARTUP_SECS = 60.0


def router_argv(port: int, worker_urls: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlfleet_router",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--health-check-interval-secs",
        "0.5",
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        *extra,
    ]


def wait_for_healthy_workers(client: httpx.Client, count: int, process: ServiceProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    workers: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        workers = client.get("/workers").json()["workers"]
        if sum(bool(w["healthy"]) for w in workers) == count:
            return
        time.sleep(0.2)
    raise AssertionError(f"{count} healthy workers not reached in {timeout}s: {workers}\n{process.log_tail()}")


def test_router_process_serves_and_stops_cleanly(
    start_engine: Callable[..., FakeEngine], start_process: Callable[..., ServiceProcess]
) -> None:
    engines = [start_engine("a"), start_engine("b")]
    port = free_port()
    router = start_process("router", router_argv(port, [e.url for e in engines], "--policy", "round_robin"))
    router.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=STARTUP_SECS)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as client:
        wait_for_healthy_workers(client, 2, router, timeout=10)
        served = {client.post("/generate", json={"text": "x"}).json()["meta_info"]["engine"] for _ in range(4)}
        assert served == {"a", "b"}
        assert client.get("/fleet").json()["policy"] == "round_robin"
    # uvicorn re-raises the SIGTERM it handled once shut down; SIGKILL (-9) would mean it hung.
    assert router.stop(timeout=10) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in router.log_tail(lines=10)


def _engine_available() -> bool:
    return importlib.util.find_spec("rlfleet_engine") is not None and importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlfleet.tiny_model import create_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    create_tiny_model(out)
    return out


def engine_argv(model_dir: Path, port: int, weight_version: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlfleet_engine",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--torch-threads",
        "1",
        "--weight-version",
        weight_version,
    ]


@pytest.mark.slow
@pytest.mark.skipif(not _engine_available(), reason="rlfleet_engine (and torch) not installed")
def test_real_engines_behind_the_router(tiny_model_dir: Path, start_process: Callable[..., ServiceProcess]) -> None:
    first_port, second_port, router_port = free_port(), free_port(), free_port()
    first = start_process("engine-1", engine_argv(tiny_model_dir, first_port, "0"))
    first_url = f"http://127.0.0.1:{first_port}"
    # Started now to overlap the start-up; it joins the fleet only after the first weight update.
    second = start_process("engine-2", engine_argv(tiny_model_dir, second_port, "0"))
    second_url = f"http://127.0.0.1:{second_port}"
    router = start_process("router", router_argv(router_port, [first_url]))
    first.wait_healthy(f"{first_url}/health", timeout=STARTUP_SECS)
    router.wait_healthy(f"http://127.0.0.1:{router_port}/health", timeout=STARTUP_SECS)

    with httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=60, trust_env=False) as client:
        request = {
            "text": "12+7=",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True,
        }
        answer = client.post("/generate", json=request)
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["weight_version"] == "0"

        with client.stream("POST", "/generate", json={**request, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2
        assert "text" in json.loads(events[-2].removeprefix("data: "))

        update = client.post(
            "/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "1"}
        )
        assert update.status_code == 200, update.text
        assert update.json()["success"] is True
        assert httpx.get(f"{first_url}/get_model_info", timeout=10).json()["weight_version"] == "1"

        # An engine started on older weights joins the fleet only after loading the fleet's version.
        second.wait_healthy(f"{second_url}/health", timeout=STARTUP_SECS)
        assert client.post("/workers", json={"url": second_url}).status_code == 202
        wait_for_healthy_workers(client, 2, router, timeout=STARTUP_SECS)
        assert httpx.get(f"{second_url}/get_model_info", timeout=10).json()["weight_version"] == "1"

        # A crashed engine leaves routing; the fleet keeps serving on the other one.
        first.kill()
        for _ in range(3):
            answer = client.post("/generate", json=request)
            assert answer.status_code == 200, answer.text
            assert answer.json()["meta_info"]["weight_version"] == "1"
        wait_for_healthy_workers(client, 1, router, timeout=10)
        assert client.get("/weight_version").json()["weight_version"] == "1"


@pytest.mark.slow
@pytest.mark.skipif(not _engine_available(), reason="rlfleet_engine (and torch) not installed")
def test_a_restarted_real_engine_loads_the_runs_model_it_boots_under_the_same_label(
    tiny_model_dir: Path, tmp_path: Path, start_process: Callable[..., ServiceProcess]
) -> None:
    """The trainer loads a run's model (here another tiny model) as version 0, the label engines boot with. An
    engine that crashes and is started again by its supervisor comes back on its boot model, still as "0": the
    router must load the run's model into it before it serves, and both engines then answer alike."""
    from rlfleet.tiny_model import TinyModelConfig, create_tiny_model

    run_model = tmp_path / "run-model"
    create_tiny_model(run_model, TinyModelConfig(seed=1))
    ports, router_port = [free_port(), free_port()], free_port()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    engines = [start_process(f"engine-{i}", engine_argv(tiny_model_dir, port, "0")) for i, port in enumerate(ports)]
    for engine, url in zip(engines, urls, strict=True):
        engine.wait_healthy(f"{url}/health", timeout=STARTUP_SECS)
    router = start_process("router", router_argv(router_port, urls))
    router.wait_healthy(f"http://127.0.0.1:{router_port}/health", timeout=STARTUP_SECS)

    with httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=60, trust_env=False) as client:
        wait_for_healthy_workers(client, 2, router, timeout=STARTUP_SECS)
        loaded = client.post("/update_weights_from_disk", json={"model_path": str(run_model), "weight_version": "0"})
        assert loaded.status_code == 200, loaded.text

        engines[1].kill()
        wait_for_healthy_workers(client, 1, router, timeout=30)
        restarted = start_process("engine-1-restarted", engine_argv(tiny_model_dir, ports[1], "0"))
        restarted.wait_healthy(f"{urls[1]}/health", timeout=STARTUP_SECS)
        wait_for_healthy_workers(client, 2, router, timeout=STARTUP_SECS)

    info = httpx.get(f"{urls[1]}/get_model_info", timeout=10).json()
    assert (info["weight_version"], info["model_path"]) == ("0", str(run_model))
    request = {
        "input_ids": [20, 21, 22, 23, 24],
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
    }
    answers = [httpx.post(f"{url}/generate", json=request, timeout=60).json() for url in urls]
    tokens = [[(lp, token) for lp, token, *_ in a["meta_info"]["output_token_logprobs"]] for a in answers]
    assert [t for _, t in tokens[0]] == [t for _, t in tokens[1]]
    assert [lp for lp, _ in tokens[1]] == pytest.approx([lp for lp, _ in tokens[0]], abs=1e-5)
