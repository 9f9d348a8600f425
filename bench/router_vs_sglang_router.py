"""Routing benchmark: the rlfleet router against sglang-router, in front of the same `sim` engines.

Starts 8 `sim` engines (simulated prefill/decode latency and a real prefix cache per engine, no
model) as real processes, then for each engine count and cache size puts one router at a time in
front of the first N of them: rlfleet's cache_aware, sglang-router's cache_aware and round_robin
(the `bench` extra: `.venv/bin/pip install -c constraints.txt sglang-router`). Each router sees the
same traffic, 32 requests in flight:

  * grpo: prompts of a few families (a long per-family prefix, e.g. a task template with few-shot
    examples, then a short question), family sizes skewed as real task mixes are, each prompt sent
    as `samples` requests in a row (a GRPO group);
  * multiturn: conversations under a handful of shared system prompts; each turn appends the
    engine's previous answer and a new user message, so the whole history is a cacheable prefix.

Both run with roomy engine caches and again with tight ones (smaller than the working set). Engine
caches are emptied before every run through the router under test (`/flush_cache`, which both fan out
to their engines), as an RL step's weight update empties them; what a router does with its own view of
the caches then is its own (rlfleet's forgets what its tree held, sglang-router's keeps it). Per router
it prints the prefix-cache hit rate (the engines' cached tokens over their prompt tokens, from their
/metrics), the makespan, p50/p99 request latency, max/mean engine load (requests each engine served),
and the ratios against sglang-router's cache_aware in the same run; under them the ceiling, the highest
hit rate any router can reach on that traffic while keeping max/mean load within the target
(`hit_ceiling`), so a hit target above it reads as unreachable; then the latency a router adds at
concurrency 1 against calling an engine directly.
Every figure is measured on `sim` engines and says so. Run:

    .venv/bin/python bench/router_vs_sglang_router.py [--engines 4 8] [--workloads grpo multiturn]
        [--caches roomy tight] [--scale 1.0] [--routers rlfleet:cache_aware sglang:cache_aware ...] [--repeats 3]
        [--seeds 0 1 2]

`--scale 0.5` halves the traffic for a quicker pass. The same code's figures move between runs (a run's
placements follow the order in which answers come back, which the machine's load decides); `--repeats N`
runs every router N times, each with a new router process, and reports each figure's median and the
spread of hit rates and makespans. The traffic itself is one draw of its generator: `--seeds 0 1 2 3 4`
runs every router on several (the order of prompt families, which system prompt a conversation has),
compares the routers within each seed and reports the median over seeds beside every seed's value.
Record the printed figures in bench/router_vs_sglang_router.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import math
import random
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from rlfleet.processes import ServiceProcess, free_port
from rlfleet_engine.sim_backend import SimTokenizer
from rlfleet_engine.sim_prefix_cache import PrefixCache

SIM = "measured on sim engines"
BASELINE = "sglang:cache_aware"
ROUTERS = ("rlfleet:cache_aware", BASELINE, "sglang:round_robin")
CACHES = {"roomy": 1_000_000, "tight": 6144}
BALANCE_TARGET = 1.3  # max/mean engine load the rlfleet router must stay within
QUESTION = "\nQuestion: "  # ends a grpo prompt's family prefix
# The sim's latency model, a 7B model on one GPU slowed ~4x (so two CPU cores keep up with 8 engines): 20 ms
# decode steps, +0.5 ms per sequence in the batch, prefill at 10k tokens/s, and +0.7 us per token of KV the batch
# holds, since a decode step reads every sequence's whole KV (7B fp16 is ~0.5 MB per token, an H100 reads ~3 TB/s:
# ~0.17 us per token, x4).
SIM_LATENCY = ["--sim-decode-ms-per-step", "20", "--sim-decode-us-per-sequence", "500"]
SIM_LATENCY += ["--sim-prefill-us-per-token", "100", "--sim-decode-us-per-kv-token", "0.7"]


def words(rng: random.Random, length: int) -> str:
    """`length` characters of lowercase pseudo-words (the sim tokenizer makes one token of each character)."""
    out: list[str] = []
    size = 0
    while size < length:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:length]


@dataclass(frozen=True)
class Workload:
    name: str
    grpo_prompts: list[str]
    """grpo: prompts in the order sent; each is sent `samples` times in a row."""
    conversations: list[tuple[str, list[str]]]
    """multiturn: (system prompt, user messages) per conversation."""
    samples: int
    max_new_tokens: int

    @property
    def requests(self) -> int:
        return len(self.grpo_prompts) * self.samples + sum(len(users) for _, users in self.conversations)

    def shared_prefixes(self) -> Counter[str]:
        """Requests per long shared prefix: a GRPO prompt's family, a conversation's system prompt."""
        shared: Counter[str] = Counter()
        for prompt in self.grpo_prompts:
            shared[prompt.partition(QUESTION)[0]] += self.samples
        for system, users in self.conversations:
            shared[system] += len(users)
        return shared


def grpo_workload(seed: int, scale: float) -> Workload:
    rng = random.Random(seed)
    families = [words(rng, 1500) for _ in range(6)]
    weights = [1 / (k + 1) for k in range(len(families))]  # a skewed task mix: family k has weight 1/(k+1)
    prompts = []
    for _ in range(max(8, int(64 * scale))):
        family = rng.choices(families, weights)[0]
        prompts.append(f"{family}{QUESTION}{words(rng, 80)}\nAnswer:")
    return Workload("grpo", prompts, [], samples=8, max_new_tokens=24)


def multiturn_workload(seed: int, scale: float) -> Workload:
    rng = random.Random(seed)
    systems = [words(rng, 700) for _ in range(3)]
    conversations = [
        (rng.choice(systems), [words(rng, rng.randint(40, 120)) for _ in range(4)])
        for _ in range(max(8, int(64 * scale)))
    ]
    return Workload("multiturn", [], conversations, samples=1, max_new_tokens=32)


def run_label(spec: str, cache: str, engines: int) -> str:
    """What every prompt of one router's run starts with (a header all traffic shares, like a chat template's),
    the same length for every router: the cache holds whole blocks, so a longer label would move where each
    prompt's blocks end and change its hit rate."""
    return f"{spec:24} {cache:5} {engines:2}\n"


