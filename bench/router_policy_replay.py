"""Replays the router benchmark's traffic through a routing policy as a discrete-event simulation.

`router_vs_sglang_router.py` measures real routers in front of real `sim` engine processes; on a shared
2-core machine its makespans move by 10-30 % with the machine's load, too much to tune a policy setting by.
This replays the same traffic (the same workload generators and seed, 32 clients) without processes and
without timing noise, in seconds. N engines follow the `sim` backend's model, started with the benchmark's
flags (`SIM_LATENCY`): the backend's own `PrefixCache` as KV memory, where a running request holds a `Lease`
(its prompt's blocks pinned, room for its partial tail and all of `max_new_tokens`) and a finished one
leaves prompt + output cached; admission first come, first served while a batch slot is free, the next
waiting request's lease fits and the iteration's uncached prompt tokens stay within max_prefill_tokens,
stopping at the first that does not, each request a prefill group of its own (what one iteration computes is
cached for the others from the next one on); and the backend's own `LatencyModel` per iteration (decode step
+ per-sequence cost x batch + per-KV-token cost x the running sequences' tokens + prefill cost x uncached
prompt tokens admitted). Each request is routed by the policy object itself, under cache_aware held back by
the router's `PrefillStagger` at its default, seeing the requests in flight per engine as the router would
(the answers of one engine step, a GRPO group's, all leave that count before any of their clients' next
requests is routed); as in the benchmark, one policy object serves the workloads one after another and
engine caches start empty for each workload, emptied through the policy (`forget_caches` with every engine,
what a router does on a `/flush_cache`). Router and network time count as zero unless `--jitter-ms` adds
some.

Beside rlfleet's policies it replays a model of sglang-router's cache_aware at its defaults (the
engine holding the longest prefix when it holds more than 30 % of the prompt, else the engine with the
smallest tree, in characters held; the least-loaded engine once max - min in flight > 64 and max >
1.5 x min). On the benchmark's seed at `--scale 0.5` it lands within a point of the measured hit rates
and, when sglang-router spreads the conversations as it does here, within 1-5 % of its makespans; the
real router breaks ties between engines holding a prefix arbitrarily, so its spread varies run to run.
It can also replay `total-aware`, a reference no router can be: cache_aware's tree told in advance how many
requests the workload has and how many samples each prompt gets, keeping every prompt family on the
engines that hold it until an engine's total would pass 1.3 x the mean (the balance target) or its
requests in flight would pass the fleet's mean by more than one group. It shows what knowing the run's
length, which an online router lacks, would buy against the ceiling.
Under each workload's rows it prints the benchmark's `hit_ceiling`: the highest hit rate any router can
reach there with max/mean load within the benchmark's target, and at any load. Its "busy" column is the
share of the makespan the engines spent running requests (the rest they had none). Every figure is a replay
of the sim engines' model and says so; confirm a change with the real benchmark.

    .venv/bin/python bench/router_policy_replay.py [--engines 4 8] [--caches roomy tight] [--seeds 0 1 2]
        [--scale 0.5] [--policies cache_aware sglang-model total-aware least_load] [--jitter-ms 5]
        [--option cache_tokens_per_request=32 ...]
"""

from __future__ import annotations

import argparse
import functools
import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router_vs_sglang_router import (
    BALANCE_TARGET,
    BASELINE,
    CACHES,
    SIM_LATENCY,
    Workload,
    grpo_workload,
    hit_ceiling,
    multiturn_workload,
    run_label,
)

from rlfleet_engine.config import EngineConfig, config_from_args
from rlfleet_engine.sim_backend import LatencyModel, output_rng
from rlfleet_engine.sim_prefix_cache import Lease, PrefixCache
from rlfleet_router.chars_per_token import CharsPerToken
from rlfleet_router.config import RouterConfig
from rlfleet_router.policies import CacheAware, Choice, Policy, PolicyOptions, RoutingRequest, create_policy
from rlfleet_router.prefill_stagger import PrefillStagger
from rlfleet_router.radix_tree import RadixTree
from rlfleet_router.workers import Worker, WorkerState

REPLAY = "replay of the sim engines' model"
CONCURRENCY = 32
# The benchmark's router of each replayed policy, named in its run label (the salt); rlfleet's otherwise.
BENCH_ROUTERS = {"sglang-model": BASELINE, "round_robin": "sglang:round_robin"}
_OUTPUT_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def bench_engine_config(cache_tokens: int) -> EngineConfig:
    """The config the benchmark starts each sim engine with (`SimFleet`): a change of its flags reaches the replay."""
    return config_from_args(
        ["--backend", "sim", "--model-path", "sim", "--sim-cache-tokens", str(cache_tokens), *SIM_LATENCY]
    )


