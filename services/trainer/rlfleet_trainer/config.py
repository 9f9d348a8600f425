"""Trainer settings: flags, or environment variables prefixed RLFLEET_TRAINER_."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SHUTDOWN_TIMEOUT_S = 30.0
"""How long SIGTERM waits for the step in progress and its checkpoint by default: torchrun's own --shutdown-timeout
(30 s) ends the ranks then anyway. The image (torchrun given 285 s) and the chart (from the pod's grace period) set
more."""


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_TRAINER_")

    host: str = Field("127.0.0.1", description="address the gRPC and HTTP servers bind to")
    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC Trainer service port")
    http_port: int = Field(8002, ge=0, le=65535, description="HTTP port for /health and /metrics")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the sample streams")
    redis_prefix: str = Field("rlfleet:", description="key prefix of every rlfleet key in Redis")
    router_url: str = Field("http://127.0.0.1:30000", description="router that loads weights into the engines")
    work_dir: Path = Field(Path(".rlfleet/trainer"), description="where weight versions are written")
    keep_weight_versions: int = Field(2, ge=1, description="published weight directories kept per run")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept per run (work_dir/runs/<id>/checkpoints)")
    checkpoint_timeout_s: float = Field(
        600.0, gt=0, description="bound on a Checkpoint call waiting for the step in progress to end"
    )
    shutdown_timeout_s: float = Field(
        SHUTDOWN_TIMEOUT_S,
        gt=0,
        description="on SIGTERM, bound on waiting for the step in progress and its checkpoint; keep it below "
        "torchrun's --shutdown-timeout less 15 s (the gRPC drain and a margin), or the ranks are killed first",
    )
    torch_threads: int = Field(2, ge=1, description="intra-op threads of torch on CPU")
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        description="bound on any wait between torchrun ranks (a collective, a follower's next command); one that "
        "runs out leaves the ranks out of step, and every rank ends (exit status 1) for the job to be restarted",
    )
    mixed_precision: bool = Field(False, description="FSDP: bf16 compute, fp32 weights and reduction (for GPUs)")
    activation_checkpointing: bool = Field(False, description="FSDP: recompute block activations in backward (GPU)")
    read_block_ms: int = Field(1000, ge=10, le=5000, description="longest single wait for stream entries")
    claim_idle_ms: int = Field(30_000, ge=0, description="entries idle this long on another consumer are claimed")
    weight_load_timeout_s: float = Field(300.0, gt=0, description="bound on the router loading one weight version")
    fleet_check_s: float = Field(
        15.0,
        ge=0,
        description="while waiting for groups, how often to ask the router which weight version the fleet serves, "
        "loading the run's again when it reports another or none (a restarted router); 0: never",
    )
    weight_sync: Literal["disk", "distributed"] = Field(
        "disk", description="how versions reach the engines: disk (safetensors) or distributed (broadcast, gloo/NCCL)"
    )
    weight_sync_address: str = Field("127.0.0.1", description="distributed: address the engines reach this trainer at")
    weight_sync_backend: Literal["gloo", "nccl"] = Field("gloo", description="distributed: gloo (CPU) or nccl (GPU)")
    weight_sync_bucket_mb: float = Field(256.0, gt=0, description="distributed: most megabytes sent in one broadcast")
    weight_sync_timeout_s: float = Field(
        120.0, gt=0, description="distributed: bound on engines joining the group and on each broadcast"
    )
    weight_disk_copy_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="distributed: bound on a broadcast version's disk copy, written in the background while the next "
        "step trains (writing it, registering it with the router), counted from its start; a copy still going on "
        "past it fails the run at the next wait for it",
    )
    consumer: str = Field("trainer-0", description="consumer name in the stream's consumer group")
    keep_trained_groups: bool = Field(
        False,
        description="keep the groups a checkpoint acknowledged on the run's stream, to inspect them; by default "
        "each checkpoint trims them, so a long run's stream holds only the groups not yet acknowledged",
    )
    api_token_file: str | None = Field(None, description="file holding the API token the router's admin calls need")

    @field_validator("work_dir")
    @classmethod
    def _absolute_work_dir(cls, path: Path) -> Path:
        # Paths under it go to the router (which engines load) and into the run's record in Redis (which
        # a restarted trainer resumes from): neither need share this process's working directory.
        return path.expanduser().absolute()

    @model_validator(mode="after")
    def _distinct_ports(self) -> TrainerSettings:
        # Caught here rather than when the HTTP server fails to bind, after gRPC is already serving.
        if self.grpc_port == self.http_port != 0:
            raise ValueError(
                f"grpc_port and http_port are both {self.grpc_port}; give --grpc-port and --http-port different ports"
            )
        return self
