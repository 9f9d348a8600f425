"""The whole fleet on one machine as child processes: what `rlfleet up` and `make demo` run.

Start order follows the dependencies (Redis, engines, router, reward hub, trainer, orchestrator);
each service must answer its health check within a bound before the next starts, and a failure
names the service and shows the end of its log. Every port is checked before anything starts (a
port in use is an error naming it and its service), and a health check counts only when the child
itself listens on the port. Stopping goes in reverse order. The fleet's pids and addresses are
written to `<state_dir>/fleet.json` from the first process on, so `rlfleet down` can stop it from
elsewhere while it is still starting, and `rlfleet submit|runs|watch|cancel` find its Runs API.

Any one service, Redis included when the fleet started it, can be started again with the same
command (`restart`), which is how the fault tests bring back what they killed.

One fleet per state directory: a fleet.json whose owner (`rlfleet up`, `rlfleet demo`) or any recorded
service still runs is never overwritten or removed by another process, only by `rlfleet down`, which gives
each service SIGTERM and the time it needs to stop (the trainer checkpoints) before it is killed. One fleet
per Redis key prefix: the fleet claims (Redis, prefix) once its Redis answers, before any other service
starts, and releases the claim once those have stopped (redis_claim.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from rlfleet.process_identity import is_another_process, start_time
from rlfleet.processes import (
    ServiceProcess,
    ServiceStartError,
    StartInterrupted,
    command_line,
    free_port,
    free_port_block,
    group_runs,
    port_is_free,
    process_runs,
)
from rlfleet.redis_claim import RedisClaim

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
"""How long a service gets from SIGTERM to its exit before it is killed, unless SLOW_STOPS_S says otherwise."""
SLOW_STOPS_S = {"trainer": 60.0, "rollout": 60.0}
"""Services whose stop waits on work that must not be lost. The trainer gives its gRPC server 5 s, then
every run up to 30 s to end its step and checkpoint (rlfleet_trainer `serve`, TrainerCore.shutdown), then
torchrun ends its ranks; the orchestrator waits out a trainer call in flight (trainer_call_timeout_s, 30 s)
plus its servers' grace (5 s each)."""
KILLED_WITHIN_S = 2.0
"""How long a service sent SIGKILL after its stop failed may take to end before it counts as still running."""


def stop_timeout_s(name: str) -> float:
    """The bound on service `name`'s stop, the same for `rlfleet up` stopping it and `rlfleet down`."""
    return SLOW_STOPS_S.get(name, STOP_TIMEOUT_S)


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

    @classmethod
    def from_base(cls, base: int, engines: int) -> FleetPorts:
        """`base` and the ports after it, in the order of the defaults' first three (Runs API, reward hub,
        trainer HTTP: 8000-8002), then the gRPC ports, the router and the engines (Redis keeps its default)."""
        last = base + 7 + engines - 1
        if base < 1024 or last > 65535:
            raise ValueError(f"--base-port {base}: the fleet needs ports {base}-{last}, which must lie in 1024-65535")
        if base <= cls.redis <= last:
            raise ValueError(
                f"--base-port {base}: the fleet's ports {base}-{last} include Redis's {cls.redis}; choose a range "
                "without it"
            )
        return cls(
            rollout=base,
            reward=base + 1,
            trainer_http=base + 2,
            rollout_grpc=base + 3,
            trainer_grpc=base + 4,
            reward_grpc=base + 5,
            router=base + 6,
            engine_base=base + 7,
        )

    def named(self, engines: int) -> dict[int, str]:
        """Every port a fleet of `engines` engines binds (Redis apart), with what listens there."""
        named = {
            self.rollout: "orchestrator REST",
            self.rollout_grpc: "orchestrator gRPC",
            self.reward: "reward hub HTTP",
            self.reward_grpc: "reward hub gRPC",
            self.trainer_grpc: "trainer gRPC",
            self.trainer_http: "trainer HTTP",
            self.router: "router",
        }
        named.update({self.engine_base + i: f"engine-{i}" for i in range(engines)})
        if len(named) < 7 + engines:
            raise ValueError(f"two services of the fleet are given the same port: {self}")
        return named


