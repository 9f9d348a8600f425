"""Bodies of the router's own endpoints (engine endpoints are forwarded as they come, never modelled)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AddWorkerRequest(BaseModel):
    # sglang-router's POST /workers takes more fields (model_id, priority, labels, ...); accept and ignore them.
    model_config = ConfigDict(extra="ignore")

    url: str = Field(description="Base URL of the engine, e.g. http://10.0.0.5:30001.")


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
