"""One live fleet per (Redis, key prefix): a second claim of the pair is refused, naming the owner and what to
do; the owner keeps its claim past the TTL by renewing it (and takes it again when Redis lost it), and frees it
when it stops, never deleting a claim another fleet took since; a fleet whose owner was SIGKILLed frees the
pair within the TTL. LocalFleet claims the pair before it starts any service that uses Redis, also in a Redis
it starts itself, and releases it before that Redis stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from rlfleet.local_fleet import FleetConfig, FleetPorts, LocalFleet
from rlfleet.processes import ServiceStartError, free_port
from rlfleet.redis_claim import RedisClaim, claim_key

REDIS_URL = os.environ.get("RLFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its claim key (the only key a claim writes) is deleted afterwards."""
    prefix = f"rlfleet-test-claim:{uuid.uuid4().hex}:"
    yield prefix
    client.delete(claim_key(prefix))


@pytest.fixture
def claims() -> Iterator[Callable[..., RedisClaim]]:
    """Makes claims that are released after the test, should it not have released them."""
    made: list[RedisClaim] = []

    def make(prefix: str, state_dir: Path, **timing: float) -> RedisClaim:
        made.append(RedisClaim(REDIS_URL, prefix, state_dir, **timing))
        return made[-1]

    yield make
    for claim in made:
        claim.release()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def test_a_second_claim_of_the_pair_is_refused_naming_the_owner_and_what_to_do(
    tmp_path: Path, prefix: str, claims: Callable[..., RedisClaim]
) -> None:
    claims(prefix, tmp_path / "first").acquire()
    with pytest.raises(ServiceStartError) as refused:
        claims(prefix, tmp_path / "second").acquire()
    said = str(refused.value)
    assert f"Redis {REDIS_URL} with key prefix {prefix!r} is held by another fleet" in said, said
    assert f"pid {os.getpid()} on {socket.gethostname()}, state dir {tmp_path / 'first'}" in said, said
    assert f"`rlfleet down --state-dir {tmp_path / 'first'}`" in said and "another --redis-prefix" in said, said
    assert "killed frees it within 30 s" in said, said
    claims(f"{prefix}other:", tmp_path / "third").acquire()  # another prefix on the same Redis is another pair


def test_release_frees_the_pair_and_never_deletes_a_claim_another_fleet_took_since(
    tmp_path: Path, prefix: str, client: redis.Redis, claims: Callable[..., RedisClaim]
) -> None:
    first = claims(prefix, tmp_path / "first")
    first.acquire()
    first.release()
    assert not client.exists(claim_key(prefix))
    lapsing = claims(prefix, tmp_path / "lapsing", ttl_s=0.5, renew_every_s=60.0)  # frozen: never renews
    lapsing.acquire()
    wait_until(lambda: not client.exists(claim_key(prefix)), 5.0, "the unrenewed claim lapsed")
    taker = claims(prefix, tmp_path / "taker")
    taker.acquire()
    lapsing.release()
    held = json.loads(client.get(claim_key(prefix)) or b"{}")
    assert held["state_dir"] == str(tmp_path / "taker"), held


def test_the_owner_renews_its_claim_past_the_ttl_and_takes_it_again_when_redis_lost_it(
    tmp_path: Path, prefix: str, client: redis.Redis, claims: Callable[..., RedisClaim]
) -> None:
    claims(prefix, tmp_path / "first", ttl_s=1.0, renew_every_s=0.2).acquire()
    time.sleep(2.5)
    with pytest.raises(ServiceStartError, match="held by another fleet"):
        claims(prefix, tmp_path / "second").acquire()
    client.delete(claim_key(prefix))  # as a Redis restarted without it would have
    wait_until(lambda: bool(client.exists(claim_key(prefix))), 5.0, "the owner took its claim again")
    with pytest.raises(ServiceStartError, match="held by another fleet"):
        claims(prefix, tmp_path / "second").acquire()


HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from rlfleet.redis_claim import RedisClaim\n"
    "RedisClaim(sys.argv[1], sys.argv[2], Path(sys.argv[3]), ttl_s=2.0, renew_every_s=0.2).acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_sigkilled_owner_frees_the_pair_within_the_ttl(
    tmp_path: Path, prefix: str, claims: Callable[..., RedisClaim]
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", HOLD, REDIS_URL, prefix, str(tmp_path / "killed")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "held\n"
        time.sleep(2.5)  # past one TTL: the owner renews while it runs
        with pytest.raises(ServiceStartError, match=rf"pid {owner.pid} on "):
            claims(prefix, tmp_path / "next").acquire()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        killed = time.monotonic()
        while True:
            try:
                claims(prefix, tmp_path / "next").acquire()
                break
            except ServiceStartError:
                assert time.monotonic() - killed < 5.0, "the killed owner's claim outlived its TTL"
                time.sleep(0.1)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)


def stub_model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


def test_a_fleet_claims_the_pair_before_its_first_service_and_releases_it_when_it_stops(
    tmp_path: Path, prefix: str, client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    held_at_spawn: list[bytes | str | None] = []

    def first_service_fails(self: LocalFleet, name: str, *args: object) -> None:
        held_at_spawn.append(client.get(claim_key(prefix)))
        raise ServiceStartError(f"{name} failed")

    monkeypatch.setattr(LocalFleet, "_spawn", first_service_fails)
    config = FleetConfig(
        model_path=stub_model(tmp_path),
        engines=1,
        state_dir=tmp_path / "state",
        ports=FleetPorts.free(1),
        redis_url=REDIS_URL,
        redis_prefix=prefix,
    )
    with pytest.raises(ServiceStartError, match="engine-0 failed"):
        LocalFleet(config).start()
    assert len(held_at_spawn) == 1 and held_at_spawn[0] is not None
    assert json.loads(held_at_spawn[0])["state_dir"] == str(tmp_path / "state")
    assert not client.exists(claim_key(prefix)), "the stopped fleet released its claim"


def test_a_redis_the_fleet_started_holds_its_claim_and_a_clean_stop_frees_it_for_the_next_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default: no Redis answers, so the fleet starts one (AOF in <state_dir>/redis). A second fleet on
    the default address gets a Redis of its own instead of one that stops with the first; a third named on
    the first's Redis with the same key prefix is refused. The claim is released before that Redis stops,
    so its AOF does not keep it for the next `up`."""
    spawn = LocalFleet._spawn
    refusals: list[str] = []
    second_redis: list[str] = []

    def fleet(state: str, redis_url: str | None = None) -> LocalFleet:
        return LocalFleet(
            FleetConfig(
                model_path=stub_model(tmp_path), engines=1, state_dir=tmp_path / state, ports=ports, redis_url=redis_url
            )
        )

    def engines_fail(self: LocalFleet, name: str, *args: object) -> None:
        if name == "redis":
            return spawn(self, name, *args)  # type: ignore[arg-type]
        if self.config.state_dir == tmp_path / "first":  # while the first fleet starts, two others try
            first_url = self.config.resolved_redis_url()
            second = fleet("second")
            with pytest.raises(ServiceStartError, match="engine-0 failed"):
                second.start()
            second_redis.append(second.config.resolved_redis_url())
            assert redis.Redis.from_url(first_url).ping(), "the second fleet's stop left the first's Redis alone"
            with pytest.raises(ServiceStartError) as refused:
                fleet("third", redis_url=first_url).start()
            refusals.append(str(refused.value))
        raise ServiceStartError(f"{name} failed")

    monkeypatch.setattr(LocalFleet, "_spawn", engines_fail)
    ports = replace(FleetPorts.free(1), redis=free_port())
    with pytest.raises(ServiceStartError, match="engine-0 failed"):
        fleet("first").start()
    assert second_redis and second_redis[0] != f"redis://127.0.0.1:{ports.redis}/0", second_redis
    assert (tmp_path / "second" / "redis" / "appendonlydir").is_dir(), "the second fleet's data is under its own"
    assert len(refusals) == 1 and f"state dir {tmp_path / 'first'}" in refusals[0], refusals
    assert f"Redis redis://127.0.0.1:{ports.redis}/0 with key prefix 'rlfleet:'" in refusals[0], refusals
    assert not (tmp_path / "third" / "logs").exists(), "the refused fleet started no service"
    # The first fleet's Redis again, from its AOF: the claim was deleted before it stopped.
    with pytest.raises(ServiceStartError, match="engine-0 failed"):
        fleet("first").start()