def check_ports_free(host: str, ports: dict[int, str]) -> None:
    """ServiceStartError naming each of `ports` (port -> what listens there) that something already binds."""
    busy = [f"{port} ({what})" for port, what in sorted(ports.items()) if not port_is_free(port, host)]
    if busy:
        raise ServiceStartError(
            f"port{'s' if len(busy) > 1 else ''} already in use on {host}: {', '.join(busy)}. Another fleet "
            "may be running (`rlfleet down --state-dir DIR` stops the one started from DIR), or choose other "
            "ports: `rlfleet up --base-port 9000` (9000 and the ports after it) or `rlfleet up --free-ports`, "
            "each with its own --state-dir; `rlfleet submit|runs|watch|cancel --state-dir DIR` then find it"
        )


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
    scratch_keys: bool = False
    """The fleet's Redis keys under `redis_prefix` are its own scratch (a demo's prefix): deleted once it stops,
    by the command that started it or by `rlfleet down` after that command was killed. A Redis of the fleet's own
    keeps them, under <state_dir>/redis."""
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


@dataclass(frozen=True)
class _Command:
    argv: list[str]
    health_url: str
    """HTTP URL answering 200 once the service is up, or the Redis URL of the fleet's Redis."""
    ports: dict[int, str]
    """Every port the service binds, with what listens there (for errors)."""
    env: dict[str, str]
    """The service's own environment, under the fleet's `env`."""


def router_policy(engine_backend: str) -> str:
    """The router's policy in front of engines of `engine_backend`: cache_aware follows the engines' prefix
    caches, which SGLang keeps and the CPU engine does not (there the least-loaded engine is the best pick)."""
    return "cache_aware" if engine_backend == "sglang" else "least_load"


