from __future__ import annotations

import re

import pytest
from google.protobuf import json_format

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import resolve, validate
from rlfleet.v1.runs_pb2 import RunSpec

MINIMAL = {
    "model": {"path": "/models/tiny"},
    "dataset": {"arithmetic": {}},
    "reward": {"terms": [{"function": "arith_exact"}]},
    "schedule": {"steps": 10},
}


def spec_from(overrides: dict) -> RunSpec:
    def merge(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
        return out

    return json_format.ParseDict(merge(MINIMAL, overrides), RunSpec())


def test_defaults_are_filled_and_the_input_is_untouched() -> None:
    spec = spec_from({})
    resolved = resolve(spec)
    validate(resolved)
    assert resolved.rollout.group_size == 8 and resolved.rollout.groups_per_step == 16
    assert resolved.rollout.sampling.temperature == 1.0 and resolved.rollout.sampling.max_new_tokens == 16
    assert resolved.algorithm.name == "grpo" and resolved.algorithm.clip_high == pytest.approx(0.2)
    assert resolved.reward.terms[0].weight == 1.0
    assert resolved.dataset.arithmetic.digits == 2 and resolved.dataset.arithmetic.ops == "+"
    assert resolved.model.tokenizer_path == "/models/tiny"
    assert not spec.rollout.HasField("group_size")


def test_explicit_zero_is_kept_where_zero_means_something() -> None:
    resolved = resolve(spec_from({"rollout": {"sampling": {"temperature": 0}}, "algorithm": {"clip_low": 0.1}}))
    assert resolved.rollout.sampling.temperature == 0.0
    assert resolved.algorithm.clip_high == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": {"path": ""}}, "model.path"),
        ({"rollout": {"group_size": 1}}, "rollout.group_size"),
        ({"rollout": {"sampling": {"top_p": 0}}}, "rollout.sampling.top_p"),
        ({"rollout": {"sampling": {"max_new_tokens": 0}}}, "rollout.sampling.max_new_tokens"),
        ({"dataset": {"arithmetic": {"ops": "^"}}}, "dataset.arithmetic.ops"),
        ({"algorithm": {"name": "magic"}}, "algorithm.name"),
        ({"algorithm": {"kl_estimator": "k9"}}, "algorithm.kl_estimator"),
        ({"trainer": {"learning_rate": 5}}, "trainer.learning_rate"),
        ({"schedule": {"steps": 0}}, "schedule.steps"),
        ({"reward": {"terms": []}}, "reward.terms"),
        ({"reward": {"terms": [{"function": "arith_exact", "weight": "NaN"}]}}, "reward.terms[0].weight"),
    ],
)
def test_bad_fields_are_named(overrides: dict, field: str) -> None:
    with pytest.raises(InvalidInput, match="^" + re.escape(field) + ":"):
        validate(resolve(spec_from(overrides)))


def test_missing_dataset_is_named() -> None:
    spec = spec_from({})
    spec.ClearField("dataset")
    with pytest.raises(InvalidInput, match="^dataset:"):
        validate(resolve(spec))
