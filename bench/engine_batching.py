"""Batching benchmark of rlfleet-engine: output tokens/s with 1 client and with 16 concurrent clients.

Starts one engine (the tiny model, `transformers` backend) as a real process, warms it up, then for
each client count runs closed-loop clients (each sends its next request when the previous answer
arrives) for a fixed time. Every request asks for the same number of tokens with ignore_eos, so the
figure is pure decode throughput. Run:

    .venv/bin/python bench/engine_batching.py [--seconds 15] [--max-new-tokens 64] [--threads 1]

Record the printed figures in bench/engine_batching.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from rlfleet.processes import ServiceProcess, free_port
from rlfleet.tiny_model import create_tiny_model


def run_clients(url: str, clients: int, seconds: float, max_new_tokens: int) -> float:
    """Output tokens per second of `clients` closed-loop clients over `seconds`; raises if any client failed
    or had not finished (its tokens would be missing from the figure)."""
    deadline = time.monotonic() + seconds
    totals = [0] * clients
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            with httpx.Client(timeout=120.0) as http:
                k = 0
                while k == 0 or time.monotonic() < deadline:  # at least one request, however late the thread starts
                    body = {
                        "input_ids": [10 + (index + k) % 50, 11, 12, 13],
                        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0},
                    }
                    response = http.post(url + "/generate", json=body)
                    response.raise_for_status()
                    totals[index] += response.json()["meta_info"]["completion_tokens"]
                    k += 1
        except Exception as exc:  # noqa: BLE001 - reported by the caller's thread
            errors.append(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 300)
    if errors:
        raise RuntimeError(f"{len(errors)} of {clients} clients failed, the first with: {errors[0]!r}") from errors[0]
    if any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"a client had not finished {seconds + 300:g} s after its {seconds:g} s")
    return sum(totals) / (time.monotonic() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring time per client count")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    for flag in ("seconds", "max_new_tokens", "threads", "concurrency"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        create_tiny_model(model_dir)
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "rlfleet_engine",
            "--model-path",
            str(model_dir),
            "--port",
            str(port),
            "--max-running-requests",
            str(args.concurrency),
            "--torch-threads",
            str(args.threads),
        ]
        engine = ServiceProcess("engine", argv, Path(tmp) / "engine.log")
        url = f"http://127.0.0.1:{port}"
        try:
            engine.wait_healthy(url + "/health", timeout=120)
            run_clients(url, args.concurrency, 2.0, args.max_new_tokens)  # warm-up
            print(f"measuring 1 client for {args.seconds:g} s", flush=True)
            single = run_clients(url, 1, args.seconds, args.max_new_tokens)
            print(f"measuring {args.concurrency} clients for {args.seconds:g} s", flush=True)
            batched = run_clients(url, args.concurrency, args.seconds, args.max_new_tokens)
            peak = httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["peak_batch_size"]
        finally:
            engine.stop()
    print(f"max_new_tokens={args.max_new_tokens} torch_threads={args.threads} seconds={args.seconds}")
    print(f"1 client:   {single:8.1f} output tokens/s")
    print(f"{args.concurrency} clients: {batched:8.1f} output tokens/s (peak decode batch {peak})")
    print(f"ratio:      {batched / single:8.2f}x")


if __name__ == "__main__":
    main()
