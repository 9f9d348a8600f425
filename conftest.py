"""Fixtures shared by every test in the repository: a real Redis with a key prefix per test, a
tiny model made once per session, and a whole fleet per module for the tests that cross services.
Also how `make test` spreads the suite over pytest-xdist workers, and the fault cases' figures."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from xdist.scheduler import LoadScopeScheduling

from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.logs import SERVICE_HANDLER
from rlfleet.sample_stream import connect_redis

FleetFactory = Callable[..., contextlib.AbstractContextManager[LocalFleet]]
REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
FAULT_PACKAGE = "tests/faults/"
"""Its cases share one fleet (a package fixture), so one worker runs them all."""
FAULT_FIGURE = "fault_figure"
"""The report property a fault case records its figures under (tests/faults/conftest.py)."""
_fault_figures: list[dict[str, Any]] = []


class _WholeFiles(LoadScopeScheduling):
    """Hands each worker whole test files: a module's fleet (the `fleet` fixture) starts once, in one worker."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return FAULT_PACKAGE if path.startswith(FAULT_PACKAGE) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling:
    return _WholeFiles(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collects the figures fault cases measured; their reports reach this process from xdist workers too."""
    if report.when == "call":
        figures = [value for name, value in report.user_properties if name == FAULT_FIGURE]
        _fault_figures.extend(cast(list[dict[str, Any]], figures))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _fault_figures:
        return
    terminalreporter.section("fault figures")
    terminalreporter.write_line("| case | recovery s | step s | run s | trained | filtered (reasons) |")
    for row in _fault_figures:
        terminalreporter.write_line(
            f"| {row['case']} | {row['recovery_s']} | {row['step_s']} | {row['run_s']} | {row['trained']} | "
            f"{row['filtered']} {row['reasons'] or ''} |"
        )


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Takes off the root logger the handler a command run in process (the CLI's main) put there, and puts its
    level back. That handler writes to the stderr pytest captured for that test only: left in place, every
    later record, from any test or thread, would be written to a closed file."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if h.get_name() == SERVICE_HANDLER]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = connect_redis(REDIS_URL, timeout_s=5.0)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"these tests need Redis at {REDIS_URL} ({exc}); start it with redis-server --daemonize yes")
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards (never FLUSHALL)."""
    prefix = f"rlfleet-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=500))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def redis_losing_first_script_reply() -> Iterator[redis.Redis]:
    """A client of the services' kind (connect_redis: it retries a lost connection) whose first script call runs on
    Redis and then has its reply lost, as when the connection drops after Redis executed the command."""
    lost = False

    class ReplyLostOnce(redis.Connection):
        calls_script = False

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            self.calls_script = str(args[0]).upper() in ("EVAL", "EVALSHA")
            super().send_command(*args, **kwargs)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            nonlocal lost
            response = super().read_response(*args, **kwargs)
            if self.calls_script and not lost:
                lost = True
                self.disconnect()
                raise redis.ConnectionError("connection lost before the reply was read")
            return response

    client = connect_redis(REDIS_URL, timeout_s=5.0)
    client.connection_pool.connection_class = ReplyLostOnce
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A very small model of the tiny-model family (same tokenizer), for tests that need speed."""
    from rlfleet.tiny_model import TinyModelConfig, create_tiny_model

    out = tmp_path_factory.mktemp("models") / "small"
    create_tiny_model(out, TinyModelConfig(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128))
    return out


@contextlib.contextmanager
def running_fleet(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, engines: int = 2, **config: Any
) -> Iterator[LocalFleet]:
    """A real fleet (engines, router, reward hub, trainer under torchrun, orchestrator) on free ports
    with its own Redis key prefix; stopped by pid and its keys deleted afterwards. `config`: more
    FleetConfig fields (trainer_ranks, env, ...)."""
    prefix = f"rlfleet-fleet:{uuid.uuid4().hex[:10]}:"
    fleet_config = FleetConfig(
        model_path=model_dir,
        engines=engines,
        state_dir=tmp_path_factory.mktemp("fleet"),
        ports=FleetPorts.free(engines),
        redis_url=REDIS_URL,
        redis_prefix=prefix,
        startup_timeout_s=120,
        **config,
    )
    try:
        with LocalFleet(fleet_config) as running:
            yield running
    finally:
        client = connect_redis(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="session")
def fleet_factory(tmp_path_factory: pytest.TempPathFactory) -> FleetFactory:
    """`with fleet_factory(model_dir, engines=1, trainer_ranks=2) as fleet:` for a fleet of other shape."""
    return functools.partial(running_fleet, tmp_path_factory)


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, small_model_dir: Path
) -> Iterator[LocalFleet]:
    """One real fleet of two engines per test module; a module's FLEET_ENV adds to its services' environment."""
    env = getattr(request.module, "FLEET_ENV", {})
    with running_fleet(tmp_path_factory, small_model_dir, env=env) as running:
        yield running