def hit_ceiling(workload: Workload, engines: int, salt: str, max_over_mean: float) -> float:
    """The highest prefix-cache hit rate any router can reach on `workload` (each prompt starting with `salt`)
    over `engines` sim engines while none serves more than `max_over_mean` x the mean requests.

    Every prompt token a request does not find cached is prefilled somewhere. The fewest are prefilled when
    one engine with room for everything serves it all: each block of every prompt once, each request's
    partial last block every time (counted here through the sim's own cache and tokenizer). Spreading the
    traffic adds the shared prefixes: an engine serves at most `cap` = `max_over_mean` x requests / engines
    requests, so a prefix `n` requests share (a GRPO prompt family, a conversation's system prompt) reaches
    at least ceil(n / cap) engines, each of which prefills its whole blocks once. Smaller caches only lower it.
    """
    cache, tokenizer = PrefixCache(1 << 40), SimTokenizer()
    prompt_tokens = cached_tokens = 0

    def serve(text: str) -> str:
        nonlocal prompt_tokens, cached_tokens
        ids = tokenizer.encode(text)
        lease = cache.lease(ids, workload.max_new_tokens)
        assert lease is not None, "an unbounded cache grants every lease"
        prompt_tokens += len(ids)
        cached_tokens += lease.cached_tokens
        answer = words(random.Random(text), workload.max_new_tokens)  # its length is what counts, not its text
        cache.release(lease, ids + tokenizer.encode(answer))
        return answer

    for prompt in workload.grpo_prompts:
        for _ in range(workload.samples):
            serve(salt + prompt)
    for system, users in workload.conversations:
        history = salt + system
        for user in users:
            history += f"\nUser: {user}\nAssistant:"
            history += serve(history)
    cap = math.floor(max_over_mean * workload.requests / engines)
    spread = sum(
        (math.ceil(requests / cap) - 1) * (len(salt + prefix) // cache.block_size) * cache.block_size
        for prefix, requests in workload.shared_prefixes().items()
    )
    return (cached_tokens - spread) / prompt_tokens


@dataclass
class RunResult:
    makespan: float
    hit_rate: float
    p50: float
    p99: float
    max_over_mean: float
    per_engine: list[int]


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """Each figure's median over repeated runs; the requests per engine of the run with the median makespan."""
    middle = sorted(runs, key=lambda r: r.makespan)[len(runs) // 2]
    return RunResult(
        makespan=statistics.median(r.makespan for r in runs),
        hit_rate=statistics.median(r.hit_rate for r in runs),
        p50=statistics.median(r.p50 for r in runs),
        p99=statistics.median(r.p99 for r in runs),
        max_over_mean=statistics.median(r.max_over_mean for r in runs),
        per_engine=middle.per_engine,
    )


async def drive(url: str, workload: Workload, concurrency: int, salt: str) -> tuple[list[float], float]:
    """Sends `workload` to `url` with `concurrency` requests in flight; per-request latencies and makespan."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def generate(text: str) -> str:
            body = {"text": text, "sampling_params": {"max_new_tokens": workload.max_new_tokens, "temperature": 1.0}}
            started = time.perf_counter()
            response = await client.post("/generate", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            return str(response.json()["text"])

        queue: asyncio.Queue[str | tuple[str, list[str]]] = asyncio.Queue()
        for prompt in workload.grpo_prompts:
            for _ in range(workload.samples):
                queue.put_nowait(salt + prompt)
        for system, users in workload.conversations:
            queue.put_nowait((salt + system, users))

        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                if isinstance(item, str):
                    await generate(item)
                    continue
                system, users = item  # a conversation holds its slot for all of its turns
                history = system
                for user in users:
                    history += f"\nUser: {user}\nAssistant:"
                    history += await generate(history)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


class SimFleet:
    """`count` sim engine processes with the same cache size."""

    def __init__(self, count: int, cache_tokens: int, logs: Path) -> None:
        self.urls: list[str] = []
        self.processes: list[ServiceProcess] = []
        for _ in range(count):
            port = free_port()
            argv = [sys.executable, "-m", "rlfleet_engine", "--backend", "sim", "--model-path", "sim"]
            argv += ["--port", str(port), "--sim-cache-tokens", str(cache_tokens), "--log-level", "warning"]
            argv += SIM_LATENCY
            self.processes.append(ServiceProcess("sim-engine", argv, logs / f"sim-{port}.log"))
            self.urls.append(f"http://127.0.0.1:{port}")
        for process, url in zip(self.processes, self.urls, strict=True):
            process.wait_healthy(url + "/health", timeout=60)

    @staticmethod
    def counters(urls: Sequence[str]) -> list[dict[str, float]]:
        wanted = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:num_requests_total")
        out = []
        for url in urls:
            values = {name: 0.0 for name in wanted}
            for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in values:
                    values[name] += float(line.rsplit(" ", 1)[1])
            out.append(values)
        return out

    def stop(self) -> None:
        for process in self.processes:
            process.stop(timeout=10)


def start_router(spec: str, urls: Sequence[str], logs: Path, extra: Sequence[str] = ()) -> tuple[ServiceProcess, str]:
    """Starts router `spec` ("rlfleet:<policy>" or "sglang:<policy>") in front of `urls`; waits until all are in."""
    kind, policy = spec.split(":", 1)
    port = free_port()
    if kind == "rlfleet":
        argv = [sys.executable, "-m", "rlfleet_router", "--port", str(port), "--policy", policy]
        argv += ["--health-check-endpoint", "/health", "--log-level", "warning", *extra, "--worker-urls", *urls]
    elif kind == "sglang":
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--policy", policy, "--prometheus-port", str(free_port()), "--log-level", "warn"]
        argv += ["--worker-urls", *urls]
    else:
        raise SystemExit(f"unknown router {spec!r}: use rlfleet:<policy> or sglang:<policy>")
    process = ServiceProcess(f"router-{kind}", argv, logs / f"router-{kind}-{policy}-{port}.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            listed = httpx.get(url + "/workers", timeout=2).json()["workers"]
            if sum(1 for w in listed if w.get("healthy", w.get("is_healthy"))) == len(urls):
                return process, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if not process.alive():
            break
        time.sleep(0.2)
    process.stop()
    raise RuntimeError(f"{spec} did not admit {len(urls)} engines within 60 s:\n{process.log_tail()}")


def run_once(fleet: SimFleet, urls: Sequence[str], router_url: str, workload: Workload, salt: str) -> RunResult:
    httpx.post(router_url + "/flush_cache", timeout=30).raise_for_status()  # 2xx only if every engine flushed
    before = fleet.counters(urls)
    latencies, makespan = asyncio.run(drive(router_url, workload, 32, salt))
    after = fleet.counters(urls)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
    prompt = sum(d["sglang:prompt_tokens_total"] for d in delta)
    cached = sum(d["sglang:cached_tokens_total"] for d in delta)
    per_engine = [int(d["sglang:num_requests_total"]) for d in delta]
    mean = sum(per_engine) / len(per_engine)
    hit_rate = cached / prompt if prompt else 0.0
    p50, p99 = quantile(latencies, 0.5), quantile(latencies, 0.99)
    return RunResult(makespan, hit_rate, p50, p99, max(per_engine) / mean, per_engine)


def added_latency(router_url: str, engine_url: str, rounds: int) -> tuple[float, float]:
    """p50 of one short request through the router and straight to an engine, alternating, one at a time."""
    body = {"text": "Question: 2+2=\nAnswer:", "sampling_params": {"max_new_tokens": 1}}
    timings: dict[str, list[float]] = {router_url: [], engine_url: []}
    with httpx.Client(timeout=30) as client:
        for k in range(rounds + 5):
            for url in (router_url, engine_url):
                started = time.perf_counter()
                client.post(url + "/generate", json=body).raise_for_status()
                if k >= 5:  # the first rounds open connections
                    timings[url].append(time.perf_counter() - started)
    return statistics.median(timings[router_url]), statistics.median(timings[engine_url])


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be 0 or more")
    return value


def met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def report(
    title: str,
    runs: dict[int, dict[str, list[RunResult]]],
    workloads: dict[int, Workload],
    cache: str,
    engines: int,
) -> list[str]:
    """One workload's table: `runs` holds each seed's runs per router, `workloads` each seed's traffic.

    A router's figures are medians over all its runs; the ratios and target checks compare routers within
    a seed (each seed's medians), then take the median over seeds, listing every seed's value beside it."""
    seeds = list(runs)
    specs = list(runs[seeds[0]])
    per_seed = {seed: {spec: median_run(each) for spec, each in by_spec.items()} for seed, by_spec in runs.items()}
    overall = {spec: median_run([r for seed in seeds for r in runs[seed][spec]]) for spec in specs}
    repeats = max(len(each) for by_spec in runs.values() for each in by_spec.values())
    label = run_label("rlfleet:cache_aware", cache, engines)
    ceilings = {seed: hit_ceiling(workloads[seed], engines, label, BALANCE_TARGET) for seed in seeds}
    any_load = statistics.median(hit_ceiling(workloads[seed], engines, label, engines) for seed in seeds)
    have_base = BASELINE in specs

    def across(value: Callable[[int], float], fmt: str) -> tuple[float, str]:
        """The median over seeds of `value(seed)`, and every seed's value when there are several."""
        values = [value(seed) for seed in seeds]
        listed = f" (seeds {' '.join(format(v, fmt) for v in values)})" if len(seeds) > 1 else ""
        return statistics.median(values), listed

    def ratio(spec: str, field: str) -> float:
        return across(lambda s: getattr(per_seed[s][spec], field) / getattr(per_seed[s][BASELINE], field), ".2f")[0]

    how = [f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {' '.join(map(str, seeds))}"]
    if repeats > 1:
        how.append(f"{repeats} runs per seed")
    if len(seeds) > 1 or repeats > 1:
        how.append("medians")
    lines = [
        f"== {title} ({SIM}; {', '.join(how)}) ==",
        f"{'router':22} {'hit':>6} {'makespan':>9} {'p50':>7} {'p99':>7} "
        f"{'max/mean':>8} {'makespan/sg-ca':>14} {'p99/sg-ca':>9}  requests per engine",
    ]
    for spec, r in overall.items():
        ratio_m = f"{ratio(spec, 'makespan'):.2f}x" if have_base else "-"
        ratio_p = f"{ratio(spec, 'p99'):.2f}x" if have_base else "-"
        lines.append(
            f"{spec:22} {r.hit_rate:6.3f} {r.makespan:8.2f}s {r.p50 * 1e3:5.0f}ms {r.p99 * 1e3:5.0f}ms "
            f"{r.max_over_mean:8.2f} {ratio_m:>14} {ratio_p:>9}  {r.per_engine}"
        )
    lines.append(
        f"{'ceiling':22} {statistics.median(ceilings.values()):6.3f}  the highest hit rate any router can reach here "
        f"at max/mean <= {BALANCE_TARGET:.2f} ({any_load:.3f} at any load; see hit_ceiling)"
    )
    ours = "rlfleet:cache_aware"
    if ours in specs and have_base:
        need = {("grpo", "tight"): 0.0, ("multiturn", "tight"): 10.0}.get((workloads[seeds[0]].name, cache), -1.0)
        gap, gaps = across(lambda s: (per_seed[s][ours].hit_rate - per_seed[s][BASELINE].hit_rate) * 100, "+.1f")
        hit = met(gap >= need)
        # Reachable: sglang-router's hit rate plus the margin stays within the ceiling (median over seeds).
        room = statistics.median((ceilings[s] - per_seed[s][BASELINE].hit_rate) * 100 for s in seeds)
        if need > room:
            hit += f", unreachable at max/mean <= {BALANCE_TARGET:.2f}"
        makespan, makespans = across(lambda s: per_seed[s][ours].makespan / per_seed[s][BASELINE].makespan, ".2f")
        p99, p99s = across(lambda s: per_seed[s][ours].p99 / per_seed[s][BASELINE].p99, ".2f")
        balance, balances = across(lambda s: per_seed[s][ours].max_over_mean, ".2f")
        checks = [
            f"hit {gap:+.1f} pt vs sg-ca{gaps} (need >= {need:+.0f}) {hit}",
            f"makespan {makespan:.2f}x{makespans} (<= 0.85) {met(makespan <= 0.85)}",
            f"p99 {p99:.2f}x{p99s} (<= 0.80) {met(p99 <= 0.8)}",
            f"max/mean {balance:.2f}{balances} (<= {BALANCE_TARGET:.2f}) {met(balance <= BALANCE_TARGET)}",
        ]
        lines.append("targets: " + "; ".join(checks))
    if len(seeds) > 1 or repeats > 1:
        for spec in specs:
            for seed in seeds:
                each = runs[seed][spec]
                hits, times = sorted(r.hit_rate for r in each), sorted(r.makespan for r in each)
                loads = sorted(r.max_over_mean for r in each)
                lines.append(
                    f"  {spec} seed {seed}, {len(each)} run{'s' if len(each) > 1 else ''}: "
                    f"hit {' '.join(f'{h:.3f}' for h in hits)}, makespan {' '.join(f'{m:.2f}s' for m in times)}, "
                    f"max/mean {' '.join(f'{b:.2f}' for b in loads)}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[4, 8], help="engine counts to run (default 4 8)")
    parser.add_argument("--workloads", nargs="+", default=["grpo", "multiturn"], choices=["grpo", "multiturn"])
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES), help="engine cache sizes")
    parser.add_argument("--tight-cache-tokens", type=int, default=CACHES["tight"], help="per-engine tight cache")
    parser.add_argument("--routers", nargs="+", default=list(ROUTERS), help="rlfleet:<policy> or sglang:<policy>")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the default traffic (1.0)")
    parser.add_argument(
        "--latency-rounds",
        type=non_negative,
        default=200,
        help="requests per side of the added-latency probe (200; 0 skips it)",
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="traffic seeds; each is its own workload instance (default 0)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per router, each with a new router process; medians are reported"
    )
    parser.add_argument("--rlfleet-flags", default="", help="extra rlfleet router flags, e.g. '--cache-threshold 0.5'")
    args = parser.parse_args()
    # Checked before the engines start: otherwise a run fails only at its first sglang router, minutes in.
    if any(spec.startswith("sglang:") for spec in args.routers) and importlib.util.find_spec("sglang_router") is None:
        parser.error("sglang-router is not installed: .venv/bin/pip install -c constraints.txt sglang-router")
    caches = {**CACHES, "tight": args.tight_cache_tokens}
    makers = {"grpo": grpo_workload, "multiturn": multiturn_workload}
    workloads = {seed: {name: makers[name](seed, args.scale) for name in args.workloads} for seed in args.seeds}
    print(
        f"# rlfleet router vs sglang-router, {SIM}; 32 requests in flight; "
        + ", ".join(f"{w.name}: {w.requests} requests" for w in workloads[args.seeds[0]].values()),
        flush=True,
    )

    lines: list[str] = []
    added: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for cache in args.caches:
            fleet = SimFleet(max(args.engines), caches[cache], logs)
            try:
                for count in args.engines:
                    urls = fleet.urls[:count]
                    # workload -> seed -> router -> runs
                    results: dict[str, dict[int, dict[str, list[RunResult]]]] = {w: {} for w in args.workloads}
                    for seed, repeat, spec in itertools.product(args.seeds, range(args.repeats), args.routers):
                        extra = args.rlfleet_flags.split() if spec.startswith("rlfleet:") else []
                        router, router_url = start_router(spec, urls, logs, extra)
                        try:
                            for name, workload in workloads[seed].items():
                                salt = run_label(spec, cache, count)
                                r = run_once(fleet, urls, router_url, workload, salt)
                                results[name].setdefault(seed, {}).setdefault(spec, []).append(r)
                                print(
                                    f"  {name} {count} engines {cache} cache seed {seed} {spec} run "
                                    f"{repeat + 1}/{args.repeats}: hit {r.hit_rate:.3f} makespan {r.makespan:.2f}s "
                                    f"max/mean {r.max_over_mean:.2f} "
                                    f"({SIM})",
                                    flush=True,
                                )
                            if args.latency_rounds and spec not in added and cache == args.caches[0]:
                                added[spec] = added_latency(router_url, urls[0], args.latency_rounds)
                        finally:
                            router.stop()
                    for name in args.workloads:
                        title = f"{name}, {count} engines, {cache} caches ({caches[cache]} tokens/engine)"
                        instances = {seed: workloads[seed][name] for seed in args.seeds}
                        lines += report(title, results[name], instances, cache, count) + [""]
            finally:
                fleet.stop()
    print("\n".join(lines))
    if not added:
        return
    print(f"== added latency at concurrency 1, p50 through the router minus p50 straight to an engine ({SIM}) ==")
    for spec, (via, direct) in added.items():
        verdict = f"  target <= 1 ms {met(via - direct <= 1e-3)}" if spec.startswith("rlfleet") else ""
        print(
            f"{spec:22} {1e3 * (via - direct):+.2f} ms (router {1e3 * via:.2f} ms, engine {1e3 * direct:.2f} ms)"
            f"{verdict}"
        )


if __name__ == "__main__":
    main()
