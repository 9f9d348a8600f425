"""What the TrainerCore tests share: a small run spec, a group of rollouts from a model, a bounded wait,
and the real gRPC server over a core."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from google.protobuf import json_format

from rlfleet.processes import free_port
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_trainer.grpc_server import make_grpc_server
from rlfleet_trainer.trainer_core import TrainerCore


def spec_for(model_dir: Path, steps: int, groups_per_step: int) -> RunSpec:
    return json_format.ParseDict(
        {
            "model": {"path": str(model_dir)},
            "dataset": {"arithmetic": {}},
            "rollout": {"group_size": 4, "groups_per_step": groups_per_step},
            "reward": {"terms": [{"function": "arith_exact"}]},
            "trainer": {"learning_rate": 1e-3},
            "schedule": {"steps": steps},
        },
        RunSpec(),
    )


def rollout_group(model: torch.nn.Module, run_id: str, step: int, i: int) -> SampleGroup:
    """A group whose rollout log-probs come from `model` itself, as an engine serving it would give."""
    prompt = [20 + i, 15, 21, 33]
    samples = []
    for j in range(4):
        response = [22 + j, 23, 1]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
        picked = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]
        samples.append(
            Sample(
                sample_id=f"{i}-{j}",
                index=j,
                prompt_token_ids=prompt,
                response_token_ids=response,
                rollout_logprobs=picked,
                loss_mask=[1, 1, 1],
                reward=float(j % 2),
                weight_versions=[step],
                status=SampleStatus.SAMPLE_STATUS_OK,
            )
        )
    return SampleGroup(group_id=f"{run_id}/{step}/{i}", run_id=run_id, samples=samples, weight=1.0)


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def serve_grpc(core: TrainerCore) -> tuple[int, threading.Event]:
    """The real gRPC server over `core` on a free port, in a thread with its own event loop; set the
    event to stop it."""
    port, ready, done = free_port(), threading.Event(), threading.Event()

    async def run() -> None:
        server = make_grpc_server(core, "127.0.0.1", port)
        await server.start()
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.05)
        await server.stop(grace=1)

    threading.Thread(target=asyncio.run, args=(run(),), daemon=True).start()
    assert ready.wait(10), "gRPC server did not start"
    return port, done
