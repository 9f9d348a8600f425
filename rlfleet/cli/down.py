"""`rlfleet down`: stop the fleet recorded in <state-dir>/fleet.json, from any shell.

While the process that started the fleet (`rlfleet up`, `rlfleet demo`) runs, `down` asks it to stop the
fleet (SIGTERM: it stops every service in reverse order, each within its bound) and waits for it. When that
process is gone (killed, or it did not finish in time), `down` stops each recorded service itself the same
way: SIGTERM to it (to its process group when only helpers of it are left), and SIGKILL to the group only
after its stop bound, so the trainer can checkpoint. It says what it waits for as it goes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from rlfleet.local_fleet import KILLED_WITHIN_S, owner_runs, read_state, running_services, stop_timeout_s
from rlfleet.processes import group_runs, process_runs, send_stop
from rlfleet.redis_claim import CLAIM_TTL_S, release_gone_owner

DEFAULT_STATE_DIR = Path(".rlfleet")
OWNER_STOP_MARGIN_S = 30.0
"""What `down` allows the fleet's owner beyond its services' stop bounds: to react at all, and to remove
fleet.json, when it has started no service yet."""
PROGRESS_EVERY_S = 10.0
"""How often a wait for processes to stop says what it still waits for."""


def register(areas: argparse._SubParsersAction) -> None:
    down = areas.add_parser(
        "down", help="stop the fleet started by `rlfleet up` or `rlfleet demo` (also while it is starting)"
    )
    down.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="the state directory `rlfleet up` used")
    down.set_defaults(func=run_down)


def run_down(args: argparse.Namespace) -> int:
    state = read_state(args.state_dir)
    if state is None:  # stopping what is not running succeeds, as a second `down` after a first one
        print(f"no fleet recorded in {args.state_dir / 'fleet.json'}: nothing to stop", flush=True)
        return 0
    print(f"stopping the fleet of pid {state['pid']} ({state.get('state', 'up')}) ...", flush=True)
    stop_from_state(args.state_dir, say=lambda line: print(line, flush=True))
    if read_state(args.state_dir) is not None:  # kept for what outlived even SIGKILL (stop_from_state said which)
        print(
            f"rlfleet: error: the fleet did not stop: try `rlfleet down --state-dir {args.state_dir}` again",
            file=sys.stderr,
        )
        return 1
    print("fleet stopped", flush=True)
    return 0


def stop_from_state(state_dir: Path, say: Callable[[str], None]) -> bool:
    """Stops the fleet recorded in `<state_dir>/fleet.json`, started or still starting, saying what it does.
    A recorded pid that now names another process is left alone. Returns False when no fleet is recorded."""
    state = read_state(state_dir)
    if state is None:
        return False
    owner = int(state.get("pid", 0))
    if owner and owner_runs(state):
        if _wait_for_owner(state_dir, owner, say):
            return True
        state = read_state(state_dir) or state  # a starting fleet may have recorded more processes meanwhile
        say(f"the process that started the fleet (pid {owner}) did not stop it in time: stopping its services")
    else:
        say(f"the process that started the fleet (pid {owner}) is gone: stopping its services one by one")
    services = running_services(state)
    left = stop_services({name: pid for name, pid in services.items() if name != "redis"}, say)
    if not owner_runs(state):  # what its owner would have cleared is left: before a Redis of its own stops
        release_claim(state, state_dir, say)
        delete_scratch_keys(state, say)
    left += stop_services({name: pid for name, pid in services.items() if name == "redis"}, say)
    if left:  # the record stays, naming them, for the next `down`
        say(f"{', '.join(left)} still running after SIGKILL: {Path(state_dir) / 'fleet.json'} keeps them")
    else:
        (Path(state_dir) / "fleet.json").unlink(missing_ok=True)
    return True


def release_claim(state: dict[str, Any], state_dir: Path, say: Callable[[str], None]) -> None:
    """Deletes the claim of the fleet's Redis key prefix that its killed owner left, if it still holds it,
    so the next `up` on the prefix need not wait until it lapses."""
    where = _redis_keys(state)
    if where is None:  # recorded before the fleet had claimed anything
        return
    url, prefix = where
    try:
        if release_gone_owner(url, prefix, state_dir, int(state["pid"])):
            say(f"released key prefix {prefix!r} at Redis {url}")
    except redis.RedisError as exc:
        say(f"could not release key prefix {prefix!r} at Redis {url} ({exc}): it lapses within {CLAIM_TTL_S:g} s")


def delete_scratch_keys(state: dict[str, Any], say: Callable[[str], None]) -> None:
    """Deletes the keys of a fleet whose keys were its scratch (a demo's), which its killed owner left, unless the
    Redis is the fleet's own (it keeps them with its data)."""
    where = _redis_keys(state)
    if where is not None and state["config"].get("scratch_keys") and "redis" not in state.get("processes", {}):
        delete_keys(*where, say)


def _redis_keys(state: dict[str, Any]) -> tuple[str, str] | None:
    """The URL of the fleet's Redis and its key prefix, as recorded; None when the record has no config yet."""
    config: Any = state.get("config")
    try:
        return config["redis_url"] or f"redis://{config['host']}:{config['ports']['redis']}/0", str(
            config["redis_prefix"]
        )
    except (KeyError, TypeError):
        return None


def delete_keys(redis_url: str, prefix: str, say: Callable[[str], None]) -> None:
    """Removes every key under `prefix` (a demo's own); a Redis that does not answer (the fleet never reached it)
    leaves nothing to remove, which `say` tells."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
            say(f"deleted {len(keys)} Redis keys {prefix}* at {redis_url}")
    except redis.RedisError as exc:
        say(f"could not delete the Redis keys {prefix}* at {redis_url}: {exc}")
    finally:
        client.close()


def _wait_for_owner(state_dir: Path, owner: int, say: Callable[[str], None]) -> bool:
    """SIGTERM to the fleet's owner, then waits until it has removed fleet.json (True), or has exited without
    doing so or the bound has passed (False). The bound lets every recorded service (more may be recorded
    meanwhile, while the fleet starts) take its whole stop bound, one after the other, as the owner stops them."""
    try:
        os.kill(owner, signal.SIGTERM)
        os.kill(owner, signal.SIGCONT)  # an `up` suspended with Ctrl-Z would hold the SIGTERM until resumed
    except ProcessLookupError:
        return False
    started = said = time.monotonic()
    while (state := read_state(state_dir)) is not None and process_runs(owner):
        bound = OWNER_STOP_MARGIN_S + sum(stop_timeout_s(name) for name in state.get("processes", {}))
        waited = time.monotonic() - started
        if waited > bound:
            return False
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            still = ", ".join(running_services(state)) or "no service"
            say(f"  waiting for pid {owner} to stop the fleet: {still} running ({waited:.0f} s, at most {bound:.0f})")
            said = time.monotonic()
        time.sleep(0.2)
    return state is None


def stop_services(services: dict[str, int], say: Callable[[str], None]) -> list[str]:
    """Stops processes that are not this one's children, in reverse order: SIGTERM to each (`send_stop`), then
    SIGKILL to what is left of its process group (the service, or helpers that outlive it) after its stop bound
    (stop_timeout_s). Returns those whose group still runs KILLED_WITHIN_S after SIGKILL (a process stuck in the
    kernel outlasts even that)."""
    left = []
    for name, pid in reversed(list(services.items())):
        bound = stop_timeout_s(name)
        say(f"stopping {name} (pid {pid}) ...")
        if not send_stop(pid):
            say(f"{name} stopped")
            continue
        started = said = time.monotonic()
        while group_runs(pid) and time.monotonic() - started < bound:
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                say(f"  {name} still stopping ({time.monotonic() - started:.0f} s of at most {bound:g} s)")
                said = time.monotonic()
            time.sleep(0.1)
        if not group_runs(pid):
            say(f"{name} stopped")
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        say(f"{name} did not stop within {bound:g} s of SIGTERM: killed")
        killed_by = time.monotonic() + KILLED_WITHIN_S
        while group_runs(pid) and time.monotonic() < killed_by:
            time.sleep(0.05)
        if group_runs(pid):
            left.append(name)
    return left