def latency_model(config: EngineConfig) -> LatencyModel:
    """The iteration cost a sim engine with `config` pays, in seconds (as `SimEngineCore` builds it)."""
    return LatencyModel(
        prefill_secs_per_token=config.sim_prefill_us_per_token / 1e6,
        decode_secs_per_step=config.sim_decode_ms_per_step / 1e3,
        decode_secs_per_sequence=config.sim_decode_us_per_sequence / 1e6,
        decode_secs_per_kv_token=config.sim_decode_us_per_kv_token / 1e6,
    )


class SglangCacheAwareModel:
    """sglang-router's cache_aware policy at its defaults, as its documentation and its tree's code describe it."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.tree = RadixTree(2**26)
        self.tree_sizes: dict[str, int] = {}

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        key = request.prompt_key
        assert key is not None, "the replayed traffic always has a prompt"
        loads = [w.in_flight for w in workers]
        matched = self.tree.match(key).matched
        if max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads):
            chosen = min(workers, key=lambda w: w.in_flight)
        else:
            longest = max((matched.get(w.id, 0) for w in workers), default=0)
            if longest > 0.3 * len(key):
                chosen = min((w for w in workers if matched.get(w.id, 0) == longest), key=lambda w: w.in_flight)
            else:
                chosen = min(workers, key=lambda w: self.tree_sizes.get(w.id, 0))
        self.tree.insert(key, chosen.id)
        # sglang-router's tree counts each engine's characters once, however many prompts share them.
        self.tree_sizes[chosen.id] = self.tree_sizes.get(chosen.id, 0) + len(key) - matched.get(chosen.id, 0)
        return Choice(chosen, "sglang_model")

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        pass  # sglang-router's /flush_cache reaches the engines and leaves its tree as it was

    def forget(self, worker: Worker) -> None:
        self.tree.remove_tenants([worker.id])


class TotalAwareModel(CacheAware):
    """cache_aware's tree and a placement told the run's size: see the module's docstring ("total-aware")."""

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.cap, self.samples = 0, 1
        self.served: dict[str, int] = {}

    def expect(self, workload: Workload, engines: int) -> None:
        """The next workload, served after `forget_caches`: its per-engine total and its group size."""
        self.cap = int(BALANCE_TARGET * workload.requests / engines)
        self.samples = workload.samples

    def forget_caches(self, workers: Sequence[Worker]) -> None:
        super().forget_caches(workers)
        self.served.clear()

    def _choose(self, workers: Sequence[Worker], request: RoutingRequest) -> Choice:
        key = request.prompt_key
        assert key is not None, "the replayed traffic always has a prompt"
        match = self.tree.match(key)
        floor = self.options.cache_threshold * len(key)
        group = self.samples
        mean = sum(w.in_flight for w in workers) / len(workers)
        open_ = [w for w in workers if self.served.get(w.id, 0) < self.cap] or list(workers)
        followed = [w for w in open_ if match.extended.get(w.id, 0) >= floor]
        holders = [
            w
            for w in open_
            if match.matched.get(w.id, 0) >= floor
            and self.served.get(w.id, 0) + group <= self.cap
            and w.in_flight <= mean + group
        ]
        if followed:
            chosen = min(followed, key=lambda w: (-match.extended[w.id], w.in_flight))
        else:
            chosen = min(holders or open_, key=lambda w: (w.in_flight, self.served.get(w.id, 0)))
        self.served[chosen.id] = self.served.get(chosen.id, 0) + 1
        return Choice(chosen, "total_aware")


@dataclass(eq=False)
class Job:
    client: int
    prompt: list[int]
    worker: Worker
    tokens: int
    sent_at: float
    rng: random.Random
    """Draws the output; seeded by the prompt, as on a sim engine, so equal prompts get equal outputs."""
    output: list[str] = field(default_factory=list)
    lease: Lease | None = None
    """The engine's KV memory the job holds while it runs."""
    ended: bool = False
    """Answered: a repeat of its prompt no longer waits for it (`PrefillStagger`)."""


@dataclass(eq=False)
class Engine:
    worker: Worker
    cache: PrefixCache
    waiting: list[Job] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    busy: bool = False
    served: int = 0
    busy_secs: float = 0.0
    """Time spent in iterations (prefill or decode); the rest of the run the engine had nothing to run."""


@dataclass(frozen=True)
class Replay:
    hit_rate: float
    makespan: float
    p50: float
    p99: float
    per_engine: list[int]
    busy: float
    """Mean share of the makespan the engines spent running requests."""

    @property
    def max_over_mean(self) -> float:
        return max(self.per_engine) / statistics.mean(self.per_engine)


