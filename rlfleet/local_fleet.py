"""The whole fleet on one machine as child processes: what `rlfleet up` and `make demo` run.

Start order follows the dependencies (Redis, engines, router, reward hub, trainer, orchestrator);
each service must answer its health check within a bound before the next starts, and a failure
names the service and shows the end of its log. Stopping goes in reverse order. The fleet's pids
and addresses are written to `<state_dir>/fleet.json` so `rlfleet down` can stop it from elsewhere.

Any one service, Redis included when the fleet started it, can be started again with the same
command (`restart`), which is how the fault tests bring back what they killed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from rlfleet.processes import ServiceProcess, command_line, free_port, free_port_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetPorts:
    router: int = 30000
    engine_base: int = 30001
    """Engine i listens on engine_base + i."""
    reward: int = 8001
    reward_grpc: int = 50053
    rollout: int = 8000
    rollout_grpc: int = 50051
    trainer_grpc: int = 50052
    trainer_http: int = 8002
    redis: int = 6379

    @classmethod
    def free(cls, engines: int) -> FleetPorts:
        """Ports free right now for every service (Redis keeps its default)."""
        ports = {name: free_port() for name in cls.__dataclass_fields__ if name not in ("redis", "engine_base")}
        return cls(**ports, engine_base=free_port_block(engines))


@dataclass(frozen=True)
class FleetConfig:
    model_path: Path
    """The model every engine serves at start (the runs' policy)."""
    engines: int = 2
    state_dir: Path = Path(".rlfleet")
    """Logs, the trainer's weight versions and fleet.json go here."""
    host: str = "127.0.0.1"
    ports: FleetPorts = field(default_factory=FleetPorts)
    redis_url: str | None = None
    """Redis to use; unset means 127.0.0.1:<ports.redis>, started here if none answers (AOF on, data in
    <state_dir>/redis). Only a Redis started here is the fleet's own: `restart("redis")` needs one."""
    redis_prefix: str = "rlfleet:"
    engine_threads: int = 1
    engine_backend: str = "transformers"
    """rlfleet_engine's --backend: transformers (CPU) or sglang (the real SGLang server, GPU)."""
    trainer_threads: int = 1
    trainer_ranks: int = 1
    """torchrun ranks of the trainer (FSDP2 over gloo on CPU); each uses `trainer_threads` threads."""
    startup_timeout_s: float = 180.0
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every service, e.g. RLFLEET_ROUTER_HEALTH_CHECK_INTERVAL_SECS=1 (each service
    reads only its own RLFLEET_<SVC>_ settings)."""

    def resolved_redis_url(self) -> str:
        return self.redis_url or f"redis://{self.host}:{self.ports.redis}/0"


class LocalFleet:
    def __init__(self, config: FleetConfig) -> None:
        if config.engines < 1:
            raise ValueError(f"engines must be >= 1, got {config.engines}")
        if not (Path(config.model_path) / "config.json").exists():
            raise FileNotFoundError(f"no Hugging Face model at {config.model_path} (config.json missing)")
        self.config = config
        self.processes: dict[str, ServiceProcess] = {}
        self.log_dir = Path(config.state_dir) / "logs"
        self._commands: dict[str, tuple[list[str], str]] = {}  # name -> (argv, health URL or Redis URL)

    # -- addresses ------------------------------------------------------------------------------

    def url(self, port: int) -> str:
        return f"http://{self.config.host}:{port}"

    @property
    def api_url(self) -> str:
        return self.url(self.config.ports.rollout)

    @property
    def router_url(self) -> str:
        return self.url(self.config.ports.router)

    @property
    def reward_url(self) -> str:
        return self.url(self.config.ports.reward)

    def engine_urls(self) -> list[str]:
        return [self.url(self.config.ports.engine_base + i) for i in range(self.config.engines)]

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        self._write_state()

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            code = process.stop(timeout=20)
            logger.info("stopped %s (exit code %s)", name, code)
        state = Path(self.config.state_dir) / "fleet.json"
        if state.exists():
            state.unlink()

    def _start_all(self) -> None:
        c, p, py = self.config, self.config.ports, sys.executable
        self._ensure_redis()
        for i, url in enumerate(self.engine_urls()):
            self._spawn(
                f"engine-{i}",
                command_line(
                    py,
                    "-m",
                    "rlfleet_engine",
                    model_path=c.model_path,
                    host=c.host,
                    port=p.engine_base + i,
                    torch_threads=c.engine_threads,
                    random_seed=i,
                    weight_version=0,
                    backend=c.engine_backend,
                ),
                f"{url}/health",
            )
        for i in range(c.engines):
            self._wait(f"engine-{i}")
        self._spawn(
            "router",
            command_line(
                py,
                "-m",
                "rlfleet_router",
                worker_urls=self.engine_urls(),
                host=c.host,
                port=p.router,
                policy="least_load",
            ),
            f"{self.router_url}/health",
        )
        self._wait("router")
        self._spawn(
            "reward",
            command_line(py, "-m", "rlfleet_reward", host=c.host, port=p.reward, grpc_port=p.reward_grpc),
            f"{self.reward_url}/health",
        )
        self._spawn(
            "trainer",
            command_line(
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={c.trainer_ranks}",
                "-m",
                "rlfleet_trainer",
                "serve",
                host=c.host,
                grpc_port=p.trainer_grpc,
                http_port=p.trainer_http,
                redis_url=c.resolved_redis_url(),
                redis_prefix=c.redis_prefix,
                router_url=self.router_url,
                work_dir=Path(c.state_dir) / "trainer",
                torch_threads=c.trainer_threads,
            ),
            f"{self.url(p.trainer_http)}/health",
        )
        self._wait("reward")
        self._wait("trainer")
        self._spawn(
            "rollout",
            command_line(
                py,
                "-m",
                "rlfleet_rollout",
                host=c.host,
                port=p.rollout,
                grpc_port=p.rollout_grpc,
                redis_url=c.resolved_redis_url(),
                redis_prefix=c.redis_prefix,
                router_url=self.router_url,
                reward_url=self.reward_url,
                trainer_address=f"{c.host}:{p.trainer_grpc}",
            ),
            f"{self.api_url}/health",
        )
        self._wait("rollout")

    def restart(self, name: str) -> None:
        """Starts service `name` again with the same command (after a crash, or killing it) and
        waits until it is healthy. It keeps its place in the stop order."""
        if name not in self._commands:
            raise KeyError(f"{name!r} is not a service this fleet started; it has {sorted(self._commands)}")
        argv, health_url = self._commands[name]
        self.processes[name].stop(timeout=10)
        self._spawn(name, argv, health_url)
        self._wait(name)
        self._write_state()

    def _spawn(self, name: str, argv: list[str], health_url: str) -> None:
        env = {"RLFLEET_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.config.env}
        self._commands[name] = (argv, health_url)
        self.processes[name] = ServiceProcess(name, argv, self.log_dir / f"{name}.log", env=env)

    def _wait(self, name: str) -> None:
        health_url = self._commands[name][1]
        started = time.monotonic()
        if health_url.startswith("redis://"):
            self._wait_redis(name, health_url)
        else:
            self.processes[name].wait_healthy(health_url, timeout=self.config.startup_timeout_s)
        logger.info("%s healthy after %.1fs", name, time.monotonic() - started)

    def _ensure_redis(self) -> None:
        url = self.config.resolved_redis_url()
        if _redis_answers(url):
            return
        if self.config.redis_url is not None:
            raise RuntimeError(f"Redis at {url} does not answer; start it or drop --redis-url to have one started")
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("no Redis answers and redis-server is not installed (apt-get install redis-server)")
        data_dir = Path(self.config.state_dir) / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "redis",
            command_line(
                server,
                bind=self.config.host,
                port=self.config.ports.redis,
                dir=data_dir,
                appendonly="yes",
                save="",
            ),
            url,
        )
        self._wait("redis")

    def _wait_redis(self, name: str, url: str) -> None:
        """Redis started from its AOF answers once the file is loaded: bounded by the startup timeout."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not _redis_answers(url):
            if time.monotonic() > deadline or not self.processes[name].alive():
                raise RuntimeError(f"redis-server did not answer at {url}; see {self.processes[name].log_path}")
            time.sleep(0.1)

    def _write_state(self) -> None:
        state = {
            "pid": os.getpid(),
            "processes": {name: proc.pid for name, proc in self.processes.items()},
            "api_url": self.api_url,
            "router_url": self.router_url,
            "reward_url": self.reward_url,
            "engines": self.engine_urls(),
            "config": json.loads(json.dumps(asdict(self.config), default=str)),
        }
        path = Path(self.config.state_dir) / "fleet.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state, indent=2) + "\n")


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def stop_from_state(state_dir: Path, timeout_s: float = 60.0) -> bool:
    """Stops the fleet recorded in `<state_dir>/fleet.json`: asks its `rlfleet up` to shut down,
    and kills the children directly if that process is gone. Returns False when no fleet is recorded."""
    path = Path(state_dir) / "fleet.json"
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    owner = int(state["pid"])
    try:
        os.kill(owner, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and path.exists():
            time.sleep(0.2)
        if not path.exists():
            return True
    except ProcessLookupError:
        pass
    for pid in reversed(list(state["processes"].values())):
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    path.unlink(missing_ok=True)
    return True
