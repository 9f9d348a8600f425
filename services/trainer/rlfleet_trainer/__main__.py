"""`python -m rlfleet_trainer serve|sft|export`, serve usually under torchrun (`python -m rlfleet_trainer.launcher`
is torchrun without a traceback when stopped):

    torchrun --nproc_per_node=1 -m rlfleet_trainer serve --router-url http://127.0.0.1:30000
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=static --node-rank=K --master-addr=NODE0 \
        --master-port=29400 -m rlfleet_trainer serve ...     (on node K; rank 0, on NODE0, serves the API;
                                                              each node's first rank serves /health)
    python -m rlfleet_trainer sft --model-path DIR --out DIR --steps 300
    python -m rlfleet_trainer export --checkpoint DIR --base-model DIR --out DIR [--max-shard-size 5GB]

Arguments are parsed before torch is imported, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pydantic.fields import FieldInfo

from rlfleet.cli.defaults_help import DefaultsShown
from rlfleet.logs import init_logging
from rlfleet.settings_flags import Flag, add_flags, settings_from_flags
from rlfleet_trainer.config import TrainerSettings
from rlfleet_trainer.shard_size import DEFAULT_MAX_SHARD_SIZE, parse_shard_size

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from rlfleet_trainer.rank_group import RankGroup
    from rlfleet_trainer.stop_signal import StopSignal

logger = logging.getLogger("rlfleet_trainer")


def _serve_help(field: FieldInfo) -> str:
    """The setting's description, and its default when it has a value to show (not unset, not a switch's off)."""
    shown = field.default is not None and field.annotation is not bool
    return f"{field.description or ''} (default {field.default})" if shown else field.description or ""


# `serve` has a flag per setting, named after it and explained by its description; a boolean setting (off
# unless set) is a switch, `--mixed-precision`.
SERVE_FLAGS: tuple[Flag, ...] = tuple(
    Flag(f"--{name.replace('_', '-')}", _serve_help(field), kind="switch" if field.annotation is bool else "value")
    for name, field in TrainerSettings.model_fields.items()
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet_trainer", description="rlfleet trainer")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,sft,export}")
    serve = commands.add_parser("serve", help="serve the gRPC Trainer API (one process per rank, under torchrun)")
    add_flags(serve, SERVE_FLAGS, TrainerSettings)
    sft = commands.add_parser(
        "sft",
        help="supervised warm start on the arithmetic task, written as a new model",
        formatter_class=DefaultsShown,
    )
    sft.add_argument("--model-path", type=Path, required=True, help="Hugging Face model directory to start from")
    sft.add_argument("--out", type=Path, required=True, help="directory to write the trained model to")
    sft.add_argument("--steps", type=int, default=400, help="optimizer steps (as the demo's --sft-steps)")
    sft.add_argument("--batch-size", type=int, default=64, help="problems per step")
    sft.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    sft.add_argument("--digits", type=int, default=2, help="digits per operand of the arithmetic problems")
    sft.add_argument(
        "--ops", default="+", help="operators to draw from, a subset of +-*/ (--ops=-+ when - comes first)"
    )
    sft.add_argument("--seed", type=int, default=0, help="seed of the problems and the batches")
    sft.add_argument("--torch-threads", type=int, default=2, help="intra-op threads of torch on CPU")
    export = commands.add_parser("export", help="write a checkpoint as a Hugging Face model (safetensors)")
    export.add_argument(
        "--checkpoint", type=Path, required=True, help="checkpoint directory (runs/<id>/checkpoints/step_<N>)"
    )
    export.add_argument("--base-model", type=Path, required=True, help="the run's model.path: its config and tokenizer")
    export.add_argument(
        "--out", type=Path, required=True, help="directory to write the Hugging Face model to (new, or empty)"
    )
    export.add_argument(
        "--tokenizer", type=Path, help="the run's model.tokenizer_path, if it set one (default: --base-model)"
    )
    export.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="most bytes in one safetensors file, e.g. 5GB or 500MiB; a larger model is written in several, with "
        f"model.safetensors.index.json (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    return parser


def _shard_size(text: str) -> str:
    """--max-shard-size as given, once it reads as a size: a bad one stops the command before torch is imported."""
    try:
        parse_shard_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--max-shard-size ")) from exc
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    init_logging("trainer")
    if args.command == "sft":
        return run_sft_command(args)
    if args.command == "export":
        return run_export_command(args)
    return serve(settings_from_flags(TrainerSettings, SERVE_FLAGS, args, parser))


def run_sft_command(args: argparse.Namespace) -> int:
    import torch

    from rlfleet.arithmetic import ArithmeticTask
    from rlfleet_trainer.sft import SftConfig, run_sft

    torch.set_num_threads(args.torch_threads)
    if not (args.model_path / "config.json").is_file():
        error = f"--model-path: no Hugging Face model at {args.model_path} (config.json missing; `rlfleet model init`)"
        print(f"rlfleet_trainer sft: error: {error}", file=sys.stderr)
        return 2
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        error = f"{args.out} is not an empty directory; choose another --out"
        print(f"rlfleet_trainer sft: error: {error}", file=sys.stderr)
        return 2
    config = SftConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed)
    path = run_sft(args.model_path, args.out, ArithmeticTask(digits=args.digits, ops=args.ops, seed=args.seed), config)
    print(f"wrote the warm-started model to {path}")
    return 0


def run_export_command(args: argparse.Namespace) -> int:
    from rlfleet_trainer.export import export_checkpoint

    try:
        path = export_checkpoint(
            args.checkpoint, args.base_model, args.out, args.tokenizer, max_shard_size=args.max_shard_size
        )
    except (OSError, ValueError) as exc:
        print(f"rlfleet_trainer export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the model of {args.checkpoint} to {path}")
    return 0


def die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a rank outlives a killed launcher and
    keeps serving stale state. Ask Linux to SIGKILL this rank when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


# Once the ranks are broken, the calls in flight (the one that failed among them) get this long to answer before rank 0
# ends; new calls are refused from the start.
BROKEN_GRACE_S = 5.0
REFUSE_WAIT_S = 2.0
# After SIGTERM's wait for the runs (--shutdown-timeout-s), how long rank 0 still waits for an op in flight on the
# ranks before it leaves without releasing the followers (which end once it has gone): the step is abandoned.
RELEASE_WAIT_S = 3.0
EXIT_RANKS_BROKEN = 1


def serve(settings: TrainerSettings) -> int:
    """Rank 0 serves gRPC and HTTP and drives training; under torchrun with more ranks the others
    follow it, running in lockstep the collective ops it announces (rank_group.py). The first rank of
    every other node (LOCAL_RANK 0) serves that node's /health and /metrics, so every node (every
    trainer pod in Kubernetes) can be probed.

    When the ranks fall out of step for good (a rank hung or died, a collective timed out) every rank
    ends with status 1 (EXIT_RANKS_BROKEN) once the calls in flight have answered, so that torchrun
    and Kubernetes restart the job; its runs resume from their last checkpoint.

    A SIGTERM while the trainer starts ends it at once, with the status of a stop (stop_signal.py)."""
    from rlfleet_trainer.stop_signal import StoppedStarting, StopSignal

    stop = StopSignal()  # first: importing torch alone takes seconds
    ranks: RankGroup | None = None
    try:
        import torch
        from prometheus_client import CollectorRegistry

        from rlfleet_trainer.rank_group import RankGroup
        from rlfleet_trainer.rank_ops import RANK_OPS, RankState, ShardingOptions

        torch.set_num_threads(settings.torch_threads)
        if "WORLD_SIZE" in os.environ:
            die_with_launcher()
        registry = CollectorRegistry()
        options = ShardingOptions(settings.mixed_precision, settings.activation_checkpointing)
        ranks = RankGroup(RANK_OPS, RankState(options), settings.collective_timeout_s, registry)
        if ranks.rank == 0:
            return serve_api(settings, ranks, registry, stop)
        # torchrun signals every rank on shutdown; rank 0 alone decides when the followers stop.
        stop.ignore()
    except StoppedStarting:
        logger.info("stopped by SIGTERM while starting, before serving")
        if ranks is None:
            return 0
        # Rank 0 releases the followers, which wait for its commands, as after serving; a follower just ends.
        if ranks.rank == 0 and not (ranks.stop(RELEASE_WAIT_S) and ranks.close()):
            leave_now(ranks.broken)
        return left_group(ranks)
    return follow_rank_0(settings, ranks, registry)


def follow_rank_0(settings: TrainerSettings, ranks: RankGroup, registry: CollectorRegistry) -> int:
    """A rank other than 0: runs the ops rank 0 announces until it stops them, or until the ranks break."""
    from rlfleet_trainer.http_app import make_http_app
    from rlfleet_trainer.node_http import serving_in_thread
    from rlfleet_trainer.rank_group import RanksBroken

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logger.info("rank %d of %d follows rank 0", ranks.rank, ranks.ranks.world)
    node_http: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if os.environ.get("LOCAL_RANK") == "0":  # one server per node: its other ranks share its port
        app = make_http_app(registry, ranks.rank, ranks.ranks.world, lambda: ranks.broken)
        node_http = serving_in_thread(app, settings.host, settings.http_port)
    try:
        with node_http:
            ranks.follow()  # any other failure here ends the process; torchrun then stops the other ranks
    except RanksBroken:
        leave_now(ranks.broken)
    if not ranks.close():
        leave_now(ranks.broken)
    return left_group(ranks)


def serve_api(settings: TrainerSettings, ranks: RankGroup, registry: CollectorRegistry, stop: StopSignal) -> int:
    """Rank 0: the gRPC Trainer API and HTTP until SIGTERM or until the ranks break, then the runs' shutdown.
    A SIGTERM that comes before it serves ends it without serving (`stop`)."""
    import uvicorn

    from rlfleet.api_token import read_token_file
    from rlfleet.http_head_limit import HeadLimitedHttpProtocol
    from rlfleet.sample_stream import connect_redis
    from rlfleet_trainer.grpc_server import make_grpc_server
    from rlfleet_trainer.http_app import make_http_app
    from rlfleet_trainer.metrics import TrainerMetrics
    from rlfleet_trainer.router_client import RouterClient
    from rlfleet_trainer.trainer_core import TrainerCore

    metrics = TrainerMetrics(registry)
    core = TrainerCore(
        settings,
        connect_redis(settings.redis_url),
        RouterClient(settings.router_url, settings.weight_load_timeout_s, read_token_file(settings.api_token_file)),
        metrics,
        ranks,
    )

    async def run_servers() -> None:
        http = uvicorn.Server(
            uvicorn.Config(
                make_http_app(registry, ranks.rank, ranks.ranks.world, lambda: ranks.broken),
                host=settings.host,
                port=settings.http_port,
                log_config=None,
                http=HeadLimitedHttpProtocol,
            )
        )
        # From here a SIGTERM stops the servers (uvicorn does not serve once told to exit before it serves), and the
        # one uvicorn re-raises once it has stopped is swallowed, so the shutdown below runs (runs stopped, followers
        # released, every rank at the barrier) instead of dying.
        stop.serving(lambda: setattr(http, "should_exit", True))
        grpc_server = make_grpc_server(core, settings.host, settings.grpc_port)
        await grpc_server.start()
        logger.info(
            "trainer serving gRPC on %s:%d, HTTP on %s:%d",
            settings.host,
            settings.grpc_port,
            settings.host,
            settings.http_port,
        )
        broken, refusing = asyncio.Event(), threading.Event()
        loop = asyncio.get_running_loop()

        def tell_loop(_why: str) -> None:
            # The thread that found the ranks broken goes on (and fails its run) only once new calls are refused: a
            # later Status is refused too, instead of reporting FAILED (for good) a run the restarted trainer resumes.
            try:
                loop.call_soon_threadsafe(broken.set)
            except RuntimeError:  # the loop has closed: serving is over
                return
            refusing.wait(timeout=REFUSE_WAIT_S)

        async def stop_when_broken() -> None:
            await broken.wait()
            # New calls are refused from the stop's first step; those in flight (the failing one) answer first.
            stopping = asyncio.ensure_future(grpc_server.stop(grace=BROKEN_GRACE_S))
            await asyncio.sleep(0)
            refusing.set()
            await stopping
            http.should_exit = True

        ranks.on_broken(tell_loop)
        watcher = asyncio.create_task(stop_when_broken())
        try:
            await http.serve()  # returns on SIGTERM / SIGINT, or once the ranks broke
        finally:
            watcher.cancel()
            # Begun beside the gRPC drain, not after it: a StartRun waiting for the fleet's load hears of the shutdown
            # (UNAVAILABLE, naming it) within the drain, rather than gRPC's "Cancelling all calls" at its end.
            shutdown = asyncio.ensure_future(asyncio.to_thread(core.shutdown, settings.shutdown_timeout_s))
            await grpc_server.stop(grace=5)
            refusing.set()
            await shutdown

    try:
        asyncio.run(run_servers())
    finally:
        # Bounded: a step still running past --shutdown-timeout-s is abandoned, not waited for.
        if not (ranks.stop(RELEASE_WAIT_S) and ranks.close()):
            leave_now(ranks.broken)
    return left_group(ranks)


def left_group(ranks: RankGroup) -> int:
    """Status 0, once every rank met the others at the last barrier and left the process group (`RankGroup.close`).
    A torchrun rank then ends at once: Python's teardown can still abort it ("terminate called without an active
    exception": a thread of the torn-down group destroyed while joinable) and turn a clean stop into status -6."""
    if ranks.distributed:
        exit_now(0)
    return 0


def leave_now(broken: str | None) -> NoReturn:
    """Ends this rank at once, without meeting the other ranks: they are out of step (`broken`, status 1) or
    rank 0 abandoned an op still running on them at shutdown (status 0). Python's own exit could wait on the
    process group's threads, still inside a collective with a peer that hangs, for the collective timeout."""
    if broken is not None:
        logger.error("exiting with status %d so that the trainer is restarted: %s", EXIT_RANKS_BROKEN, broken)
    else:
        logger.warning("exiting with an op still running on the ranks: the step in progress is abandoned")
    exit_now(EXIT_RANKS_BROKEN if broken is not None else 0)


def exit_now(status: int) -> NoReturn:
    """Ends the process with `status` once its logs and output are flushed, skipping Python's teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