def replay(
    policy: Policy,
    engines: int,
    engine_config: EngineConfig,
    workload: Workload,
    seed: int,
    salt: str = "",
    jitter_secs: float = 0.0,
    chars_per_token: CharsPerToken | None = None,
) -> Replay:
    """Runs `workload` from 32 clients through `policy` onto `engines` modelled sim engines of `engine_config`.

    `salt` starts every prompt, as the benchmark's run label does (a prefix shared by all traffic, like a
    chat template's header).

    `jitter_secs`: each request reaches its engine, and each answer its client, after a delay drawn
    uniformly from [0, jitter_secs] (the router's and the network's share on a busy machine); the
    router counts a request in flight from its routing to its answer's delivery.

    `chars_per_token`: the router's estimate, learned from the answers; one router serving workloads in
    turn carries it from one to the next (None: a new router's).
    """
    delays = random.Random(seed + 1)
    latency = latency_model(engine_config)
    # As the router does: under cache_aware, a repeat of a prompt sent to an engine moments ago waits to share
    # its prefill (the benchmark runs the router at its default stagger).
    clock = [0.0]
    stagger_secs = RouterConfig.model_fields["prefill_stagger_ms"].default / 1000
    stagger = PrefillStagger(stagger_secs if isinstance(policy, CacheAware) else 0.0, clock=lambda: clock[0])
    fleet = [
        Engine(
            Worker(url=f"sim-{k}", id=f"sim-{k}", state=WorkerState.HEALTHY),
            PrefixCache(engine_config.sim_cache_tokens),
        )
        for k in range(engines)
    ]
    by_id = {e.worker.id: e for e in fleet}
    policy.forget_caches([e.worker for e in fleet])
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = iter(range(1 << 62))
    items: list[str | tuple[str, list[str]]] = [p for p in workload.grpo_prompts for _ in range(workload.samples)]
    items += workload.conversations
    pending = iter(items)
    histories: dict[int, tuple[str, list[str]]] = {}  # client -> (conversation so far, user turns left)
    latencies: list[float] = []
    prompt_tokens = cached_tokens = 0
    chars_per_token = chars_per_token or CharsPerToken()  # learned from the answers, as the router does

    def at(when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(events, (when, next(order), action))

    def send(client: int, text: str, now: float) -> None:
        body = {"text": text, "sampling_params": {"max_new_tokens": workload.max_new_tokens}}
        request = RoutingRequest("/generate", body, chars_per_token.value)
        worker = policy.select([e.worker for e in fleet], request).worker
        worker.in_flight += 1
        worker.in_flight_tokens += request.tokens
        prompt = [ord(c) for c in text]
        job = Job(client, prompt, worker, request.tokens, now, output_rng(engine_config.random_seed, prompt, 0))
        clock[0] = now
        wait = stagger.delay(worker.id, request.prompt_key, job)
        at(now + wait + delays.uniform(0.0, jitter_secs), lambda when: arrive(job, when))

    def arrive(job: Job, now: float) -> None:
        engine = by_id[job.worker.id]
        if len(job.prompt) + workload.max_new_tokens > engine.cache.max_tokens:
            # The sim engine refuses it (400) and the benchmark stops; a replay of that would mean nothing.
            raise ValueError(
                f"a {len(job.prompt)}-token prompt + max_new_tokens {workload.max_new_tokens} exceeds the engines' "
                f"KV memory of {engine.cache.max_tokens} tokens; use a larger cache"
            )
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
            system, users = item
            histories[client] = (salt + system, list(users))
            next_request(client, now)

    def step(engine: Engine, now: float) -> None:
        """One iteration of the engine's loop: `SimScheduler._admit`, then the iteration's cost. Each request is a
        prefill group of its own, as on the engine: what one iteration computes is cached for the others from the
        next one on, and the iteration's uncached prompt tokens stay within max_prefill_tokens."""
        nonlocal prompt_tokens, cached_tokens
        engine.cache.begin_iteration()
        prefill = admitted = 0
        for job in engine.waiting[: engine_config.max_running_requests - len(engine.running)]:
            uncached = len(job.prompt) - engine.cache.cached_for(job.prompt, id(job))
            if admitted and prefill + uncached > engine_config.max_prefill_tokens:
                break
            job.lease = engine.cache.lease(job.prompt, workload.max_new_tokens, id(job))
            if job.lease is None:  # first come, first served: the rest wait behind it
                break
            admitted += 1
            cached = job.lease.cached_tokens
            prefill += len(job.prompt) - cached
            prompt_tokens += len(job.prompt)
            cached_tokens += cached
        engine.running += engine.waiting[:admitted]
        del engine.waiting[:admitted]
        assert engine.running or not engine.waiting, "an idle engine admits any request small enough for its KV"
        engine.busy = bool(engine.running)
        if engine.busy:
            context = sum(len(job.prompt) + len(job.output) for job in engine.running)
            secs = latency.iteration_secs(len(engine.running), prefill, context)
            engine.busy_secs += secs
            at(now + secs, lambda when: finish_step(engine, when))

    def finish_step(engine: Engine, now: float) -> None:
        for job in engine.running:
            job.output.append(job.rng.choice(_OUTPUT_ALPHABET))
        done = [job for job in engine.running if len(job.output) >= workload.max_new_tokens]
        engine.running = [job for job in engine.running if len(job.output) < workload.max_new_tokens]
        for job in done:
            assert job.lease is not None, "a running job holds a lease"
            engine.cache.release(job.lease, job.prompt + [ord(c) for c in job.output])
            job.lease = None
            engine.served += 1
            at(now + delays.uniform(0.0, jitter_secs), functools.partial(answer, job))
        step(engine, now)

    def answer(job: Job, now: float) -> None:
        job.ended = True
        job.worker.in_flight -= 1
        job.worker.in_flight_tokens -= job.tokens
        chars_per_token.observe(len(job.prompt), len(job.prompt))  # the sim's tokenizer: a token per character
        latencies.append(now - job.sent_at)
        if job.client in histories:
            history, users = histories[job.client]
            histories[job.client] = (history + "".join(job.output), users)
        # The client's next request is an event of its own: the answers an engine step finishes together (a
        # GRPO group's) all reach the router before any of their clients' next requests, as over a network,
        # so the first of those requests sees the group's requests gone from the fleet's in-flight count.
        at(now, lambda when: next_request(job.client, when))

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
        busy=statistics.mean(e.busy_secs for e in fleet) / now,
    )


