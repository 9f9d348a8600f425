"""A fleet's claim of its Redis key prefix: one live fleet per (Redis, prefix).

Two fleets on one prefix share the run queue, the run records and the sample streams: one's orchestrator takes
the other's runs, one's trainer reads the other's groups. So `rlfleet up` and `rlfleet demo` (LocalFleet) hold
the key `<prefix>fleet:claim` from before they start any service that uses Redis until those have stopped, and a
second fleet on the pair is refused, told which fleet holds it (host, pid, state directory) and what to do.

The claim lives in Redis itself, the one place every fleet on that Redis sees, from any machine or container,
whatever URL it was given (localhost or 127.0.0.1). It is a lease, not a record of an owner whose liveness is
checked: a key with a TTL (CLAIM_TTL_S) that the owning process renews every RENEW_EVERY_S from a thread. A pid
says nothing on another machine or in another container's pid namespace (and hostnames repeat across
containers), while a TTL is counted by Redis's clock alone: a fleet whose `rlfleet up` was SIGKILLed, or whose
machine died, frees the pair within the TTL, without anyone's help. The stored value holds a random token, and
taking, renewing and releasing compare it in one Lua script each: a claim that lapsed (its owner frozen for
longer than the TTL) and was taken by another fleet is never renewed over nor deleted by the first. A renewal
that finds the key gone (a Redis restarted without it) takes it again. `rlfleet down`, on the owner's host,
deletes the claim of a fleet whose owner is gone once it has stopped its services (`release_gone_owner`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlfleet.errors import Conflict, Unavailable
from rlfleet.processes import ServiceStartError

logger = logging.getLogger(__name__)

CLAIM_TTL_S = 30.0
"""How long a claim outlives its last renewal: the longest a killed fleet keeps its prefix from the next."""
RENEW_EVERY_S = 5.0
"""Renewals come this often: a few may fail (Redis restarting, a busy machine) before the claim lapses."""
REDIS_TIMEOUT_S = 5.0
"""Bound on connecting to Redis and on each answer; a failed call is not retried by the client (the next
renewal is the retry)."""

# Sets the claim when it is free or already this value (a renewal); else answers the value that holds it.
_TAKE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def claim_key(prefix: str) -> str:
    return f"{prefix}fleet:claim"


class RedisClaim:
    """The claim of (`redis_url`, `prefix`) by the fleet of `state_dir` that this process runs."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        state_dir: Path,
        ttl_s: float = CLAIM_TTL_S,
        renew_every_s: float = RENEW_EVERY_S,
    ) -> None:
        self.redis_url, self.prefix, self.key = redis_url, prefix, claim_key(prefix)
        self.ttl_s, self.renew_every_s = ttl_s, renew_every_s
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "state_dir": str(Path(state_dir).absolute())}
        self.value = json.dumps({"token": uuid.uuid4().hex, **owner})
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._lock = threading.Lock()
        """Held around each call that writes the key: no renewal lands after the release."""
        self._released = threading.Event()

    def acquire(self) -> None:
        """Takes the claim, then renews it from a daemon thread until `release`. ServiceStartError naming the
        pair, the fleet that holds it and what to do when another fleet does."""
        try:
            held = self._take()
        except redis.RedisError as exc:
            self._client.close()
            raise ServiceStartError(
                f"could not claim key prefix {self.prefix!r} at Redis {self.redis_url}: {exc}"
            ) from exc
        if held is not None:
            self._client.close()
            raise ServiceStartError(refusal(self.redis_url, self.prefix, held, self.ttl_s))
        threading.Thread(target=self._renew, name=f"claim {self.key}", daemon=True).start()

    def release(self) -> None:
        """Stops renewing and deletes the claim if it is still this one's. When Redis does not answer, the
        claim lapses by itself within the TTL."""
        if self._released.is_set():
            return
        self._released.set()
        with self._lock:
            try:
                self._client.eval(_RELEASE, 1, self.key, self.value)
            except redis.RedisError as exc:
                logger.warning("could not release %s at %s (%s); it lapses by itself", self.key, self.redis_url, exc)
            finally:
                self._client.close()

    def _take(self) -> str | None:
        """None once the claim is this one's; else the value of the claim that holds the pair."""
        held = self._client.eval(_TAKE, 1, self.key, self.value, int(self.ttl_s * 1000))
        return None if held is None else held.decode(errors="replace")

    def _renew(self) -> None:
        while not self._released.wait(self.renew_every_s):
            with self._lock:
                if self._released.is_set():
                    return
                try:
                    held = self._take()
                except redis.RedisError as exc:
                    logger.warning(
                        "could not renew %s at %s (%s); it lapses %g s after the last renewal unless one succeeds",
                        self.key,
                        self.redis_url,
                        exc,
                        self.ttl_s,
                    )
                    continue
            if held is not None:  # both fleets now run on the prefix: say so, once
                logger.error(
                    "this fleet's %s lapsed and another fleet took it: %s",
                    self.key,
                    refusal(self.redis_url, self.prefix, held, self.ttl_s),
                )
                return