class LocalFleet:
    def __init__(self, config: FleetConfig) -> None:
        if config.engines < 1:
            raise ValueError(f"engines must be >= 1, got {config.engines}")
        if not (Path(config.model_path) / "config.json").exists():
            raise FileNotFoundError(f"no Hugging Face model at {config.model_path} (config.json missing)")
        self.config = config
        self.processes: dict[str, ServiceProcess] = {}
        self.log_dir = Path(config.state_dir) / "logs"
        self.state_path = Path(config.state_dir) / "fleet.json"
        self.stopping = threading.Event()
        """Set by `request_stop` (from a signal handler): start and restart give up waiting and raise
        StartInterrupted."""
        self.left_running: list[str] = []
        """What the last `stop` left running (as it returns it), read where its result cannot be: after a failed
        `start` (the error it raises is the start's), or a stop in a `finally`."""
        self._commands: dict[str, _Command] = {}
        self._started: dict[str, float | None] = {}
        self._up = False
        self._claim: RedisClaim | None = None

    # -- addresses ------------------------------------------------------------------------------

    def url(self, port: int) -> str:
        return f"http://{self.config.host}:{port}"

    @property
    def api_url(self) -> str:
        return self.url(self.config.ports.rollout)

    @property
    def grpc_address(self) -> str:
        """The Runs API over gRPC (`rlfleet.v1.Runs`), host:port."""
        return f"{self.config.host}:{self.config.ports.rollout_grpc}"

    @property
    def router_url(self) -> str:
        return self.url(self.config.ports.router)

    @property
    def reward_url(self) -> str:
        return self.url(self.config.ports.reward)

    def engine_urls(self) -> list[str]:
        return [self.url(self.config.ports.engine_base + i) for i in range(self.config.engines)]

    @property
    def owns_redis(self) -> bool:
        """Whether the fleet started its Redis (none answered), rather than using one that runs anyway."""
        return "redis" in self._commands

    def named_ports(self) -> dict[int, str]:
        """Every port the fleet's services bind (Redis apart), with what listens there."""
        return self.config.ports.named(self.config.engines)

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> LocalFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts every service, or none: on any failure (or `request_stop`) what started is stopped again."""
        refuse_running_fleet(self.config.state_dir)
        try:
            self._write_state()
            check_ports_free(self.config.host, self.named_ports())
            self._start_all()
            self._up = True
            self._write_state()
        except BaseException:
            self.stop()
            raise

    def request_stop(self) -> None:
        """Makes a start or restart in progress give up (safe to call from a signal handler)."""
        self.stopping.set()

    def stop(self) -> list[str]:
        """Stops every service in reverse order, each within its bound (stop_timeout_s), releases the claim of
        the Redis key prefix once every service that uses Redis has stopped (before a Redis of its own stops,
        whose AOF would keep it), and removes fleet.json if this process wrote it. Returns the services still
        running after all that ([] when every one stopped; also `left_running`, for a caller whose start failed), for
        the caller to say so rather than "stopped".

        An error while stopping one service (an interrupted wait, a service still there after SIGKILL) never leaves
        the others running: it is logged naming the service, the service's process group is killed (SIGKILL), and
        the next service is stopped all the same. One still there after that keeps fleet.json, naming it, for
        `rlfleet down`. Once every service has been tried, the first error that is not a stop failing (OSError,
        SubprocessError: reported by the log, the record and the names returned), such as a KeyboardInterrupt, is
        raised again, with a note naming the service it interrupted."""
        failed: dict[str, ServiceProcess] = {}
        errors: list[BaseException] = []
        for name in reversed(list(self.processes)):
            if name == "redis":
                self._release_claim_noting(errors)
            process = self.processes.pop(name)
            try:
                _stop_service(name, process)
            except BaseException as exc:  # noqa: BLE001 - raised again below, once every service was tried
                _kill_group(process)
                logger.error("could not stop %s (pid %d): %s", name, process.pid, exc or type(exc).__name__)
                exc.add_note(f"while stopping {name} (pid {process.pid})")
                failed[name] = process
                errors.append(exc)
        self._release_claim_noting(errors)
        left = self.left_running = _still_running(failed)
        if left:
            logger.error(
                "%s still running: %s keeps them; `rlfleet down --state-dir %s` tries again",
                ", ".join(left),
                self.state_path,
                self.config.state_dir,
            )
        else:
            remove_own_record(self.config.state_dir)
        unreported = [exc for exc in errors if not isinstance(exc, (OSError, subprocess.SubprocessError))]
        if unreported:
            raise unreported[0]
        return left

    def _release_claim_noting(self, errors: list[BaseException]) -> None:
        """Releases the claim of the Redis key prefix; what that raises goes in `errors`, for `stop` to raise once
        every service was tried."""
        try:
            self._release_claim()
        except BaseException as exc:  # noqa: BLE001 - raised again by stop
            logger.error("could not release the claim of Redis key prefix %s: %s", self.config.redis_prefix, exc)
            exc.add_note(f"while releasing the claim of Redis key prefix {self.config.redis_prefix}")
            errors.append(exc)

    def _release_claim(self) -> None:
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _start_all(self) -> None:
        self._ensure_redis()  # may give the fleet a Redis port of its own: read the config after it
        c, p, py = self.config, self.config.ports, sys.executable
        claim = RedisClaim(c.resolved_redis_url(), c.redis_prefix, c.state_dir)
        claim.acquire()  # refuses a (Redis, prefix) pair another live fleet uses, before anything uses it
        self._claim = claim
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
                {p.engine_base + i: f"engine-{i}"},
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
                policy=router_policy(c.engine_backend),
            ),
            f"{self.router_url}/health",
            {p.router: "router"},
        )
        self._wait("router")
        self._spawn(
            "reward",
            command_line(py, "-m", "rlfleet_reward", host=c.host, port=p.reward, grpc_port=p.reward_grpc),
            f"{self.reward_url}/health",
            {p.reward: "reward hub HTTP", p.reward_grpc: "reward hub gRPC"},
            {"RLFLEET_REWARD_JUDGE_ROUTER_URLS": json.dumps([self.router_url])},  # `judge` grades on this fleet
        )
        self._spawn(
            "trainer",
            command_line(
                py,
                "-m",
                "rlfleet_trainer.launcher",
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
            {p.trainer_http: "trainer HTTP", p.trainer_grpc: "trainer gRPC"},
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
            {p.rollout: "orchestrator REST", p.rollout_grpc: "orchestrator gRPC"},
        )
        self._wait("rollout")

    def restart(self, name: str) -> None:
        """Starts service `name` again with the same command (after a crash, or killing it) and
        waits until it is healthy. It keeps its place in the stop order."""
        if name not in self._commands:
            raise KeyError(f"{name!r} is not a service this fleet started; it has {sorted(self._commands)}")
        command = self._commands[name]
        self.processes[name].stop(timeout=stop_timeout_s(name))
        self._spawn(name, command.argv, command.health_url, command.ports, command.env)
        self._wait(name)
        self._write_state()

    def _spawn(
        self, name: str, argv: list[str], health_url: str, ports: dict[int, str], env: dict[str, str] | None = None
    ) -> None:
        """Starts `name` once its ports are free (another process may have taken one since the check at the
        start), and records it in fleet.json at once, so `rlfleet down` can stop it even mid-start."""
        if self.stopping.is_set():
            raise StartInterrupted(f"stopped before {name} started")
        check_ports_free(self.config.host, ports)
        own = env or {}
        full = {"RLFLEET_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **own, **self.config.env}
        self._commands[name] = _Command(argv, health_url, ports, own)
        self.processes[name] = ServiceProcess(name, argv, self.log_dir / f"{name}.log", env=full)
        self._started[name] = start_time(self.processes[name].pid)
        self._write_state()

    def _wait(self, name: str) -> None:
        command = self._commands[name]
        health_url = command.health_url
        started = time.monotonic()
        if health_url.startswith("redis://"):
            self._wait_redis(name, health_url)
        else:
            self.processes[name].wait_healthy(
                health_url,
                timeout=self.config.startup_timeout_s,
                port=urlsplit(health_url).port,
                stop=self.stopping,
                ports=command.ports,
            )
        logger.info("%s healthy after %.1fs", name, time.monotonic() - started)

    def _ensure_redis(self) -> None:
        url = self.config.resolved_redis_url()
        error = redis_error(url)
        if error is None:
            owner = None if self.config.redis_url is not None else fleet_owning_redis(url)
            if owner is None or owner.resolve() == Path(self.config.state_dir).resolve():
                return
            # Another fleet's own Redis stops with that fleet: this one would lose its Redis under it.
            self.config = replace(self.config, ports=replace(self.config.ports, redis=free_port()))
            logger.warning(
                "the Redis at %s was started by the fleet in %s and stops with it: this fleet starts its own at %s",
                url,
                owner,
                self.config.resolved_redis_url(),
            )
            url = self.config.resolved_redis_url()
        elif self.config.redis_url is not None or not _is_silent(error):
            raise ServiceStartError(describe_redis_error(url, error))
        server = shutil.which("redis-server")
        if server is None:
            raise ServiceStartError("no Redis answers and redis-server is not installed (apt-get install redis-server)")
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
            {self.config.ports.redis: "Redis"},
        )
        self._wait("redis")

    def _wait_redis(self, name: str, url: str) -> None:
        """Redis started from its AOF answers once the file is loaded: bounded by the startup timeout."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while redis_error(url) is not None:
            if self.stopping.is_set():
                raise StartInterrupted("stopped while waiting for Redis")
            if time.monotonic() > deadline or not self.processes[name].alive():
                raise ServiceStartError(f"redis-server did not answer at {url}; see {self.processes[name].log_path}")
            time.sleep(0.1)

    def _write_state(self) -> None:
        """fleet.json: `state` is `starting` until every service is healthy, then `up`; `started` holds the
        start time of this process (`up`) and of each service, which tells a recorded pid from a later process
        given the same one."""
        _write_record(
            self.config.state_dir,
            {
                "pid": os.getpid(),
                "state": "up" if self._up else "starting",
                "processes": {name: proc.pid for name, proc in self.processes.items()},
                "started": {"up": start_time(os.getpid()), **self._started},
                "api_url": self.api_url,
                "grpc_address": self.grpc_address,
                "router_url": self.router_url,
                "reward_url": self.reward_url,
                "engines": self.engine_urls(),
                "config": json.loads(json.dumps(asdict(self.config), default=str)),
            },
        )


