import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from rlfleet.v1 import reward_pb2 as _reward_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_QUEUED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_SUCCEEDED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_CANCELLED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_QUEUED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_SUCCEEDED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_CANCELLED: RunState

class ModelSpec(_message.Message):
    __slots__ = ("path", "tokenizer_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    tokenizer_path: str
    def __init__(self, path: _Optional[str] = ..., tokenizer_path: _Optional[str] = ...) -> None: ...

class ArithmeticDataset(_message.Message):
    __slots__ = ("digits", "ops")
    DIGITS_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    digits: int
    ops: str
    def __init__(self, digits: _Optional[int] = ..., ops: _Optional[str] = ...) -> None: ...

class FileDataset(_message.Message):
    __slots__ = ("path", "prompt_column", "answer_column", "metadata_columns", "eval_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    ANSWER_COLUMN_FIELD_NUMBER: _ClassVar[int]
    METADATA_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    EVAL_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    prompt_column: str
    answer_column: str
    metadata_columns: _containers.RepeatedScalarFieldContainer[str]
    eval_path: str
    def __init__(self, path: _Optional[str] = ..., prompt_column: _Optional[str] = ..., answer_column: _Optional[str] = ..., metadata_columns: _Optional[_Iterable[str]] = ..., eval_path: _Optional[str] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("arithmetic", "jsonl", "parquet", "hf_disk", "seed", "eval_size", "bad_rows", "chat_template")
    ARITHMETIC_FIELD_NUMBER: _ClassVar[int]
    JSONL_FIELD_NUMBER: _ClassVar[int]
    PARQUET_FIELD_NUMBER: _ClassVar[int]
    HF_DISK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EVAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BAD_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    arithmetic: ArithmeticDataset
    jsonl: FileDataset
    parquet: FileDataset
    hf_disk: FileDataset
    seed: int
    eval_size: int
    bad_rows: str
    chat_template: bool
    def __init__(self, arithmetic: _Optional[_Union[ArithmeticDataset, _Mapping]] = ..., jsonl: _Optional[_Union[FileDataset, _Mapping]] = ..., parquet: _Optional[_Union[FileDataset, _Mapping]] = ..., hf_disk: _Optional[_Union[FileDataset, _Mapping]] = ..., seed: _Optional[int] = ..., eval_size: _Optional[int] = ..., bad_rows: _Optional[str] = ..., chat_template: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class MultiTurnSpec(_message.Message):
    __slots__ = ("environment", "max_turns")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    environment: str
    max_turns: int
    def __init__(self, environment: _Optional[str] = ..., max_turns: _Optional[int] = ...) -> None: ...

class RolloutSpec(_message.Message):
    __slots__ = ("function", "group_size", "groups_per_step", "sampling", "max_staleness", "filters", "oversample", "max_prompts_per_step", "max_prompt_tokens", "truncated", "stale_groups", "stale_weight", "multi_turn", "on_weight_update")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    OVERSAMPLE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MULTI_TURN_FIELD_NUMBER: _ClassVar[int]
    ON_WEIGHT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    function: str
    group_size: int
    groups_per_step: int
    sampling: SamplingParams
    max_staleness: int
    filters: _containers.RepeatedScalarFieldContainer[str]
    oversample: float
    max_prompts_per_step: int
    max_prompt_tokens: int
    truncated: str
    stale_groups: str
    stale_weight: float
    multi_turn: MultiTurnSpec
    on_weight_update: str
    def __init__(self, function: _Optional[str] = ..., group_size: _Optional[int] = ..., groups_per_step: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_staleness: _Optional[int] = ..., filters: _Optional[_Iterable[str]] = ..., oversample: _Optional[float] = ..., max_prompts_per_step: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., truncated: _Optional[str] = ..., stale_groups: _Optional[str] = ..., stale_weight: _Optional[float] = ..., multi_turn: _Optional[_Union[MultiTurnSpec, _Mapping]] = ..., on_weight_update: _Optional[str] = ...) -> None: ...

class AlgorithmSpec(_message.Message):
    __slots__ = ("name", "clip_low", "clip_high", "kl_coef", "kl_estimator", "entropy_coef", "loss_aggregation", "kl_mode", "tis_cap", "ratio_mask_low", "ratio_mask_high", "gamma", "gae_lambda", "value_clip", "critic_learning_rate", "clip_ratio_c")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    KL_MODE_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    RATIO_MASK_LOW_FIELD_NUMBER: _ClassVar[int]
    RATIO_MASK_HIGH_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    GAE_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    CRITIC_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    CLIP_RATIO_C_FIELD_NUMBER: _ClassVar[int]
    name: str
    clip_low: float
    clip_high: float
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    loss_aggregation: str
    kl_mode: str
    tis_cap: float
    ratio_mask_low: float
    ratio_mask_high: float
    gamma: float
    gae_lambda: float
    value_clip: float
    critic_learning_rate: float
    clip_ratio_c: float
    def __init__(self, name: _Optional[str] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[str] = ..., entropy_coef: _Optional[float] = ..., loss_aggregation: _Optional[str] = ..., kl_mode: _Optional[str] = ..., tis_cap: _Optional[float] = ..., ratio_mask_low: _Optional[float] = ..., ratio_mask_high: _Optional[float] = ..., gamma: _Optional[float] = ..., gae_lambda: _Optional[float] = ..., value_clip: _Optional[float] = ..., critic_learning_rate: _Optional[float] = ..., clip_ratio_c: _Optional[float] = ...) -> None: ...

class TrainerSpec(_message.Message):
    __slots__ = ("learning_rate", "weight_decay", "grad_clip", "micro_batch_tokens", "warmup_steps", "checkpoint_every", "seed", "lr_schedule", "min_lr_ratio", "pack_row_tokens", "mini_batches", "epochs")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    PACK_ROW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCHES_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    weight_decay: float
    grad_clip: float
    micro_batch_tokens: int
    warmup_steps: int
    checkpoint_every: int
    seed: int
    lr_schedule: str
    min_lr_ratio: float
    pack_row_tokens: int
    mini_batches: int
    epochs: int
    def __init__(self, learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip: _Optional[float] = ..., micro_batch_tokens: _Optional[int] = ..., warmup_steps: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., seed: _Optional[int] = ..., lr_schedule: _Optional[str] = ..., min_lr_ratio: _Optional[float] = ..., pack_row_tokens: _Optional[int] = ..., mini_batches: _Optional[int] = ..., epochs: _Optional[int] = ...) -> None: ...

class ScheduleSpec(_message.Message):
    __slots__ = ("steps", "eval_every", "eval_samples")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    EVAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    steps: int
    eval_every: int
    eval_samples: int
    def __init__(self, steps: _Optional[int] = ..., eval_every: _Optional[int] = ..., eval_samples: _Optional[int] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("name", "model", "dataset", "rollout", "reward", "algorithm", "trainer", "schedule")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: ModelSpec
    dataset: DatasetSpec
    rollout: RolloutSpec
    reward: _reward_pb2.RewardSpec
    algorithm: AlgorithmSpec
    trainer: TrainerSpec
    schedule: ScheduleSpec
    def __init__(self, name: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., dataset: _Optional[_Union[DatasetSpec, _Mapping]] = ..., rollout: _Optional[_Union[RolloutSpec, _Mapping]] = ..., reward: _Optional[_Union[_reward_pb2.RewardSpec, _Mapping]] = ..., algorithm: _Optional[_Union[AlgorithmSpec, _Mapping]] = ..., trainer: _Optional[_Union[TrainerSpec, _Mapping]] = ..., schedule: _Optional[_Union[ScheduleSpec, _Mapping]] = ...) -> None: ...

class RunProgress(_message.Message):
    __slots__ = ("step", "total_steps", "weight_version", "groups_produced", "groups_trained", "groups_filtered", "mean_reward", "filtered_by_reason", "rows_skipped", "prompts_consumed", "epoch", "groups_downweighted")
    class FilteredByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    FILTERED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    ROWS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DOWNWEIGHTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    weight_version: int
    groups_produced: int
    groups_trained: int
    groups_filtered: int
    mean_reward: float
    filtered_by_reason: _containers.ScalarMap[str, int]
    rows_skipped: int
    prompts_consumed: int
    epoch: int
    groups_downweighted: int
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., groups_produced: _Optional[int] = ..., groups_trained: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., mean_reward: _Optional[float] = ..., filtered_by_reason: _Optional[_Mapping[str, int]] = ..., rows_skipped: _Optional[int] = ..., prompts_consumed: _Optional[int] = ..., epoch: _Optional[int] = ..., groups_downweighted: _Optional[int] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("step", "weight_version", "size", "accuracy", "pass_at_k", "mean_length", "truncation_rate", "k", "failed", "prompts_too_long")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_K_FIELD_NUMBER: _ClassVar[int]
    MEAN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_RATE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_TOO_LONG_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    size: int
    accuracy: float
    pass_at_k: float
    mean_length: float
    truncation_rate: float
    k: int
    failed: int
    prompts_too_long: int
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., size: _Optional[int] = ..., accuracy: _Optional[float] = ..., pass_at_k: _Optional[float] = ..., mean_length: _Optional[float] = ..., truncation_rate: _Optional[float] = ..., k: _Optional[int] = ..., failed: _Optional[int] = ..., prompts_too_long: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("id", "spec", "state", "error", "progress", "metrics", "evals", "created_at", "started_at", "finished_at", "stalled")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: RunSpec
    state: RunState
    error: str
    progress: RunProgress
    metrics: _containers.ScalarMap[str, float]
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    stalled: str
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., state: _Optional[_Union[RunState, str]] = ..., error: _Optional[str] = ..., progress: _Optional[_Union[RunProgress, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stalled: _Optional[str] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("spec", "validate_only", "request_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VALIDATE_ONLY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    spec: RunSpec
    validate_only: bool
    request_id: str
    def __init__(self, spec: _Optional[_Union[RunSpec, _Mapping]] = ..., validate_only: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("state", "page_size", "page_token")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    page_size: int
    page_token: str
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("run", "message", "time")
    RUN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run: Run
    message: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ..., message: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
