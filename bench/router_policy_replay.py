"""Replays the router benchmark's traffic through a routing policy as a discrete-event simulation.

`router_vs_sglang_router.py` measures real routers in front of real `sim` engine processes; on a shared
2-core machine its makespans move by 10-30 % with the machine's load, too much to tune a policy
setting by. This replays the same traffic (the same workload generators and seed, 32 clients) without
processes and without timing noise, in seconds: N engines follow the `sim` backend's model (continuous
batching of up to 16 running requests; an iteration takes the decode step + the per-sequence cost x
the batch + the prefill cost x the uncached prompt tokens admitted; the backend's own `PrefixCache`,
filled on admission and with each finished sequence), and each request is routed by the policy object
itself, seeing the requests in flight per engine as the router would; as in the benchmark, one policy
object serves the workloads one after another. Router and network time count as zero unless
`--jitter-ms` adds some.

Beside rlfleet's policies it replays a model of sglang-router's cache_aware at its defaults (the
engine holding the longest prefix when it holds more than 30 % of the prompt, else the engine with the
smallest tree; the least-loaded engine once max - min in flight > 64 and max > 1.5 x min), which
reproduces the real benchmark's sglang-router figures within a few percent. Every figure is a replay
of the sim engines' model and says so; confirm a change with the real benchmark.

    .venv/bin/python bench/router_policy_replay.py [--engines 4 8] [--caches roomy tight] [--seeds 0 1 2]
        [--policies cache_aware sglang-model least_load] [--jitter-ms 5] [--option cache_tokens_per_request=32 ...]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router_vs_sglang_router import CACHES, Workload, grpo_workload, multiturn_workload

from rlfleet_engine.sim_prefix_cache import PrefixCache
from rlfleet_router.policies import Choice, Policy, PolicyOptions, RoutingRequest, create_policy
from rlfleet_router.radix_tree import RadixTree
from rlfleet_router.workers import Worker, WorkerState

REPLAY = "replay of the sim engines' model"
# The benchmark's sim latency model (SIM_LATENCY in router_vs_sglang_router.py) and the engines' batch.
DECODE_SECS_PER_STEP = 0.020
DECODE_SECS_PER_SEQUENCE = 0.0005
PREFILL_SECS_PER_TOKEN = 0.0001
MAX_RUNNING_REQUESTS = 16
CONCURRENCY = 32
_OUTPUT_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


class SglangCacheAwareModel:
    """sglang-router's cache_aware policy at its defaults, as its documentation describes it."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.tree = RadixTree(2**26)
        self.tree_sizes: dict[str, int] = {}

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        key = request.prompt_key
        assert key is not None, "the replayed traffic always has a prompt"
        loads = [w.in_flight for w in workers]
        if max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads):
            chosen = min(workers, key=lambda w: w.in_flight)
        else:
            matched = self.tree.match(key).matched
            longest = max((matched.get(w.id, 0) for w in workers), default=0)
            if longest > 0.3 * len(key):
                chosen = min((w for w in workers if matched.get(w.id, 0) == longest), key=lambda w: w.in_flight)
            else:
                chosen = min(workers, key=lambda w: self.tree_sizes.get(w.id, 0))
        self.tree.insert(key, chosen.id)
        self.tree_sizes[chosen.id] = self.tree_sizes.get(chosen.id, 0) + len(key)
        return Choice(chosen, "sglang_model")

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker.id)


@dataclass(eq=False)
class Job:
    client: int
    prompt: list[int]
    worker: Worker
    tokens: int
    sent_at: float
    output: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Engine:
    worker: Worker
    cache: PrefixCache
    waiting: list[Job] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    busy: bool = False
    served: int = 0


@dataclass(frozen=True)
class Replay:
    hit_rate: float
    makespan: float
    p50: float
    p99: float
    per_engine: list[int]

    @property
    def max_over_mean(self) -> float:
        return max(self.per_engine) / statistics.mean(self.per_engine)


