"""RunSpec defaults and validation, shared by the orchestrator (at submit) and the trainer (at start).

`resolve(spec)` returns a copy with every unset optional field filled with its default, so the
stored spec says exactly what ran; `validate(spec)` raises InvalidInput naming the first field that
is wrong and how to fix it. Checks that need another service (e.g. which reward functions exist)
are the caller's.
"""

from __future__ import annotations

import math

from rlfleet.arithmetic import OPERATORS
from rlfleet.errors import InvalidInput
from rlfleet.v1.runs_pb2 import RunSpec

ALGORITHMS = ("grpo",)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
ROLLOUT_FUNCTIONS = ("single_turn",)


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
    ro = out.rollout
    ro.function = ro.function or "single_turn"
    if not ro.HasField("group_size"):
        ro.group_size = 8
    if not ro.HasField("groups_per_step"):
        ro.groups_per_step = 16
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
    al = out.algorithm
    al.name = al.name or "grpo"
    if not al.HasField("clip_low"):
        al.clip_low = 0.2
    if not al.HasField("clip_high"):
        al.clip_high = al.clip_low
    al.kl_estimator = al.kl_estimator or "k3"
    tr = out.trainer
    if not tr.HasField("learning_rate"):
        tr.learning_rate = 1e-4
    if not tr.HasField("grad_clip"):
        tr.grad_clip = 1.0
    if not tr.HasField("micro_batch_tokens"):
        tr.micro_batch_tokens = 8192
    return out


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidInput(f"{field}: {message}")


def _finite(value: float) -> bool:
    return math.isfinite(value)


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
    _require(ds.eval_size >= 1, "dataset.eval_size", "must be >= 1")

    ro = spec.rollout
    _require(ro.function in ROLLOUT_FUNCTIONS, "rollout.function", f"must be one of {list(ROLLOUT_FUNCTIONS)}")
    _require(ro.group_size >= 2, "rollout.group_size", "must be >= 2 (group-relative advantages need a group)")
    _require(ro.groups_per_step >= 1, "rollout.groups_per_step", "must be >= 1")
    _require(ro.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0 is on-policy)")
    sp = ro.sampling
    _require(
        _finite(sp.temperature) and 0 <= sp.temperature <= 10, "rollout.sampling.temperature", "must be in [0, 10]"
    )
    _require(_finite(sp.top_p) and 0 < sp.top_p <= 1, "rollout.sampling.top_p", "must be in (0, 1]")
    _require(sp.top_k == -1 or sp.top_k >= 1, "rollout.sampling.top_k", "must be -1 (off) or >= 1")
    _require(1 <= sp.max_new_tokens <= 32768, "rollout.sampling.max_new_tokens", "must be in [1, 32768]")

    _require(len(spec.reward.terms) >= 1, "reward.terms", "must name at least one reward function")
    for i, term in enumerate(spec.reward.terms):
        _require(bool(term.function), f"reward.terms[{i}].function", "must name a reward function")
        _require(_finite(term.weight), f"reward.terms[{i}].weight", "must be a finite number")

    al = spec.algorithm
    _require(al.name in ALGORITHMS, "algorithm.name", f"must be one of {list(ALGORITHMS)}, got {al.name!r}")
    _require(0 <= al.clip_low < 1, "algorithm.clip_low", "must be in [0, 1)")
    _require(0 <= al.clip_high <= 10, "algorithm.clip_high", "must be in [0, 10]")
    _require(_finite(al.kl_coef) and al.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0")
    _require(al.kl_estimator in KL_ESTIMATORS, "algorithm.kl_estimator", f"must be one of {list(KL_ESTIMATORS)}")
    _require(_finite(al.entropy_coef), "algorithm.entropy_coef", "must be a finite number")

    tr = spec.trainer
    _require(_finite(tr.learning_rate) and 0 < tr.learning_rate < 1, "trainer.learning_rate", "must be in (0, 1)")
    _require(_finite(tr.weight_decay) and tr.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
    _require(_finite(tr.grad_clip) and tr.grad_clip >= 0, "trainer.grad_clip", "must be >= 0 (0 disables)")
    _require(tr.micro_batch_tokens >= 64, "trainer.micro_batch_tokens", "must be >= 64")
    _require(tr.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
    _require(tr.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")

    _require(spec.schedule.steps >= 1, "schedule.steps", "must be >= 1")
    _require(spec.schedule.eval_every >= 0, "schedule.eval_every", "must be >= 0 (0: only before and after)")