def release_gone_owner(redis_url: str, prefix: str, state_dir: Path, pid: int) -> bool:
    """Deletes the claim of (`redis_url`, `prefix`) if the fleet of `state_dir` started by pid `pid` on this
    host holds it, for `rlfleet down` once that process is gone (killed): the next fleet need not wait out
    the TTL. Whether it deleted it; a redis.RedisError when Redis does not answer."""
    client = redis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        held = client.get(claim_key(prefix))
        if held is None:
            return False
        try:
            owner = json.loads(held)
            ours = (
                owner["host"] == socket.gethostname()
                and owner["pid"] == pid
                and Path(owner["state_dir"]).resolve() == Path(state_dir).resolve()
            )
        except (ValueError, TypeError, KeyError):  # not written by RedisClaim
            return False
        # Deleted only while it still holds that value: a fleet that took the lapsed claim meanwhile keeps it.
        return bool(ours and client.eval(_RELEASE, 1, claim_key(prefix), held))
    finally:
        client.close()


def refuse_if_held(redis_url: str, prefix: str) -> None:
    """Conflict naming the fleet that holds the pair now, Unavailable when Redis does not answer: for a command with
    long work to do before its fleet starts and claims the pair (`rlfleet demo` trains its warm start first)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        held = client.get(claim_key(prefix))
    except redis.RedisError as exc:
        raise Unavailable(f"could not read the claim of key prefix {prefix!r} at Redis {redis_url}: {exc}") from exc
    finally:
        client.close()
    if held is not None:
        text = held.decode(errors="replace") if isinstance(held, bytes) else str(held)
        raise Conflict(refusal(redis_url, prefix, text, CLAIM_TTL_S))


def refusal(redis_url: str, prefix: str, held: str, ttl_s: float) -> str:
    """Why a fleet may not use (`redis_url`, `prefix`): `held`, the claim's value, names the fleet holding it."""
    try:
        owner = json.loads(held)
        holder = f"`rlfleet up` or `rlfleet demo` pid {owner['pid']} on {owner['host']}"
        state_dir = str(owner["state_dir"])
    except (ValueError, TypeError, KeyError):  # not written by RedisClaim
        holder, state_dir = f"{claim_key(prefix)} = {held!r}", "DIR"
    return (
        f"Redis {redis_url} with key prefix {prefix!r} is held by another fleet: {holder}, state dir "
        f"{state_dir}; stop it with `rlfleet down --state-dir {state_dir}` (on its host), or give this fleet "
        f"another --redis-prefix. Two fleets on one prefix would take each other's runs and samples. A fleet "
        f"whose `rlfleet up` was killed frees it within {ttl_s:g} s, or once `rlfleet down` has stopped it"
    )
