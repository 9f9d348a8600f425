"""Trainer settings: flags, or environment variables prefixed RLFLEET_TRAINER_."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLFLEET_TRAINER_")

    host: str = Field("127.0.0.1", description="address the gRPC and HTTP servers bind to")
    grpc_port: int = Field(50052, description="gRPC Trainer service port")
    http_port: int = Field(8002, description="HTTP port for /health and /metrics")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the sample streams")
    redis_prefix: str = Field("rlfleet:", description="key prefix of every rlfleet key in Redis")
    router_url: str = Field("http://127.0.0.1:30000", description="router that loads weights into the engines")
    work_dir: Path = Field(Path(".rlfleet/trainer"), description="where weight versions are written")
    keep_weight_versions: int = Field(2, ge=1, description="published weight directories kept per run")
    torch_threads: int = Field(2, ge=1, description="intra-op threads of torch on CPU")
    read_block_ms: int = Field(1000, ge=10, le=5000, description="longest single wait for stream entries")
    claim_idle_ms: int = Field(30_000, ge=0, description="entries idle this long on another consumer are claimed")
    weight_load_timeout_s: float = Field(300.0, gt=0, description="bound on the router loading one weight version")
    consumer: str = Field("trainer-0", description="consumer name in the stream's consumer group")
