"""The `code` sandbox's tests stay within the hub's memory: its budget (a container's limit less a reserve, or
the setting), each worker's share of it, the watchdog that holds a many-process test to that share, and the
figures the hub exports. Without a budget, tests run as they always did."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.errors import InvalidInput
from rlfleet.processes import ServiceProcess, free_port
from rlfleet.v1 import reward_pb2
from rlfleet_reward.code_execution import CodeParams, score_code
from rlfleet_reward.config import RewardSettings
from rlfleet_reward.metrics import RewardMetrics
from rlfleet_reward.reward_function import RewardInput
from rlfleet_reward.sandbox import SandboxLimits, probe_isolation, run_python
from rlfleet_reward.sandbox_memory import (
    MIB,
    MemoryBudget,
    WorkerMemory,
    cgroup_memory_limit,
    install,
    memory_budget,
    shared_cell,
)
from rlfleet_reward.scoring import Scorer
from rlfleet_reward.worker_pool import JobStatus, WorkerPool

LAUNCHER = Path(__file__).resolve().parent / "reward_hub_for_tests.py"


def forking_program(children: int, mib: int) -> str:
    """Starts `children` processes that each touch `mib` MiB, all alive at once, then prints how many did."""
    return (
        "```python\nimport os, time\nkids = []\n"
        f"for _ in range({children}):\n"
        "    r, w = os.pipe()\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        block = bytearray({mib} << 20)\n"
        "        os.write(w, b'x'); time.sleep(2); os._exit(0)\n"
        "    kids.append(pid); os.read(r, 1)\n"
        "print(len(kids))\n"
        "for pid in kids: os.waitpid(pid, 0)\n```"
    )


def gauge(exposition: str, name: str) -> float:
    (value,) = [sample.value for family in text_string_to_metric_families(exposition) for sample in family.samples
                if sample.name == name]  # fmt: skip
    return value


def code_item(program: str, expected: str) -> RewardInput:
    return RewardInput(response=program, label=json.dumps({"tests": [{"stdin": "", "stdout": expected}]}))


def params(**changes: object) -> dict[str, object]:
    return {**CodeParams().model_dump(), "timeout_seconds": 10, **changes}


@pytest.fixture
def worker_memory() -> Iterator[WorkerMemory]:
    """This process as a worker with a 600 MiB share (a budget of 1200 MiB over 2 workers)."""
    memory = WorkerMemory(shared_cell(multiprocessing), MemoryBudget(1200, 2, "a budget of 1200 MiB (test)"))
    install(memory)
    try:
        yield memory
    finally:
        install(WorkerMemory(shared_cell(multiprocessing), None))


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"memory.max": "2147483648\n"}, 2 << 30),  # cgroup v2
        ({"memory.max": "max\n"}, None),
        ({"memory/memory.limit_in_bytes": "1073741824\n"}, 1 << 30),  # cgroup v1
        ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1 without a limit
        ({}, None),  # no memory controller: not in a container
    ],
)
def test_the_container_limit_is_read_from_the_cgroup(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory_limit(tmp_path) == expected


def test_an_unreadable_limit_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("lots\n")
    with pytest.raises(ValueError, match=r"memory\.max holds 'lots'"):
        cgroup_memory_limit(tmp_path)


def test_the_budget_is_the_limit_less_the_reserve_split_among_workers(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(str(2 << 30))
    budget = memory_budget(None, 512, 2, tmp_path)
    assert budget is not None
    assert (budget.total_mb, budget.share_mb) == (1536, 768)
    assert "memory limit of 2048 MiB less 512 MiB" in budget.describe()
    explicit = memory_budget(1000, 512, 4, tmp_path)  # the setting wins over the container's limit
    assert explicit is not None and (explicit.total_mb, explicit.share_mb) == (1000, 250)
    assert memory_budget(None, 512, 2, tmp_path / "none") is None


def test_the_default_params_would_hold_far_more_than_a_2gi_pod(tmp_path: Path) -> None:
    # The defect the budget is for: RLIMIT_AS binds each process, and the chart's pod runs 2 workers in 2 GiB.
    defaults = CodeParams()
    assert defaults.memory_mb * defaults.max_processes * 2 > 2048 * 8
    (tmp_path / "memory.max").write_text(str(2 << 30))  # the chart's reward pod: workers 2, limits 2Gi
    budget = memory_budget(None, RewardSettings().code_memory_reserve_mb, 2, tmp_path)
    assert budget is not None and budget.share_mb >= defaults.memory_mb  # a default spec still runs


def test_the_watchdog_kills_a_group_past_its_memory_bound() -> None:
    limits = SandboxLimits(
        wall_seconds=10, cpu_seconds=10, memory_bytes=512 * MIB, file_size_bytes=MIB, max_processes=16
    )
    program = forking_program(3, 150).strip("`python\n")
    bounded = run_python(program, "", SandboxLimits(**{**vars(limits), "group_memory_bytes": 300 * MIB}),
                         probe_isolation())  # fmt: skip
    assert bounded.memory_exceeded and bounded.stdout == "", bounded
    unbounded = run_python(program, "", limits, probe_isolation())  # each process within its own limit: runs
    assert (unbounded.memory_exceeded, unbounded.stdout.strip(), unbounded.exit_code) == (False, "3", 0), unbounded


def test_a_test_of_many_processes_is_held_to_its_workers_share(worker_memory: WorkerMemory) -> None:
    scored = score_code(code_item(forking_program(3, 250), "3"), params())  # 750 MiB, each process within 512
    assert scored.parts.get("memory_limit") == 1.0 and scored.score == 0.0, scored
    assert worker_memory.held_bytes == 0  # nothing held once the test is done


def test_a_test_within_its_share_runs_as_asked(worker_memory: WorkerMemory) -> None:
    scored = score_code(code_item(forking_program(2, 60), "2"), params())
    assert scored.score == 1.0, scored
    # 512 MiB x 32 fits a 600 MiB share only through the watchdog; the kernel alone holds 64 MiB x 4 there.
    assert score_code(code_item(forking_program(1, 30), "1"), params(memory_mb=64, max_processes=4)).score == 1.0


def test_memory_past_the_share_is_an_error_naming_the_figures(worker_memory: WorkerMemory) -> None:
    with pytest.raises(ValueError) as raised:
        score_code(code_item("print(1)", "1"), params(memory_mb=1024, max_processes=2))
    message = str(raised.value)
    assert "memory_mb 1024 MiB" in message and "600 MiB per test" in message and "1200 MiB" in message, message
    assert "2 workers" in message and "RLFLEET_REWARD_CODE_MEMORY_BUDGET_MB" in message, message


def checked(
    with_scorer: Callable[..., Any], budget: MemoryBudget | None, **code_params: object
) -> tuple[list[tuple[str, str]], str]:
    """What /validate finds in a spec of one `code` term on a hub with `budget`, and what /score answers it."""
    spec = json_format.ParseDict({"terms": [{"function": "code", "params": code_params}]}, reward_pb2.RewardSpec())
    item = reward_pb2.ScoreItem(id="a", response="print(1)", label=code_item("", "1").label)

    async def body(scorer: Scorer) -> tuple[list[tuple[str, str]], str]:
        found = scorer.validate_spec(reward_pb2.ValidateSpecRequest(spec=spec)).problems
        try:
            scored = await scorer.score(reward_pb2.ScoreRequest(spec=spec, items=[item]))
        except InvalidInput as exc:
            return [(p.field, p.message) for p in found], f"refused: {exc}"
        return [(p.field, p.message) for p in found], reward_pb2.ScoreStatus.Name(scored.results[0].status)

    return with_scorer(body, workers=budget.workers if budget else 1, memory_budget=budget)


def test_a_spec_asking_memory_past_a_workers_share_is_refused_when_validated(
    with_scorer: Callable[..., Any],
) -> None:
    # A run's spec is checked at submit (/validate): refused then, naming the param, its value and the share, rather
    # than accepted and every one of its items an ERROR once it runs.
    budget = MemoryBudget(1200, 2, "a budget of 1200 MiB (test)")
    problems, scored = checked(with_scorer, budget, memory_mb=1024, max_processes=2)
    ((field, message),) = problems
    assert field == "terms[0].params.memory_mb", problems
    assert "memory_mb 1024 MiB" in message and "600 MiB per test" in message and "2 workers" in message, message
    assert "RLFLEET_REWARD_CODE_MEMORY_BUDGET_MB" in message, message
    assert scored.startswith("refused: spec.terms[0].params.memory_mb: ") and "600 MiB per test" in scored, scored


def test_memory_within_a_workers_share_or_without_a_budget_is_valid(with_scorer: Callable[..., Any]) -> None:
    budget = MemoryBudget(1200, 2, "a budget of 1200 MiB (test)")
    assert checked(with_scorer, budget, memory_mb=600, max_processes=2) == ([], "SCORE_STATUS_OK")
    # Past the share only together: the watchdog holds the test to the share, so the spec is fine.
    assert checked(with_scorer, budget) == ([], "SCORE_STATUS_OK")
    assert checked(with_scorer, None, memory_mb=1024, max_processes=2) == ([], "SCORE_STATUS_OK")


def test_without_a_budget_a_test_holds_its_own_limits() -> None:
    scored = score_code(code_item(forking_program(3, 250), "3"), params())
    assert scored.score == 1.0, scored


def test_the_pool_holds_each_worker_to_its_share_and_exports_the_figures() -> None:
    from rlfleet_reward.code_execution import CODE

    budget = MemoryBudget(1200, 2, "a budget of 1200 MiB (test)")

    async def main() -> None:
        pool = WorkerPool({"code": CODE.fn}, 2, memory_budget=budget)  # type: ignore[dict-item]
        pool.start()
        metrics = RewardMetrics()
        metrics.watch_pool(pool)
        try:
            items = [code_item(forking_program(3, 250), "3"), code_item("print(1)", "1")]
            scoring = asyncio.create_task(pool.run("code", params(), items, 30))
            held = 0
            while not scoring.done():
                held = max(held, pool.sandbox_memory_held)
                await asyncio.sleep(0.01)
            crowded, small = await scoring
            assert crowded.status is JobStatus.OK and crowded.parts.get("memory_limit") == 1.0, crowded
            assert (small.status, small.score) == (JobStatus.OK, 1.0), small
            assert 0 < held <= 1200 * MIB  # what running tests may hold stays within the budget
            exported = generate_latest(metrics.registry).decode()
            assert gauge(exported, "rlfleet_reward_code_memory_budget_bytes") == 1200 * MIB
            assert gauge(exported, "rlfleet_reward_code_memory_held_bytes") == 0
        finally:
            await pool.close()

    asyncio.run(main())


def test_the_budget_gauge_reads_a_budget_too_small_for_any_test_as_what_it_is() -> None:
    # 3 MiB over 4 workers is a share of 0 MiB (every code spec refused): not the 0 that means no budget.
    pool = WorkerPool({}, 4, memory_budget=MemoryBudget(3, 4, "test"))
    metrics = RewardMetrics()
    metrics.watch_pool(pool)
    assert gauge(generate_latest(metrics.registry).decode(), "rlfleet_reward_code_memory_budget_bytes") == 3 * MIB


def test_a_budget_is_split_among_the_pools_workers() -> None:
    with pytest.raises(ValueError, match="split among 4 workers, the pool has 2"):
        WorkerPool({}, 2, memory_budget=MemoryBudget(600, 4, "test"))


@pytest.mark.e2e
def test_a_hub_with_a_budget_holds_its_tests_to_it(tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    argv = [sys.executable, str(LAUNCHER), "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
            str(grpc_port), "--workers", "2", "--shutdown-grace-seconds", "2"]  # fmt: skip
    env = {"RLFLEET_LOG_FORMAT": "text", "RLFLEET_REWARD_CODE_MEMORY_BUDGET_MB": "1200"}
    process = ServiceProcess("reward-hub-memory", argv, tmp_path / "hub.log", env=env)
    try:
        process.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=30)
        hub = f"http://127.0.0.1:{port}"

        def score(item: RewardInput) -> dict:
            body = {
                "spec": {"terms": [{"function": "code", "params": {"timeout_seconds": 10}}],
                         "timeout_seconds": 30},
                "items": [{"id": "a", "response": item.response, "label": item.label}],
            }  # fmt: skip
            response = httpx.post(f"{hub}/score", json=body, timeout=60)
            assert response.status_code == 200, response.text
            result: dict = response.json()["results"][0]
            return result

        crowded = score(code_item(forking_program(3, 250), "3"))
        assert crowded["status"] == "SCORE_STATUS_OK" and crowded["components"]["code/memory_limit"] == 1.0, crowded
        too_big = {"terms": [{"function": "code", "params": {"memory_mb": 1024, "max_processes": 2}}]}
        validated = httpx.post(f"{hub}/validate", json={"spec": too_big}, timeout=10)
        (problem,) = validated.json()["problems"]
        assert problem["field"] == "terms[0].params.memory_mb" and "600 MiB per test" in problem["message"], problem
        metrics = httpx.get(f"{hub}/metrics", timeout=10).text
        assert gauge(metrics, "rlfleet_reward_code_memory_budget_bytes") == 1200 * MIB
    finally:
        process.stop(timeout=10)
