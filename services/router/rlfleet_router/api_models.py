"""Bodies of the router's own endpoints (engine endpoints are forwarded as they come, never modelled)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


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