def _stop_service(name: str, process: ServiceProcess) -> None:
    """SIGTERM, then SIGKILL after the service's bound (`ServiceProcess.stop`), saying how it went."""
    running = process.alive()
    code = process.stop(timeout=stop_timeout_s(name))
    # The code a stopped process exits with says nothing of how it ran (a service may exit non-zero on SIGTERM).
    if running:
        logger.info("stopped %s", name)
    else:
        logger.warning("%s had already exited (exit code %s)", name, code)


def _kill_group(process: ServiceProcess) -> None:
    """SIGKILL to what is left of `process`'s group (the service and its helpers), after its stop failed part
    way: an interrupted wait left it running. Never raises, so the services after it are stopped all the same."""
    try:
        if group_runs(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    except (OSError, ValueError):  # gone meanwhile, or not ours to signal: nothing more to do from here
        pass


def _still_running(processes: dict[str, ServiceProcess]) -> list[str]:
    """Which of `processes`, each sent SIGKILL after its stop failed, still run once the kernel has had
    KILLED_WITHIN_S to end them: a process stuck in the kernel (uninterruptible I/O) outlasts even SIGKILL."""
    deadline = time.monotonic() + KILLED_WITHIN_S

    def runs(process: ServiceProcess) -> bool:
        return process.alive() or group_runs(process.pid)

    while any(runs(process) for process in processes.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [name for name, process in processes.items() if runs(process)]


def _write_record(state_dir: Path, state: dict[str, Any]) -> None:
    """fleet.json replaced whole: readers never see half a file."""
    path = Path(state_dir) / "fleet.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(state, indent=2) + "\n")
    partial.replace(path)


def record_starting(state_dir: Path) -> None:
    """Records this process as the owner of a fleet that has started no service yet (`rlfleet up` creating
    its model), so `rlfleet down` can stop it already: refuses a state directory whose fleet runs."""
    refuse_running_fleet(state_dir)
    _write_record(
        state_dir,
        {"pid": os.getpid(), "state": "starting", "processes": {}, "started": {"up": start_time(os.getpid())}},
    )


def remove_own_record(state_dir: Path) -> None:
    """Removes fleet.json if this process wrote it: another's (a fleet whose services still run, a record
    that cannot be read) stays for `rlfleet down` or the user."""
    try:
        state = read_state(state_dir)
    except ValueError:
        return
    if state is not None and state.get("pid") == os.getpid():
        (Path(state_dir) / "fleet.json").unlink(missing_ok=True)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The fleet recorded in `<state_dir>/fleet.json`, or None when there is none."""
    try:
        state = json.loads((Path(state_dir) / "fleet.json").read_text())
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise ValueError(f"state dir {state_dir} is a file, not a directory; choose another --state-dir") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {Path(state_dir) / 'fleet.json'}: {exc}; delete it if no fleet runs") from exc
    if not isinstance(state, dict):
        return None
    # Every record names its owner: without a pid, `down` and the Runs API's lookup would fail on the first use.
    if not isinstance(state.get("pid"), int) or isinstance(state["pid"], bool):
        raise ValueError(
            f"{Path(state_dir) / 'fleet.json'} is not a fleet record (it names no pid of the `rlfleet up` or "
            "`rlfleet demo` that started a fleet); delete it if no fleet runs"
        )
    return state


def running_fleet(state_dir: Path) -> str | None:
    """What still runs of the fleet recorded in `<state_dir>/fleet.json`, said as what follows "a fleet started
    from DIR"; None when nothing does, or the record is this process's own."""
    state = read_state(state_dir)
    if state is None or state.get("pid") == os.getpid():
        return None
    owner = int(state.get("pid", 0))
    if owner and owner_runs(state):
        return f"is {state.get('state', 'running')} (`rlfleet up` or `rlfleet demo`, pid {owner})"
    alive = running_services(state)
    if not alive:
        return None
    services = ", ".join(f"{name} (pid {pid})" for name, pid in alive.items())
    return f"still runs without the process that started it (pid {owner}): {services}"


def refuse_running_fleet(state_dir: Path) -> None:
    """One fleet per state directory: a second would overwrite the first one's fleet.json (and remove it on
    failure), leaving the first running where `rlfleet down` cannot find it."""
    what = running_fleet(state_dir)
    if what is not None:
        raise ServiceStartError(
            f"a fleet started from {state_dir} {what}; stop it with `rlfleet down --state-dir {state_dir}`, or "
            "give this one another --state-dir"
        )


def owner_runs(state: dict[str, Any]) -> bool:
    """Whether the process that wrote `state` still runs (its pid not reused by another process since)."""
    owner = int(state["pid"])
    return process_runs(owner) and not is_another_process(owner, state.get("started", {}).get("up"))


def running_services(state: dict[str, Any]) -> dict[str, int]:
    """The recorded services that still run, by name (a pid now naming another process is not one of them)."""
    started = state.get("started", {})
    return {
        name: int(pid)
        for name, pid in state.get("processes", {}).items()
        if process_runs(int(pid)) and not is_another_process(int(pid), started.get(name))
    }


def redis_error(url: str) -> redis.RedisError | None:
    """What pinging the Redis at `url` raised; None when it answered."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as exc:
        return exc
    return None


def fleet_owning_redis(url: str) -> Path | None:
    """The state directory of the local fleet whose own Redis answers at `url` (one `up` started because none
    answered, with its data in <state dir>/redis), else None: a Redis that runs anyway, or one that does not
    say where it keeps its data."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            data_dir = Path(str(client.config_get("dir").get("dir", "")))
        finally:
            client.close()
    except redis.RedisError:  # CONFIG renamed or not allowed, or the Redis went away meanwhile
        return None
    if data_dir.name == "redis" and (data_dir.parent / "fleet.json").is_file():
        return data_dir.parent
    return None


def _is_silent(error: redis.RedisError) -> bool:
    """Nothing answered (no server, or it hangs), as opposed to a Redis that answered with an error."""
    silent = isinstance(error, (redis.ConnectionError, redis.TimeoutError))
    return silent and not isinstance(error, redis.AuthenticationError)


def describe_redis_error(url: str, error: redis.RedisError) -> str:
    if _is_silent(error):
        return f"Redis at {url} does not answer ({error}); start it, or drop --redis-url to have one started"
    return f"Redis at {url} answered with an error: {error}; check the URL's database index and credentials"
