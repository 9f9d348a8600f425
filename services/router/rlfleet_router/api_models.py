"""Bodies of the router's own endpoints (engine endpoints are forwarded as they come, never modelled)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


class AddWorkerRequest(BaseModel):
    """sglang-router's `WorkerConfigRequest` (`POST /workers`, and `/add_worker`'s query or body): each field it
    defines is taken or refused here by name, so a launcher written for sglang-router learns at registration
    what this router does not do; fields of newer sglang-router versions, unknown here, are ignored."""

    model_config = ConfigDict(extra="ignore")

    url: str = Field(description="Base URL of the engine, e.g. http://10.0.0.5:30001.")
    worker_type: str | None = Field(
        None, description="'regular' (or absent); 'prefill' and 'decode' (disaggregation) are refused."
    )
    api_key: str | None = Field(None, description="Refused: the router sends engines no API key.")
    bootstrap_port: int | None = Field(None, description="Refused: a prefill worker's, and there are none here.")
    model_id: str | None = Field(None, description="Ignored: the router serves the one model its engines hold.")
    priority: int | None = Field(None, ge=0, description="Ignored: no routing policy here reads it.")
    cost: float | None = Field(None, ge=0, description="Ignored: no routing policy here reads it.")
    labels: dict[str, str] | None = Field(None, description="Ignored.")
    # sglang-router reads these in gRPC mode only; engines here are HTTP, as in its HTTP mode they are ignored.
    tokenizer_path: str | None = None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    chat_template: str | None = None

    @field_validator("worker_type")
    @classmethod
    def _regular_only(cls, value: str | None) -> str | None:
        if value in (None, "regular"):
            return value
        if value in ("prefill", "decode"):
            raise PydanticCustomError(
                "worker_type_unsupported",
                "{worker_type} workers are not supported: this router has no prefill-decode disaggregation; "
                "register the engine as a regular one (worker_type 'regular', or leave it out)",
                {"worker_type": value},
            )
        raise PydanticCustomError(
            "worker_type_unknown", "must be 'regular' (or absent), got '{worker_type}'", {"worker_type": value}
        )

    @field_validator("api_key")
    @classmethod
    def _no_api_key(cls, value: str | None) -> str | None:
        if value:
            raise PydanticCustomError(
                "api_key_unsupported",
                "the router sends engines no API key: an engine that requires one (SGLang's --api-key) passes its "
                "health probes, then refuses (401) every request and weight load; start it without --api-key and "
                "leave api_key out",
            )
        return None

    @field_validator("bootstrap_port")
    @classmethod
    def _no_bootstrap_port(cls, value: int | None) -> int | None:
        if value is not None:
            raise PydanticCustomError(
                "bootstrap_port_unsupported",
                "only prefill workers have one, and this router does not support them; leave bootstrap_port out",
            )
        return None


class UpdateWeightsRequest(BaseModel):
    """The fields the router reads; the whole body, extra fields included, goes to every engine."""

    model_config = ConfigDict(extra="allow")

    model_path: str = Field(min_length=1, description="Checkpoint directory every engine can read.")
    weight_version: str = Field(min_length=1, description="Version the engines report once they serve it.")

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_text(cls, value: object) -> object:
        # Trainers count steps; SGLang's weight_version is a string. Accept both, store the string.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value


def _version_as_text(value: object) -> object:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class InitWeightsGroupRequest(BaseModel):
    """SGLang's init body for the whole fleet; the router gives each engine its rank_offset (any given is ignored)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1, description="Address of the trainer's rendezvous (rank 0).")
    master_port: int = Field(ge=1, le=65535, description="Port of the trainer's rendezvous.")
    world_size: int = Field(ge=2, description="1 (the trainer) + the number of healthy engines.")
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"


class DistributedUpdateRequest(BaseModel):
    """The fields the router reads; the whole body, extra fields included, goes to every member engine."""

    model_config = ConfigDict(extra="allow")

    names: list[str] = Field(min_length=1, description="Tensors of this bucket, in broadcast order.")
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    weight_version: str | None = Field(None, min_length=1, description="Set on a version's last bucket.")

    _version_text = field_validator("weight_version", mode="before")(_version_as_text)

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> DistributedUpdateRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        return self


class DestroyWeightsGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = Field("weight_update_group", min_length=1)


class DiskCopyRequest(BaseModel):
    """Where the current weight version (received over a group) can be loaded from by engines that rejoin."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, description="Checkpoint directory of the version every engine can read.")
    weight_version: str = Field(min_length=1, description="Must be the version the fleet serves now.")

    _version_text = field_validator("weight_version", mode="before")(_version_as_text)
