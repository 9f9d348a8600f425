"""RunSpec defaults and validation, shared by the orchestrator (at submit) and the trainer (at start).

`resolve(spec)` returns a copy with every unset optional field filled with its default, so the
stored spec says exactly what ran; `validate(spec)` raises InvalidInput naming the first field that
is wrong and how to fix it. Checks that need another service (e.g. which reward functions exist)
are the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.struct_pb2 import ListValue, Struct, Value

from rlfleet.arithmetic import OPERATORS, ArithmeticTask, Problem
from rlfleet.errors import InvalidInput
from rlfleet.sample_stream import MAX_MAGNITUDE
from rlfleet.v1.runs_pb2 import DatasetSpec, RunSpec, SamplingParams

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
KL_MODES = ("loss", "reward")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class AlgorithmDefaults:
    """What an unset field of AlgorithmSpec means for one algorithm."""

    clip_low: float = 0.2
    clip_high: float | None = None
    """None: the same as clip_low."""
    loss_aggregation: str = "seq_mean_token_mean"
    kl_mode: str = "loss"


# The trainer's registry (rlfleet_trainer.algorithms) implements exactly these names; a test checks it.
ALGORITHM_DEFAULTS: dict[str, AlgorithmDefaults] = {
    "grpo": AlgorithmDefaults(),
    "dr_grpo": AlgorithmDefaults(loss_aggregation="seq_mean_token_sum_norm"),
    "dapo": AlgorithmDefaults(clip_high=0.28, loss_aggregation="token_mean"),
    # A sequence-level ratio (geometric mean of token ratios) strays far less from 1 than a token's.
    "gspo": AlgorithmDefaults(clip_low=3e-4, clip_high=4e-4),
    "rloo": AlgorithmDefaults(kl_mode="reward"),
    "reinforce_pp": AlgorithmDefaults(loss_aggregation="token_mean", kl_mode="reward"),
    "reinforce_pp_baseline": AlgorithmDefaults(loss_aggregation="token_mean", kl_mode="reward"),
    "ppo": AlgorithmDefaults(loss_aggregation="token_mean", kl_mode="reward"),
}
ALGORITHMS = tuple(ALGORITHM_DEFAULTS)
# What only ppo's returns and value head read, and their values when unset: the discount (REINFORCE++ discounts with
# 1), GAE's lambda and the value loss's clip range. A resolved spec holds them whatever its algorithm, so another
# algorithm's spec is refused only for a value other than these.
PPO_ONLY_DEFAULTS = {"gamma": 1.0, "gae_lambda": 0.95, "value_clip": 0.2}
# The algorithms whose advantages compare each sample with the others of its group (the trainer's per_group
# estimators): a group of identical samples gives every one of them the advantage 0. PPO (a critic) and
# REINFORCE++ (whitened over the whole batch) learn from a group whose samples agree.
GROUP_RELATIVE = frozenset({"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp_baseline"})
# Engines (SGLang, rlfleet-engine) take the most likely token below this temperature, as with top_k 1.
GREEDY_TEMPERATURE = 1e-6
MAX_TURNS = 64
MAX_GROUP_SIZE = 1024
MAX_GROUPS_PER_STEP = 16384
BAD_ROWS = ("reject", "skip")
TRUNCATED = ("keep", "zero_reward", "mask")
# Steps between checkpoints when a spec sets none: a checkpoint acknowledges the groups trained on (Redis keeps
# them until then) and is where a restarted trainer resumes, so a run without one until its end lost every step
# to a trainer crash and kept all its groups in Redis.
DEFAULT_CHECKPOINT_EVERY = 50
STALE_GROUPS = ("drop", "downweight")
ON_WEIGHT_UPDATE = ("finish", "abort_resume")
MAX_EVAL_SAMPLES = 64
# A run's record keeps every evaluation's result (under 100 bytes each) and is rewritten whole at each change, and
# Get, List and Watch answer with it: past this many, the record would outgrow what a gRPC client receives by
# default (4 MiB) and each write copy megabytes.
MAX_EVALUATIONS = 10_000
# Every evaluation generates eval_size x eval_samples answers, and submit draws the held-out rows: past
# this many, evaluation would dwarf training, and submit would hold a worker thread for seconds.
MAX_EVAL_SIZE = 10_000
# Passes of the optimizer over one rollout batch: PPO takes a few (verl's ppo_epochs, OpenRLHF's max_epochs); far
# more fits the batch's noise and moves the policy far from the one that sampled it, which the clip then hides.
MAX_EPOCHS = 32


def resolve(spec: RunSpec) -> RunSpec:
    """A copy of `spec` with defaults filled in (see the comments in runs.proto)."""
    out = RunSpec()
    out.CopyFrom(spec)
    if out.model.path and not out.model.tokenizer_path:
        out.model.tokenizer_path = out.model.path
    ds = out.dataset
    source = ds.WhichOneof("source")
    if source == "arithmetic":
        if not ds.arithmetic.HasField("digits"):
            ds.arithmetic.digits = 2
        if not ds.arithmetic.HasField("ops"):
            ds.arithmetic.ops = "+"
    elif source is not None:  # touching another member of the oneof would switch the source
        file_source = getattr(ds, source)
        if not file_source.HasField("prompt_column"):
            file_source.prompt_column = "prompt"
        if not file_source.HasField("answer_column"):
            file_source.answer_column = "answer"
    if not ds.HasField("eval_size"):
        ds.eval_size = 200
    ds.bad_rows = ds.bad_rows or "reject"
    ro = out.rollout
    ro.function = ro.function or "single_turn"
    if ro.function == "single_turn":  # its settings are multi_turn's; kept, they made evaluation run episodes
        ro.ClearField("multi_turn")
    if ro.function == "multi_turn":
        ro.multi_turn.environment = ro.multi_turn.environment or "calculator"
        if not ro.multi_turn.HasField("max_turns"):
            ro.multi_turn.max_turns = 3
    if not ro.HasField("group_size"):
        ro.group_size = 8
    if not ro.HasField("groups_per_step"):
        ro.groups_per_step = 16
    if not ro.HasField("oversample"):
        ro.oversample = 1.0
    if not ro.HasField("max_prompts_per_step"):
        # Kept inside the int32 field for any input; validate() then names the field that is out of range.
        wanted = ro.oversample * ro.groups_per_step
        ro.max_prompts_per_step = 4 * math.ceil(wanted) if math.isfinite(wanted) and wanted < 2**29 else 2**31 - 1
    ro.truncated = ro.truncated or "keep"
    ro.stale_groups = ro.stale_groups or "drop"
    if not ro.HasField("stale_weight"):
        ro.stale_weight = 0.5
    ro.on_weight_update = ro.on_weight_update or "finish"
    if not out.schedule.HasField("eval_samples"):
        out.schedule.eval_samples = 1
    sp = ro.sampling
    if not sp.HasField("temperature"):
        sp.temperature = 1.0
    if not sp.HasField("top_p"):
        sp.top_p = 1.0
    if not sp.HasField("top_k"):
        sp.top_k = -1
    if not sp.HasField("max_new_tokens"):
        sp.max_new_tokens = 16
    for term in out.reward.terms:
        if not term.HasField("weight"):
            term.weight = 1.0
    tr = out.trainer
    if not tr.HasField("learning_rate"):
        tr.learning_rate = 1e-4
    if not tr.HasField("grad_clip"):
        tr.grad_clip = 1.0
    if not tr.HasField("micro_batch_tokens"):
        tr.micro_batch_tokens = 8192
    if not tr.HasField("checkpoint_every"):
        tr.checkpoint_every = DEFAULT_CHECKPOINT_EVERY
    tr.lr_schedule = tr.lr_schedule or "constant"
    if not tr.HasField("mini_batches"):
        tr.mini_batches = 1
    if not tr.HasField("epochs"):
        tr.epochs = 1
    al = out.algorithm
    al.name = al.name or "grpo"
    # An unknown name keeps the generic defaults here; validate() names the field.
    defaults = ALGORITHM_DEFAULTS.get(al.name, AlgorithmDefaults())
    if not al.HasField("clip_low"):
        al.clip_low = defaults.clip_low
    if not al.HasField("clip_high"):
        al.clip_high = defaults.clip_high if defaults.clip_high is not None else al.clip_low
    al.loss_aggregation = al.loss_aggregation or defaults.loss_aggregation
    al.kl_mode = al.kl_mode or defaults.kl_mode
    # In the reward only k1's expectation has the gradient of the KL (E[grad log p * k1] = grad KL); k3's is
    # grad KL(pi||ref) - grad KL(ref||pi), which nearly cancels near the reference: a penalty that barely pulls.
    al.kl_estimator = al.kl_estimator or ("k1" if al.kl_mode == "reward" else "k3")
    for field, default in PPO_ONLY_DEFAULTS.items():
        if not al.HasField(field):
            setattr(al, field, default)
    if not al.HasField("critic_learning_rate"):
        al.critic_learning_rate = min(0.5, 10 * tr.learning_rate)
    if not al.HasField("clip_ratio_c"):
        al.clip_ratio_c = 3.0
    return out


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidInput(f"{field}: {message}")


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _non_finite_numbers(value: Struct | ListValue | Value, path: str) -> Iterator[str]:
    """The paths of the NaN and infinite numbers in a Struct (a reward term's params)."""
    if isinstance(value, Struct):
        for key, item in value.fields.items():
            yield from _non_finite_numbers(item, f"{path}.{key}")
    elif isinstance(value, ListValue):
        for index, item in enumerate(value.values):
            yield from _non_finite_numbers(item, f"{path}[{index}]")
    elif value.HasField("struct_value"):
        yield from _non_finite_numbers(value.struct_value, path)
    elif value.HasField("list_value"):
        yield from _non_finite_numbers(value.list_value, path)
    elif value.HasField("number_value") and not math.isfinite(value.number_value):
        yield path


def validate(spec: RunSpec) -> None:
    """Raises InvalidInput for the first wrong field of a resolved spec."""
    _require(bool(spec.model.path), "model.path", "must name the policy's Hugging Face model directory")
    ds = spec.dataset
    source = ds.WhichOneof("source")
    _require(source is not None, "dataset", "must set one of arithmetic, jsonl, parquet, hf_disk")
    if source == "arithmetic":
        _require(1 <= ds.arithmetic.digits <= 9, "dataset.arithmetic.digits", "must be between 1 and 9")
        ops = ds.arithmetic.ops
        _require(
            bool(ops) and all(op in OPERATORS for op in ops),
            "dataset.arithmetic.ops",
            f"must be a non-empty subset of {OPERATORS!r}, got {ops!r}",
        )
    else:
        _require(bool(getattr(ds, source).path), f"dataset.{source}.path", "must name the dataset file or directory")
    _require(1 <= ds.eval_size <= MAX_EVAL_SIZE, "dataset.eval_size", f"must be in [1, {MAX_EVAL_SIZE}]")
    _require(ds.bad_rows in BAD_ROWS, "dataset.bad_rows", f"must be one of {list(BAD_ROWS)}, got {ds.bad_rows!r}")

    ro = spec.rollout
    # Which rollout functions and environments exist is the orchestrator's registry's to say (at submit).
    _require(bool(ro.function), "rollout.function", "must name a registered rollout function")
    if ro.function == "multi_turn":
        _require(
            1 <= ro.multi_turn.max_turns <= MAX_TURNS,
            "rollout.multi_turn.max_turns",
            f"must be in [1, {MAX_TURNS}]",
        )
    _require(ro.group_size >= 2, "rollout.group_size", "must be >= 2 (group-relative advantages need a group)")
    # One group is one /generate request (n = group_size): bounded as engines bound a request.
    _require(ro.group_size <= MAX_GROUP_SIZE, "rollout.group_size", f"must be <= {MAX_GROUP_SIZE}")
    _require(
        1 <= ro.groups_per_step <= MAX_GROUPS_PER_STEP,
        "rollout.groups_per_step",
        f"must be in [1, {MAX_GROUPS_PER_STEP}]",
    )
    _require(ro.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0 is on-policy)")
    _require(_finite(ro.oversample) and 1 <= ro.oversample <= 16, "rollout.oversample", "must be in [1, 16]")
    _require(
        ro.max_prompts_per_step >= math.ceil(ro.oversample * ro.groups_per_step),
        "rollout.max_prompts_per_step",
        "must be >= oversample x groups_per_step (the prompts the step sends first)",
    )
    _require(ro.max_prompt_tokens >= 0, "rollout.max_prompt_tokens", "must be >= 0 (0: no limit)")
    _require(ro.truncated in TRUNCATED, "rollout.truncated", f"must be one of {list(TRUNCATED)}, got {ro.truncated!r}")
    _require(
        ro.stale_groups in STALE_GROUPS,
        "rollout.stale_groups",
        f"must be one of {list(STALE_GROUPS)}, got {ro.stale_groups!r}",
    )
    _require(_finite(ro.stale_weight) and 0 < ro.stale_weight <= 1, "rollout.stale_weight", "must be in (0, 1]")
    _require(
        ro.on_weight_update in ON_WEIGHT_UPDATE,
        "rollout.on_weight_update",
        f"must be one of {list(ON_WEIGHT_UPDATE)}, got {ro.on_weight_update!r}",
    )
    sp = ro.sampling
    _require(
        _finite(sp.temperature) and 0 <= sp.temperature <= 10, "rollout.sampling.temperature", "must be in [0, 10]"
    )
    _require(_finite(sp.top_p) and 0 < sp.top_p <= 1, "rollout.sampling.top_p", "must be in (0, 1]")
    _require(sp.top_k == -1 or sp.top_k >= 1, "rollout.sampling.top_k", "must be -1 (off) or >= 1")
    _require(1 <= sp.max_new_tokens <= 32768, "rollout.sampling.max_new_tokens", "must be in [1, 32768]")
    for i, stop in enumerate(sp.stop):
        # Matching anywhere, it is refused by rlfleet-engine (or ends every generation at once): refused here instead.
        _require(bool(stop), f"rollout.sampling.stop[{i}]", "must be a non-empty string")
    greedy = _greedy_field(sp)
    if greedy is not None and spec.algorithm.name in GROUP_RELATIVE:
        raise InvalidInput(
            f"{greedy}: greedy sampling (temperature below 1e-6, or top_k 1) makes the {ro.group_size} samples of "
            f"a group one answer, so {spec.algorithm.name}'s group-relative advantages are all 0 and the run would "
            "learn nothing"
        )

    # Which functions exist, their params, and the time limit's upper bound (a hub setting) are the
    # reward hub's to check (at submit, through its /validate).
    _require(len(spec.reward.terms) >= 1, "reward.terms", "must name at least one reward function")
    first_term: dict[str, int] = {}
    for i, term in enumerate(spec.reward.terms):
        _require(bool(term.function), f"reward.terms[{i}].function", "must name a reward function")
        first = first_term.setdefault(term.function, i)
        _require(
            first == i,
            f"reward.terms[{i}].function",
            f"{term.function!r} is already reward.terms[{first}]; each function may appear once (its score is "
            "reported under its name)",
        )
        _require(
            _finite(term.weight) and abs(term.weight) <= MAX_MAGNITUDE,
            f"reward.terms[{i}].weight",
            f"must be a finite number within +-{MAX_MAGNITUDE:g} (the largest reward a sample may carry)",
        )
        not_finite = next(_non_finite_numbers(term.params, f"reward.terms[{i}].params"), None)
        if not_finite is not None:
            raise InvalidInput(f"{not_finite}: must be a finite number (params reach the reward hub as JSON)")
    # Full marks are every positive-weight term at 1: without one, every answer of an evaluation would be correct.
    _require(
        any(term.weight > 0 for term in spec.reward.terms),
        "reward.terms",
        "must hold a term of weight > 0 (a reward to earn; a term of negative weight is a penalty)",
    )
    if spec.reward.HasField("timeout_seconds"):
        _require(
            _finite(spec.reward.timeout_seconds) and spec.reward.timeout_seconds > 0,
            "reward.timeout_seconds",
            "must be > 0 (seconds per item and function; unset means the reward hub's default)",
        )

    # Before the algorithm: its critic_learning_rate defaults to 10 x learning_rate, so a bad learning_rate
    # must be reported under its own name, not under the critic's that the user never set.
    tr = spec.trainer
    _require(_finite(tr.learning_rate) and 0 < tr.learning_rate < 1, "trainer.learning_rate", "must be in (0, 1)")
    # AdamW multiplies every weight by 1 - lr x weight_decay each step: from lr x weight_decay = 1 on, the weights
    # vanish, or flip sign and grow until they overflow.
    _require(
        _finite(tr.weight_decay) and 0 <= tr.weight_decay * tr.learning_rate < 1,
        "trainer.weight_decay",
        f"must be >= 0 and below 1 / trainer.learning_rate = {1 / tr.learning_rate:g} (each step scales every "
        "weight by 1 - learning_rate x weight_decay)",
    )
    _require(_finite(tr.grad_clip) and tr.grad_clip >= 0, "trainer.grad_clip", "must be >= 0 (0 disables)")
    _require(tr.micro_batch_tokens >= 64, "trainer.micro_batch_tokens", "must be >= 64")
    _require(tr.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
    _require(tr.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _require(
        tr.lr_schedule in LR_SCHEDULES,
        "trainer.lr_schedule",
        f"must be one of {list(LR_SCHEDULES)}, got {tr.lr_schedule!r}",
    )
    _require(_finite(tr.min_lr_ratio) and 0 <= tr.min_lr_ratio <= 1, "trainer.min_lr_ratio", "must be in [0, 1]")
    _require(tr.pack_row_tokens >= 0, "trainer.pack_row_tokens", "must be >= 0 (0: the longest sequence)")
    samples = ro.groups_per_step * ro.group_size
    _require(
        1 <= tr.mini_batches <= samples,
        "trainer.mini_batches",
        f"must be in [1, rollout.groups_per_step x rollout.group_size = {samples}] (a mini-batch needs a sample)",
    )
    _require(1 <= tr.epochs <= MAX_EPOCHS, "trainer.epochs", f"must be in [1, {MAX_EPOCHS}]")

    al = spec.algorithm
    _require(al.name in ALGORITHMS, "algorithm.name", f"must be one of {list(ALGORITHMS)}, got {al.name!r}")
    _require(0 <= al.clip_low < 1, "algorithm.clip_low", "must be in [0, 1)")
    _require(0 <= al.clip_high <= 10, "algorithm.clip_high", "must be in [0, 10]")
    _require(
        _finite(al.clip_ratio_c) and (al.clip_ratio_c == 0 or al.clip_ratio_c > 1),
        "algorithm.clip_ratio_c",
        "must be 0 (off) or > 1 (dual clip bounds a negative advantage's loss at clip_ratio_c x |A|)",
    )
    # The trainer computes the loss in float32: a coefficient past its range (3.4e38) is infinite there, and
    # multiplies the first step's KL of 0 (or any entropy) into a NaN or infinite loss at every step.
    _require(
        _finite(al.kl_coef) and 0 <= al.kl_coef <= MAX_MAGNITUDE,
        "algorithm.kl_coef",
        f"must be in [0, {MAX_MAGNITUDE:g}]",
    )
    _require(al.kl_estimator in KL_ESTIMATORS, "algorithm.kl_estimator", f"must be one of {list(KL_ESTIMATORS)}")
    _require(
        _finite(al.entropy_coef) and abs(al.entropy_coef) <= MAX_MAGNITUDE,
        "algorithm.entropy_coef",
        f"must be a finite number within +-{MAX_MAGNITUDE:g}",
    )
    _require(
        al.loss_aggregation in LOSS_AGGREGATIONS,
        "algorithm.loss_aggregation",
        f"must be one of {list(LOSS_AGGREGATIONS)}, got {al.loss_aggregation!r}",
    )
    _require(al.kl_mode in KL_MODES, "algorithm.kl_mode", f"must be one of {list(KL_MODES)}, got {al.kl_mode!r}")
    _require(
        _finite(al.tis_cap) and (al.tis_cap == 0 or al.tis_cap >= 1),
        "algorithm.tis_cap",
        "must be 0 (off) or >= 1 (a cap below 1 would shrink on-policy tokens too)",
    )
    _require(_finite(al.ratio_mask_low) and 0 <= al.ratio_mask_low < 1, "algorithm.ratio_mask_low", "must be in [0, 1)")
    _require(
        _finite(al.ratio_mask_high) and (al.ratio_mask_high == 0 or al.ratio_mask_high > 1),
        "algorithm.ratio_mask_high",
        "must be 0 (off) or > 1",
    )
    _require(_finite(al.gamma) and 0 < al.gamma <= 1, "algorithm.gamma", "must be in (0, 1]")
    _require(_finite(al.gae_lambda) and 0 <= al.gae_lambda <= 1, "algorithm.gae_lambda", "must be in [0, 1]")
    _require(_finite(al.value_clip) and al.value_clip > 0, "algorithm.value_clip", "must be > 0")
    if al.name != "ppo":  # set otherwise, they would change nothing the user asked for
        for field, default in PPO_ONLY_DEFAULTS.items():
            value = getattr(al, field)
            _require(
                value == default,
                f"algorithm.{field}",
                f"applies to ppo only: {al.name} would ignore {value:g} (leave it unset, or {default:g})",
            )
    _require(
        _finite(al.critic_learning_rate) and 0 < al.critic_learning_rate < 1,
        "algorithm.critic_learning_rate",
        "must be in (0, 1)",
    )

    # steps has no presence: a spec that leaves it out holds 0, which is then missing more than out of range.
    _require(spec.schedule.steps != 0, "schedule.steps", "is required: set the run's training steps (>= 1)")
    _require(spec.schedule.steps >= 1, "schedule.steps", "must be >= 1")
    _require(spec.schedule.eval_every >= 0, "schedule.eval_every", "must be >= 0 (0: only before and after)")
    evaluations = evaluation_count(spec.schedule.steps, spec.schedule.eval_every)
    _require(
        evaluations <= MAX_EVALUATIONS,
        "schedule.eval_every",
        f"{spec.schedule.eval_every} over {spec.schedule.steps} steps makes {evaluations} evaluations, and a run "
        f"records at most {MAX_EVALUATIONS}: evaluate less often (eval_every >= "
        f"{(spec.schedule.steps - 1) // (MAX_EVALUATIONS - 1) + 1})",
    )
    _require(
        1 <= spec.schedule.eval_samples <= MAX_EVAL_SAMPLES,
        "schedule.eval_samples",
        f"must be in [1, {MAX_EVAL_SAMPLES}]",
    )
    # One sample is greedy whatever the sampling; more are sampled as in training.
    _require(
        spec.schedule.eval_samples == 1 or greedy is None,
        "schedule.eval_samples",
        f"must be 1 when {greedy} makes sampling greedy (temperature below 1e-6, or top_k 1): the "
        f"{spec.schedule.eval_samples} samples of a held-out prompt would be one answer, and pass@k the accuracy",
    )


def evaluation_count(steps: int, eval_every: int) -> int:
    """How many evaluations a run of `steps` makes: before the first step, every `eval_every` steps in between
    (none for 0), and after the last."""
    return 2 + ((steps - 1) // eval_every if eval_every > 0 else 0)


def _greedy_field(sp: SamplingParams) -> str | None:
    """The field that makes sampling greedy (one answer, whatever the seed), or None when it samples."""
    if sp.temperature < GREEDY_TEMPERATURE:
        return "rollout.sampling.temperature"
    if sp.top_k == 1:
        return "rollout.sampling.top_k"
    return None


def arithmetic_task(ds: DatasetSpec) -> ArithmeticTask:
    """The arithmetic task of a resolved, valid DatasetSpec whose source is `arithmetic`."""
    return ArithmeticTask(digits=ds.arithmetic.digits, ops=ds.arithmetic.ops, seed=ds.seed)


def arithmetic_heldout(ds: DatasetSpec) -> list[Problem]:
    """The held-out problems of an arithmetic DatasetSpec; InvalidInput naming dataset.eval_size when its test split
    holds fewer (which only drawing them can tell for a space too large to count)."""
    try:
        return arithmetic_task(ds).problems("test", ds.eval_size)
    except ValueError as exc:
        raise InvalidInput(f"dataset.eval_size: {exc}") from exc


def relative_note(path: str | Path, reader: str) -> str:
    """ " (relative to <this directory>, where <reader> runs)" for a relative path, "" for an absolute one: an
    error about a path the spec names says where a relative one was looked for."""
    return "" if Path(path).is_absolute() else f" (relative to {Path.cwd()}, where {reader} runs)"
