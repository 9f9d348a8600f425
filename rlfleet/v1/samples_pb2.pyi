import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class SampleStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_STATUS_UNSPECIFIED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_OK: _ClassVar[SampleStatus]
    SAMPLE_STATUS_TRUNCATED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_ABORTED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_FAILED: _ClassVar[SampleStatus]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
SAMPLE_STATUS_UNSPECIFIED: SampleStatus
SAMPLE_STATUS_OK: SampleStatus
SAMPLE_STATUS_TRUNCATED: SampleStatus
SAMPLE_STATUS_ABORTED: SampleStatus
SAMPLE_STATUS_FAILED: SampleStatus

class Sample(_message.Message):
    __slots__ = ("sample_id", "index", "prompt_token_ids", "response_token_ids", "rollout_logprobs", "loss_mask", "prompt_text", "response_text", "reward", "reward_components", "weight_versions", "finish_reason", "status", "error", "cached_prompt_tokens", "seed", "metadata")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    response_text: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    status: SampleStatus
    error: str
    cached_prompt_tokens: int
    seed: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, sample_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., response_text: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., status: _Optional[_Union[SampleStatus, str]] = ..., error: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SampleGroup(_message.Message):
    __slots__ = ("group_id", "run_id", "prompt_id", "label", "samples", "weight", "created_at", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    run_id: str
    prompt_id: str
    label: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    weight: float
    created_at: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, group_id: _Optional[str] = ..., run_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., label: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., weight: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
