import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rlfleet.v1 import runs_pb2 as _runs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_STATE_UNSPECIFIED: _ClassVar[TrainerState]
    TRAINER_STATE_IDLE: _ClassVar[TrainerState]
    TRAINER_STATE_STARTING: _ClassVar[TrainerState]
    TRAINER_STATE_TRAINING: _ClassVar[TrainerState]
    TRAINER_STATE_STOPPED: _ClassVar[TrainerState]
    TRAINER_STATE_FAILED: _ClassVar[TrainerState]
TRAINER_STATE_UNSPECIFIED: TrainerState
TRAINER_STATE_IDLE: TrainerState
TRAINER_STATE_STARTING: TrainerState
TRAINER_STATE_TRAINING: TrainerState
TRAINER_STATE_STOPPED: TrainerState
TRAINER_STATE_FAILED: TrainerState

class TrainerStatus(_message.Message):
    __slots__ = ("run_id", "state", "step", "weight_version", "weights_path", "groups_trained", "error", "checkpoint_step", "checkpoint_path", "weights_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: TrainerState
    step: int
    weight_version: int
    weights_path: str
    groups_trained: int
    error: str
    checkpoint_step: int
    checkpoint_path: str
    weights_version: int
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[TrainerState, str]] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., weights_path: _Optional[str] = ..., groups_trained: _Optional[int] = ..., error: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., checkpoint_path: _Optional[str] = ..., weights_version: _Optional[int] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("run_id", "spec")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: _runs_pb2.RunSpec
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[_runs_pb2.RunSpec, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id", "checkpoint")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    checkpoint: bool
    def __init__(self, run_id: _Optional[str] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class WatchStepsRequest(_message.Message):
    __slots__ = ("run_id", "from_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_step: int
    def __init__(self, run_id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("run_id", "step", "weight_version", "metrics", "groups", "time")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    groups: int
    time: _timestamp_pb2.Timestamp
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., groups: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
