"""JSON bodies of the engine's HTTP API, with SGLang's field names (GenerateReqInput and friends).

Unknown fields are ignored everywhere, so any SGLang client's requests parse; fields whose value
would change the result in a way this engine cannot honour are refused with a message naming them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from rlfleet_engine.sampling_params import SamplingParams


class GenerateRequest(BaseModel):
    """POST /generate: one prompt or a batch (a list), as text or token ids."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True

    @model_validator(mode="after")
    def _one_prompt_form(self) -> GenerateRequest:
        if self.text is None and self.input_ids is None:
            raise ValueError("provide the prompt as either text or input_ids (got neither)")
        if self.text is not None and self.input_ids is not None:
            raise ValueError("provide the prompt as either text or input_ids, not both")
        if self.input_ids is not None and len(self.input_ids) == 0:
            raise ValueError("input_ids cannot be empty")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text cannot be an empty list")
        return self

    @property
    def batch_size(self) -> int:
        if isinstance(self.text, list):
            return len(self.text)
        if self.input_ids is not None and isinstance(self.input_ids[0], list):
            return len(self.input_ids)
        return 1

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (self.input_ids is not None and isinstance(self.input_ids[0], list))


class UpdateWeightsFromDiskRequest(BaseModel):
    """POST /update_weights_from_disk."""

    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


class AbortRequest(BaseModel):
    """POST /abort_request."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _names_something(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise ValueError("give the rid of the request to abort, or abort_all: true")
        return self