def replay(
    policy: Policy,
    engines: int,
    cache_tokens: int,
    workload: Workload,
    seed: int,
    salt: str = "",
    jitter_secs: float = 0.0,
) -> Replay:
    """Runs `workload` from 32 clients through `policy` onto `engines` modelled sim engines.

    `salt` starts every prompt, as the benchmark's run label does (a prefix shared by all traffic, like a
    chat template's header).

    `jitter_secs`: each request reaches its engine, and each answer its client, after a delay drawn
    uniformly from [0, jitter_secs] (the router's and the network's share on a busy machine); the
    router counts a request in flight from its routing to its answer's delivery.
    """
    delays = random.Random(seed + 1)
    fleet = [
        Engine(Worker(url=f"sim-{k}", id=f"sim-{k}", state=WorkerState.HEALTHY), PrefixCache(cache_tokens))
        for k in range(engines)
    ]
    by_id = {e.worker.id: e for e in fleet}
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = iter(range(1 << 62))
    items: list[object] = [p for p in workload.grpo_prompts for _ in range(workload.samples)]
    items += workload.conversations
    pending = iter(items)
    histories: dict[int, tuple[str, list[str]]] = {}  # client -> (conversation so far, user turns left)
    output_rng = random.Random(seed)
    latencies: list[float] = []
    prompt_tokens = cached_tokens = 0

    def at(when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(events, (when, next(order), action))

    def send(client: int, text: str, now: float) -> None:
        body = {"text": text, "sampling_params": {"max_new_tokens": workload.max_new_tokens}}
        request = RoutingRequest("/generate", body)
        worker = policy.select([e.worker for e in fleet], request).worker
        worker.in_flight += 1
        worker.in_flight_tokens += request.tokens
        job = Job(client, [ord(c) for c in text], worker, request.tokens, now)
        at(now + delays.uniform(0.0, jitter_secs), lambda when: arrive(job, when))

    def arrive(job: Job, now: float) -> None:
        engine = by_id[job.worker.id]
        engine.waiting.append(job)
        if not engine.busy:
            step(engine, now)

    def next_request(client: int, now: float) -> None:
        if client in histories:
            history, users = histories[client]
            if users:
                history += f"\nUser: {users[0]}\nAssistant:"
                histories[client] = (history, users[1:])
                send(client, history, now)
                return
            del histories[client]
        item = next(pending, None)
        if isinstance(item, str):
            send(client, salt + item, now)
        elif item is not None:
            system, users = item  # type: ignore[misc]
            histories[client] = (salt + system, list(users))
            next_request(client, now)

    def step(engine: Engine, now: float) -> None:
        nonlocal prompt_tokens, cached_tokens
        room = MAX_RUNNING_REQUESTS - len(engine.running)
        admitted, engine.waiting = engine.waiting[:room], engine.waiting[room:]
        prefill = 0
        for job in admitted:
            cached = min(engine.cache.match(job.prompt), len(job.prompt) - 1)
            prefill += len(job.prompt) - cached
            engine.cache.insert(job.prompt)
            prompt_tokens += len(job.prompt)
            cached_tokens += cached
        engine.running += admitted
        engine.busy = bool(engine.running)
        if engine.busy:
            batch = len(engine.running)
            secs = DECODE_SECS_PER_STEP + DECODE_SECS_PER_SEQUENCE * batch + PREFILL_SECS_PER_TOKEN * prefill
            at(now + secs, lambda when: finish_step(engine, when))

    def finish_step(engine: Engine, now: float) -> None:
        for job in engine.running:
            job.output.append(output_rng.choice(_OUTPUT_ALPHABET))
        done = [job for job in engine.running if len(job.output) >= workload.max_new_tokens]
        engine.running = [job for job in engine.running if len(job.output) < workload.max_new_tokens]
        for job in done:
            engine.cache.insert(job.prompt + [ord(c) for c in job.output])
            engine.served += 1
            at(now + delays.uniform(0.0, jitter_secs), lambda when, job=job: answer(job, when))
        step(engine, now)

    def answer(job: Job, now: float) -> None:
        job.worker.in_flight -= 1
        job.worker.in_flight_tokens -= job.tokens
        latencies.append(now - job.sent_at)
        if job.client in histories:
            history, users = histories[job.client]
            histories[job.client] = (history + "".join(job.output), users)
        next_request(job.client, now)

    for client in range(CONCURRENCY):
        next_request(client, 0.0)
    now = 0.0
    while events:
        now, _, action = heapq.heappop(events)
        action(now)
    latencies.sort()
    return Replay(
        hit_rate=cached_tokens / prompt_tokens,
        makespan=now,
        p50=latencies[len(latencies) // 2],
        p99=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        per_engine=[e.served for e in fleet],
    )


def make_policy(name: str, options: PolicyOptions) -> Policy:
    return SglangCacheAwareModel() if name == "sglang-model" else create_policy(name, options)


def parse_option(text: str) -> tuple[str, float | int]:
    """NAME=VALUE for a numeric PolicyOptions field, the value of the field's type."""
    name, _, value = text.partition("=")
    default = getattr(PolicyOptions(), name, None)
    if not isinstance(default, (int, float)) or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME=VALUE with a numeric PolicyOptions field name")
    return name, type(default)(float(value))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--workloads", nargs="+", default=["grpo", "multiturn"], choices=["grpo", "multiturn"])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "sglang-model", "least_load", "round_robin"])
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="delay of each request and answer, 0 to this")
    parser.add_argument("--option", type=parse_option, action="append", default=[], help="PolicyOptions NAME=VALUE")
    args = parser.parse_args()
    options = PolicyOptions(**dict(args.option))
    jitter = args.jitter_ms / 1e3
    makers = {"grpo": grpo_workload, "multiturn": multiturn_workload}
    print(f"# routing replay ({REPLAY}); 32 clients; options {options}")
    print(f"{'workload':26} {'policy':13} {'hit':>6} {'makespan':>9} {'p50':>6} {'p99':>6} {'max/mean':>8}  per engine")
    for cache in args.caches:
        for engines in args.engines:
            # As in the benchmark, one router (policy object) per fleet serves the workloads one after another.
            results: dict[tuple[str, str], list[Replay]] = {}
            for policy in args.policies:
                salt = f"{policy} {cache} {engines}\n"  # the benchmark's run label
                for seed in args.seeds:
                    router = make_policy(policy, options)
                    for name in args.workloads:
                        workload = makers[name](seed, args.scale)
                        run = replay(router, engines, CACHES[cache], workload, seed, salt, jitter)
                        results.setdefault((name, policy), []).append(run)
            for (name, policy), runs in sorted(results.items(), key=lambda item: args.workloads.index(item[0][0])):
                print(
                    f"{name:9} {engines} engines {cache:6} {policy:13} "
                    f"{statistics.mean(r.hit_rate for r in runs):6.3f} "
                    f"{statistics.mean(r.makespan for r in runs):8.2f}s "
                    f"{statistics.mean(r.p50 for r in runs) * 1e3:4.0f}ms "
                    f"{statistics.mean(r.p99 for r in runs) * 1e3:4.0f}ms "
                    f"{statistics.mean(r.max_over_mean for r in runs):8.2f}  {runs[0].per_engine}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
