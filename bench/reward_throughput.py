"""Reward hub throughput: math-verify items/s through a real hub vs sequentially in one process,
and `code` items/s through the hub's sandbox.

The hub runs as a real process (`python -m rlfleet_reward`, one worker per CPU unless --workers);
each batch is one HTTP request, `--in-flight` of them at a time (default 2: a client scoring several
groups at once, so the workers need not wait while the hub reads one request and answers another).
The baseline calls the same `math` function (math-verify) on the same items one after another in this
process. Both sides are warmed up first on other items, then measured in rounds: each round makes
fresh items (so neither side has seen them), scores them on both sides, and alternates which side
goes first, so that a change in the machine's load hits both alike. Each side's time is the wall
clock around its calls alone (the hub side includes this process encoding the requests and decoding
the responses). The ratio reported is the median of the rounds' ratios; the load average is printed
(on a shared machine other processes take cores from both sides, and more from the side that needs
two). CPU time per item is printed too, for each side and, on the hub side, for the workers, the hub
process itself and this client: it shows where the hub's cycles go, and it changes less with the
machine's load than wall time. The code items each run two stdin/stdout tests, every test in its own
sandbox (see services/reward/rlfleet_reward/sandbox.py). Run:

    .venv/bin/python bench/reward_throughput.py [--math-items 1600] [--rounds 8] [--code-items 60]
        [--in-flight 2] [--workers N]

Record the printed figures in bench/reward_throughput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from rlfleet.processes import ServiceProcess, free_port
from rlfleet_reward.math_answer import MathParams, score_math
from rlfleet_reward.reward_function import RewardInput

_SHAPES = (
    # (response, label) templates over i: symbolic equivalence, fractions, roots, polynomials, misses.
    ("The answer is $\\boxed{{\\frac{{{a}}}{{{b}}}}}$.", "${q}$"),
    ("So $x = \\boxed{{\\sqrt{{{sq}}}}}$", "${r}$"),
    ("Expanding, $\\boxed{{(x+{a})^2}}$", "$x^2+{two_a}x+{a_sq}$"),
    ("We get $\\boxed{{{a}\\pi}}$", "${a}\\pi$"),
    ("Thus $\\boxed{{{a}+{b}}}$", "${wrong}$"),
)


def math_items(count: int, offset: int) -> list[dict[str, str]]:
    items = []
    for k in range(count):
        i = offset + k + 2
        a, b = i, 2 * i
        values = {"a": a, "b": b, "q": f"{a / b:g}", "sq": i * i, "r": i, "two_a": 2 * a, "a_sq": a * a,
                  "wrong": a + b + 1}  # fmt: skip
        response, label = _SHAPES[k % len(_SHAPES)]
        items.append({"id": str(k), "response": response.format(**values), "label": label.format(**values)})
    return items


def code_items(count: int) -> list[dict[str, str]]:
    program = "```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a * b + {k})\n```"
    items = []
    for k in range(count):
        tests = [{"stdin": f"{x} {x + 1}", "stdout": str(x * (x + 1) + k)} for x in (3, 7)]
        items.append({"id": str(k), "response": program.format(k=k), "label": json.dumps({"tests": tests})})
    return items


def sequential_math(items: list[dict[str, str]]) -> float:
    """Seconds to score `items` one after another in this process."""
    params = MathParams().model_dump()
    started = time.monotonic()
    for item in items:
        score_math(RewardInput(response=item["response"], label=item["label"]), params)
    return time.monotonic() - started


def hub_seconds(
    http: httpx.Client,
    url: str,
    terms: list[dict],
    items: list[dict],
    batch: int,
    statuses: dict[str, int],
    in_flight: int = 1,
) -> float:
    """Seconds the hub takes to score `items` in requests of `batch`, `in_flight` requests at a time;
    counts result statuses."""

    def post(start: int) -> list[dict]:
        body = {"spec": {"terms": terms, "timeout_seconds": 60}, "items": items[start : start + batch]}
        response = http.post(f"{url}/score", json=body)
        response.raise_for_status()
        return response.json()["results"]

    started = time.monotonic()
    with ThreadPoolExecutor(in_flight) as requests:
        for results in requests.map(post, range(0, len(items), batch)):
            for result in results:
                statuses[result["status"]] = statuses.get(result["status"], 0) + 1
    return time.monotonic() - started


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def math_rounds(
    http: httpx.Client, url: str, hub_pid: int, rounds: int, per_round: int, batch: int, in_flight: int
) -> list[tuple[float, float]]:
    """(sequential seconds, hub seconds) per round; both sides score the same fresh items each round."""
    math = [{"function": "math"}]
    statuses: dict[str, int] = {}
    timings = []
    workers = descendants(hub_pid)
    cpu = dict.fromkeys(("sequential", "workers", "hub", "client"), 0.0)
    for r in range(rounds):
        items = math_items(per_round, offset=r * 10_000)
        for side in ("hub", "sequential") if r % 2 else ("sequential", "hub"):
            client = time.process_time()
            if side == "sequential":
                sequential = sequential_math(items)
                cpu["sequential"] += time.process_time() - client
                continue
            hub, pool = process_cpu_seconds(hub_pid), sum(process_cpu_seconds(pid) for pid in workers)
            through_hub = hub_seconds(http, url, math, items, batch, statuses, in_flight)
            cpu["client"] += time.process_time() - client
            cpu["hub"] += process_cpu_seconds(hub_pid) - hub
            cpu["workers"] += sum(process_cpu_seconds(pid) for pid in workers) - pool
        timings.append((sequential, through_hub))
        print(
            f"round {r}: sequential {per_round / sequential:.1f} items/s, hub {per_round / through_hub:.1f} items/s, "
            f"ratio {sequential / through_hub:.2f}x, load average {os.getloadavg()[0]:.2f}"
        )
    per_item = {side: 1000 * seconds / (rounds * per_round) for side, seconds in cpu.items()}
    print(
        f"CPU ms per item: sequential {per_item['sequential']:.2f}; through the hub {per_item['workers']:.2f} in "
        f"the workers + {per_item['hub']:.3f} in the hub process + {per_item['client']:.3f} in this client; "
        f"hub result statuses: {statuses}"
    )
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--math-items", type=int, default=1600, help="per side, over --rounds rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--code-items", type=int, default=60)
    parser.add_argument("--batch", type=int, default=100, help="items per /score request")
    parser.add_argument(
        "--in-flight", type=int, default=2, help="/score requests at a time (a client scoring several groups)"
    )
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    for flag in ("rounds", "batch", "in_flight", "workers"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.math_items < args.rounds:
        parser.error(f"--math-items ({args.math_items}) must be at least --rounds ({args.rounds}): one item per round")
    if args.code_items < 0:
        parser.error(f"--code-items must be 0 or more, got {args.code_items}")

    per_round = args.math_items // args.rounds
    print(f"load average before: {os.getloadavg()}")
    port = free_port()
    argv = [sys.executable, "-m", "rlfleet_reward", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(free_port()), "--workers", str(args.workers)]  # fmt: skip
    with tempfile.TemporaryDirectory() as logs, httpx.Client(timeout=600) as http:
        hub = ServiceProcess("reward-hub", argv, Path(logs) / "hub.log", env={"RLFLEET_LOG_FORMAT": "text"})
        try:
            url = f"http://127.0.0.1:{port}"
            hub.wait_healthy(f"{url}/health", timeout=60)
            sequential_math(math_items(100, offset=900_000))
            hub_seconds(
                http, url, [{"function": "math"}], math_items(100 * args.workers, offset=800_000), args.batch, {}
            )
            timings = math_rounds(http, url, hub.pid, args.rounds, per_round, args.batch, args.in_flight)
            total = per_round * args.rounds
            sequential = sum(t[0] for t in timings)
            through_hub = sum(t[1] for t in timings)
            ratios = [seq / via_hub for seq, via_hub in timings]
            print(f"math-verify sequential, one process: {total / sequential:.1f} items/s")
            print(
                f"math-verify through the hub ({args.workers} workers, {args.in_flight} requests in flight): "
                f"{total / through_hub:.1f} items/s"
            )
            print(
                f"ratio: {statistics.median(ratios):.2f}x (median of {args.rounds} rounds; min {min(ratios):.2f}x, "
                f"max {max(ratios):.2f}x; all items together {sequential / through_hub:.2f}x)"
            )
            statuses: dict[str, int] = {}
            code_seconds = hub_seconds(
                http, url, [{"function": "code"}], code_items(args.code_items), args.batch, statuses
            )
            print(
                f"code through the hub's sandbox (2 tests per item): {args.code_items / code_seconds:.1f} items/s "
                f"{statuses}"
            )
            print(f"load average after: {os.getloadavg()}")
        finally:
            hub.stop(timeout=15)


if __name__ == "__main__":
    main()
