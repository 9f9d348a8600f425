from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
    SCORE_STATUS_TIMEOUT: _ClassVar[ScoreStatus]
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus
SCORE_STATUS_TIMEOUT: ScoreStatus

class RewardTerm(_message.Message):
    __slots__ = ("function", "weight", "params")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    function: str
    weight: float
    params: _struct_pb2.Struct
    def __init__(self, function: _Optional[str] = ..., weight: _Optional[float] = ..., params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class RewardSpec(_message.Message):
    __slots__ = ("terms", "timeout_seconds")
    TERMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    terms: _containers.RepeatedCompositeFieldContainer[RewardTerm]
    timeout_seconds: float
    def __init__(self, terms: _Optional[_Iterable[_Union[RewardTerm, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("id", "prompt", "response", "label", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    response: str
    label: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., label: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "status", "score", "components", "error", "seconds")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: ScoreStatus
    score: float
    components: _containers.ScalarMap[str, float]
    error: str
    seconds: float
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., score: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("spec", "items")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpec
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, spec: _Optional[_Union[RewardSpec, _Mapping]] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ListFunctionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardFunctionInfo(_message.Message):
    __slots__ = ("name", "description", "inputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class ListFunctionsResponse(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionInfo]
    def __init__(self, functions: _Optional[_Iterable[_Union[RewardFunctionInfo, _Mapping]]] = ...) -> None: ...

class ValidateSpecRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: RewardSpec
    def __init__(self, spec: _Optional[_Union[RewardSpec, _Mapping]] = ...) -> None: ...

class SpecProblem(_message.Message):
    __slots__ = ("field", "message")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    field: str
    message: str
    def __init__(self, field: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ValidateSpecResponse(_message.Message):
    __slots__ = ("problems",)
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    problems: _containers.RepeatedCompositeFieldContainer[SpecProblem]
    def __init__(self, problems: _Optional[_Iterable[_Union[SpecProblem, _Mapping]]] = ...) -> None: ...
