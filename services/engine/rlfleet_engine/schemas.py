"""JSON bodies of the engine's HTTP API, with SGLang's field names (GenerateReqInput and friends).

Unknown fields are ignored everywhere, so any SGLang client's requests parse; fields whose value
would change the result in a way this engine cannot honour are refused with a message naming them.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.http_errors import JSON_TYPE_NAMES
from rlfleet_engine.sampling_params import SamplingParams

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """What is wrong with `text` if it holds a lone UTF-16 surrogate (JSON lets one through escaped, `"\\ud800"`),
    which is no Unicode text, cannot be encoded as UTF-8 in an answer, and a Hugging Face tokenizer refuses; None
    for Unicode text."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is None:
        return None
    return f"holds a lone UTF-16 surrogate ({found.group()!r} at character {found.start()}), which is not Unicode text"


def _unicode(text: str) -> str:
    problem = lone_surrogate(text)
    if problem is not None:
        raise ValueError(problem)
    return text


UnicodeStr = Annotated[str, AfterValidator(_unicode)]
"""A string the engine may send back (a rid, a weight version, a model name): refused unless it is Unicode text."""

# Fields of SGLang's GenerateReqInput that change what is generated or answered and that this engine cannot honour:
# refused when set (null, false or empty reads as absent, as SGLang reads it, and so does a per-prompt list of such
# values), not answered without them (the base model's tokens for a LoRA adapter, the text alone for an image, a
# session turn without the session's context, an answer missing the hidden states, routed experts, entropy or
# sampling masks asked for).
_UNSUPPORTED_GENERATE_FIELDS = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "custom_logit_processor",
    "positional_embed_overrides",
    "session_params",
    "return_hidden_states",
    "return_routed_experts",
    "return_indexer_topk",
    "return_entropy",
    "return_sampling_mask",
    "token_ids_logprob",
)
_ABSENT: tuple[object, ...] = (None, False, "", [], {})


def is_set(value: object) -> bool:
    """Whether a field the engine cannot honour asks for something: not absent (null, false, zero, empty), nor a list
    of absent values."""
    if isinstance(value, list):
        return any(is_set(item) for item in value)
    return value not in _ABSENT


PauseMode = Literal["abort", "retract", "in_place"]
"""What /pause_generation does with the requests in flight (SGLang's PauseGenerationReqInput.mode)."""


class GenerateRequest(BaseModel):
    """POST /generate: one prompt or a batch (a list), as text or token ids."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: UnicodeStr | list[UnicodeStr] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: object) -> object:
        if isinstance(data, dict):
            given = [name for name in _UNSUPPORTED_GENERATE_FIELDS if is_set(data.get(name))]
            if given:
                raise ValueError(f"{', '.join(given)}: not supported by rlfleet-engine (leave out, or null)")
        return data

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


def _version_as_text(value: object) -> object:
    # Trainers count steps; SGLang's weight_version is a string. Accept both, keep the string.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


class UpdateWeightsFromDiskRequest(BaseModel):
    """POST /update_weights_from_disk."""

    model_config = ConfigDict(extra="ignore")

    model_path: UnicodeStr
    load_format: str | None = None
    weight_version: UnicodeStr | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    _weight_version_text = field_validator("weight_version", mode="before")(_version_as_text)


class InitWeightsUpdateGroupRequest(BaseModel):
    """POST /init_weights_update_group: join the trainer's group (rank 0 hosts it at master_address:master_port)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="This engine's first rank; rank 0 is the trainer.")
    world_size: int = Field(ge=2)
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _rank_in_group(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedRequest(BaseModel):
    """POST /update_weights_from_distributed: receive these tensors, in this order, from rank 0 of the group."""

    model_config = ConfigDict(extra="ignore")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field("weight_update_group", min_length=1)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: UnicodeStr | None = None
    load_format: Literal["flattened_bucket"] | None = None

    _weight_version_text = field_validator("weight_version", mode="before")(_version_as_text)

    @model_validator(mode="after")
    def _one_entry_per_tensor(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        negative = [name for name, shape in zip(self.names, self.shapes, strict=True) if any(d < 0 for d in shape)]
        if negative:
            raise ValueError(f"shapes must not have negative sizes (tensors {negative[:5]})")
        return self


class DestroyWeightsUpdateGroupRequest(BaseModel):
    """POST /destroy_weights_update_group."""

    model_config = ConfigDict(extra="ignore")

    group_name: str = Field("weight_update_group", min_length=1)


class AbortRequest(BaseModel):
    """POST /abort_request. A rid sent as null reads as "" and "" names no request, as in SGLang (Optional[str])."""

    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False

    @field_validator("rid", mode="before")
    @classmethod
    def _null_rid_is_empty(cls, value: object) -> object:
        return "" if value is None else value

    @model_validator(mode="after")
    def _names_something(self) -> AbortRequest:
        if "rid" not in self.model_fields_set and not self.abort_all:
            raise ValueError("give the rid of the request to abort, or abort_all: true")
        return self


class PauseGenerationRequest(BaseModel):
    """POST /pause_generation. No body at all reads as `{}`."""

    model_config = ConfigDict(extra="ignore")

    mode: PauseMode = "abort"
    """"abort" ends every request in flight, as /abort_request with abort_all does; "retract" and "in_place"
    hold them until /continue_generation."""

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: object) -> object:
        # Bytes are a body not sent as JSON: pydantic's own refusal of it leads to the Content-Type hint.
        if isinstance(data, (dict, bytes, cls)):
            return data
        got = JSON_TYPE_NAMES.get(type(data), type(data).__name__)
        modes = ", ".join(repr(mode) for mode in get_args(PauseMode))
        raise ValueError(f'must be a JSON object such as {{"mode": "retract"}}, got {got}; mode is one of {modes}')