def make_policy(name: str, options: PolicyOptions) -> Policy:
    models: dict[str, Callable[[PolicyOptions], Policy]] = {
        "sglang-model": SglangCacheAwareModel,
        "total-aware": TotalAwareModel,
    }
    return models[name](options) if name in models else create_policy(name, options)


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
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the default traffic, as the benchmark's")
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "sglang-model", "least_load", "round_robin"])
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="delay of each request and answer, 0 to this")
    parser.add_argument("--option", type=parse_option, action="append", default=[], help="PolicyOptions NAME=VALUE")
    args = parser.parse_args()
    options = PolicyOptions(**dict(args.option))
    jitter = args.jitter_ms / 1e3
    configs = {cache: bench_engine_config(CACHES[cache]) for cache in args.caches}
    makers = {"grpo": grpo_workload, "multiturn": multiturn_workload}
    print(f"# routing replay ({REPLAY}); 32 clients; options {options}")
    print(
        f"{'workload':26} {'policy':13} {'hit':>6} {'makespan':>9} {'p50':>6} {'p99':>6} {'max/mean':>8} {'busy':>5}"
        "  per engine"
    )
    for cache in args.caches:
        for engines in args.engines:
            # As in the benchmark, one router (policy object) per fleet serves the workloads one after another.
            results: dict[tuple[str, str], list[Replay]] = {}
            for policy in args.policies:
                # The benchmark's run label for this router (a prefix all its traffic shares).
                salt = run_label(BENCH_ROUTERS.get(policy, f"rlfleet:{policy}"), cache, engines)
                for seed in args.seeds:
                    router, chars_per_token = make_policy(policy, options), CharsPerToken()
                    for name in args.workloads:
                        workload = makers[name](seed, args.scale)
                        if isinstance(router, TotalAwareModel):
                            router.expect(workload, engines)
                        run = replay(router, engines, configs[cache], workload, seed, salt, jitter, chars_per_token)
                        results.setdefault((name, policy), []).append(run)
            for name in args.workloads:
                for policy in args.policies:
                    runs = results[name, policy]
                    print(
                        f"{name:9} {engines} engines {cache:6} {policy:13} "
                        f"{statistics.mean(r.hit_rate for r in runs):6.3f} "
                        f"{statistics.mean(r.makespan for r in runs):8.2f}s "
                        f"{statistics.mean(r.p50 for r in runs) * 1e3:4.0f}ms "
                        f"{statistics.mean(r.p99 for r in runs) * 1e3:4.0f}ms "
                        f"{statistics.mean(r.max_over_mean for r in runs):8.2f} "
                        f"{statistics.mean(r.busy for r in runs):5.0%}  {runs[0].per_engine}",
                        flush=True,
                    )
                salt = run_label("rlfleet:cache_aware", cache, engines)
                ceilings = {
                    bound: statistics.mean(
                        hit_ceiling(makers[name](seed, args.scale), engines, salt, bound) for seed in args.seeds
                    )
                    for bound in (BALANCE_TARGET, engines)
                }
                print(
                    f"{name:9} {engines} engines {cache:6} {'ceiling':13} {ceilings[BALANCE_TARGET]:6.3f}  highest hit "
                    f"rate of any router at max/mean <= {BALANCE_TARGET} ({ceilings[engines]:.3f} at any load)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
