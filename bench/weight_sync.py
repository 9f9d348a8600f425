"""Weight sync benchmark: seconds from the end of an optimizer step to every engine serving the new version.

For each model (the tiny one, and a ~100M-parameter Llama with random weights), starts 2 CPU engines
(`transformers` backend) and the router as real processes; this process plays the trainer. Each
repetition changes every weight (standing in for an optimizer step), then brings the fleet to the
new version one way:
  disk         write the version as safetensors, the router has every engine load it
               (`DiskPublisher`, what the trainer does with weight_sync=disk);
  distributed  broadcast it in buckets over gloo through the weight update group the trainer opened
               once (`DistributedPublisher.serve`, weight_sync=distributed): the engines' wait;
  publish      what the trainer's step pays with weight_sync=distributed (`DistributedPublisher.publish`):
               the broadcast, and the CPU copy of the live parameters the disk copy is written from
               (this process's model is not sharded); the disk copy for engines that rejoin is written
               in the background meanwhile, timed on its own (rlfleet_trainer_weight_disk_copy_seconds)
               and waited for, untimed, before the next repetition.
A repetition's serving time ends when the call returns, which is when the router has every engine's
success; the script then checks /get_model_info of each engine. Run:

    .venv/bin/python bench/weight_sync.py [--repeats 3] [--bucket-mb 256] [--skip-large]

Record the printed figures in bench/weight_sync.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "services" / "trainer" / "tests"))

from engine_fleet import EngineFleet, start_engine_fleet  # noqa: E402

from rlfleet.tiny_model import TinyModelConfig, create_tiny_model  # noqa: E402
from rlfleet_trainer.metrics import TrainerMetrics  # noqa: E402
from rlfleet_trainer.router_client import RouterClient  # noqa: E402
from rlfleet_trainer.weight_broadcast import WeightBroadcaster  # noqa: E402
from rlfleet_trainer.weight_publisher import DiskPublisher, DistributedPublisher  # noqa: E402

MODELS = {
    "tiny": TinyModelConfig(),
    # 14 blocks of width 768 (MLP 2048, full multi-head attention): ~99M parameters.
    "100M": TinyModelConfig(hidden_size=768, layers=14, heads=12, kv_heads=12, intermediate_size=2048),
}


def fake_step(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=generator))


def check_served(fleet: EngineFleet, version: int) -> None:
    for url in fleet.engine_urls:
        served = httpx.get(f"{url}/get_model_info", timeout=30).json()["weight_version"]
        assert served == str(version), f"{url} serves {served}, expected {version}"


def timed(publish: Callable[[int], object], fleet: EngineFleet, model: PreTrainedModel, version: int) -> float:
    fake_step(model, version)
    start = time.perf_counter()
    publish(version)
    seconds = time.perf_counter() - start
    check_served(fleet, version)
    return seconds


def bench_model(name: str, config: TinyModelConfig, work: Path, repeats: int, bucket_mb: float) -> dict[str, float]:
    model_dir = work / name / "model"
    params = create_tiny_model(model_dir, config)
    print(f"\n{name}: {params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MB in float32)", flush=True)
    fleet = start_engine_fleet(model_dir, work / name / "logs")
    to_close: DistributedPublisher | None = None  # the weight update group, closed before the engines stop
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        router = RouterClient(fleet.router_url, 600.0)
        weights_root = work / name / "weights"
        disk = DiskPublisher(router, weights_root, model_dir)
        broadcaster = WeightBroadcaster(router, "127.0.0.1", "gloo", bucket_mb, timeout_s=300.0)
        metrics = TrainerMetrics()
        distributed = to_close = DistributedPublisher(broadcaster, disk, weights_root, model_dir, metrics=metrics)

        def copy_seconds_sum() -> float:
            return metrics.registry.get_sample_value("rlfleet_trainer_weight_disk_copy_seconds_sum") or 0.0

        version = 0

        def next_version() -> int:
            nonlocal version
            version += 1
            return version

        def serve(v: int) -> None:
            assert distributed.serve(model, model.state_dict(), v) is None, "the broadcast failed"

        opened = time.perf_counter()
        broadcaster.open()
        open_seconds = time.perf_counter() - opened
        disk_times, dist_times, publish_times, copy_times = [], [], [], []
        for _ in range(repeats):
            disk_times.append(timed(lambda v: disk.publish(model, v), fleet, model, next_version()))
            dist_times.append(timed(serve, fleet, model, next_version()))
            before = copy_seconds_sum()
            publish_times.append(timed(lambda v: distributed.publish(model, v), fleet, model, next_version()))
            distributed.settle()  # the disk copy, written in the background; the next repetition starts after it
            copy_times.append(copy_seconds_sum() - before)
    finally:
        try:
            if to_close is not None:
                to_close.close()
        finally:
            fleet.stop()
    result = {
        "params_m": params / 1e6,
        "disk": statistics.median(disk_times),
        "distributed": statistics.median(dist_times),
        "open": open_seconds,
        "disk_copy": statistics.median(copy_times),
        "distributed_step": statistics.median(publish_times),
    }
    print(f"  disk:        {result['disk']:.3f}s (median of {repeats}: {', '.join(f'{t:.3f}' for t in disk_times)})")
    print(f"  distributed: {result['distributed']:.3f}s ({', '.join(f'{t:.3f}' for t in dist_times)})")
    print(f"  ratio disk/distributed: {result['disk'] / result['distributed']:.2f}x")
    print(f"  group open (once per run): {open_seconds:.3f}s")
    print(
        f"  distributed, the trainer's per-step cost (publish: broadcast + CPU copy of the weights): "
        f"{result['distributed_step']:.3f}s ({', '.join(f'{t:.3f}' for t in publish_times)})"
    )
    print(
        f"  disk copy, written in the background (off the step): {result['disk_copy']:.3f}s "
        f"({', '.join(f'{t:.3f}' for t in copy_times)})"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="versions published per path and model")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="largest broadcast of the distributed path")
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this (trainer) process")
    args = parser.parse_args()
    if args.repeats < 1 or args.bucket_mb <= 0 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1, --bucket-mb positive")
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    names = ["tiny"] if args.skip_large else list(MODELS)
    with tempfile.TemporaryDirectory(prefix="rlfleet-weight-sync-") as tmp:
        results = {name: bench_model(name, MODELS[name], Path(tmp), args.repeats, args.bucket_mb) for name in names}
    print(f"\nload average at end: {os.getloadavg()}")
    print("\nmodel | params | disk s | distributed s | disk/distributed | distributed publish s | disk copy s")
    for name, r in results.items():
        ratio = r["disk"] / r["distributed"]
        cells = f"{r['disk']:.3f} | {r['distributed']:.3f} | {ratio:.2f}x | {r['distributed_step']:.3f}"
        print(f"{name} | {r['params_m']:.1f}M | {cells} | {r['disk_copy']:.3f}")


if __name__ == "__main__":
    main()
