"""`rlfleet submit SPEC.yaml`: a spec file the CLI cannot parse is refused with the field's dotted path and,
for a misspelt field, the names the file could have used; a file is read as JSON when named *.json, else as
YAML, and a parse error is that parser's; a schedule without steps is refused as missing them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.errors import InvalidInput
from rlfleet.proto_parse_errors import parse_json_message
from rlfleet.run_spec import resolve, validate
from rlfleet.runs_client import load_spec_file
from rlfleet.v1.runs_pb2 import RunSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "runs"


def refusal(tmp_path: Path, text: str) -> str:
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    with pytest.raises(InvalidInput) as refused:
        load_spec_file(spec)
    return str(refused.value).removeprefix(f"{spec}: ")


def test_a_misspelt_field_is_named_by_its_path_with_the_fields_a_spec_file_may_use(tmp_path: Path) -> None:
    assert refusal(tmp_path, "rollout: {sampling: {temprature: 1.0}}\n") == (
        "rollout.sampling.temprature: unknown field of rlfleet.v1.SamplingParams "
        "(its fields: temperature, top_p, top_k, max_new_tokens, stop)"
    )
    assert refusal(tmp_path, "modle: {path: /models/tiny}\n").startswith(
        "modle: unknown field of rlfleet.v1.RunSpec (its fields: name, model, dataset,"
    )


def test_a_value_of_the_wrong_type_is_named_by_its_path(tmp_path: Path) -> None:
    assert refusal(tmp_path, "rollout: {group_size: many}\n").startswith("rollout.group_size: ")


def test_a_number_beyond_a_double_is_named_by_its_path(tmp_path: Path) -> None:
    """protobuf's OverflowError went up as a traceback (the CLI) or a 500 (the Runs API)."""
    huge = "1" + "0" * 400
    assert refusal(tmp_path, f"trainer: {{learning_rate: {huge}}}\n") == (
        "trainer.learning_rate: a number too large (a double holds at most about 1.8e308)"
    )
    assert refusal(tmp_path, f"reward: {{terms: [{{function: f, params: {{x: [1, {huge}]}}}}]}}\n").startswith(
        "reward.terms[0].params.x[1]: a number too large"
    )


def test_true_or_false_for_a_floating_point_field_is_refused_naming_it(tmp_path: Path) -> None:
    """protobuf reads true as 1.0: `learning_rate: true` trained at a learning rate of 1."""
    assert refusal(tmp_path, "trainer: {learning_rate: true}\n") == (
        "trainer.learning_rate: expected a number, got true or false"
    )
    assert refusal(tmp_path, "reward: {terms: [{function: f, weight: false}]}\n") == (
        "reward.terms[0].weight: expected a number, got true or false"
    )


MAPPING_EXPECTED = [
    ("model: /some/path\n", "model: expected a mapping (such as {path: ...}), got a string"),
    ("model: ''\n", "model: expected a mapping (such as {path: ...}), got a string"),
    ("model: 5\n", "model: expected a mapping (such as {path: ...}), got a number"),
    ("model: [/some/path]\n", "model: expected a mapping (such as {path: ...}), got a list"),
    (
        "dataset: {arithmetic: true}\n",
        "dataset.arithmetic: expected a mapping (such as {digits: ...}), got true or false",
    ),
    ("reward: {terms: [arith_exact]}\n", "reward.terms[0]: expected a mapping (such as {function: ...}), got a string"),
    (
        "reward: {terms: [{function: f1}, exact]}\n",
        "reward.terms[1]: expected a mapping (such as {function: ...}), got a string",
    ),
    (
        "reward: {terms: {function: arith_exact}}\n",
        "reward.terms: expected a list of mappings (such as [{function: ...}]), got a mapping",
    ),
    ("reward: {terms: [{function: numeric, params: 7}]}\n", "reward.terms[0].params: expected a mapping, got a number"),
]


@pytest.mark.parametrize(("text", "said"), MAPPING_EXPECTED)
def test_a_value_where_a_mapping_belongs_is_named_with_what_was_expected(tmp_path: Path, text: str, said: str) -> None:
    """protobuf reads a string's characters as field names (`model./: unknown field`): the shape is checked first."""
    assert refusal(tmp_path, text) == said


@pytest.mark.parametrize(("text", "said"), MAPPING_EXPECTED)
def test_a_json_body_gets_the_same_words_as_a_spec_file(text: str, said: str) -> None:
    """The orchestrator's REST app parses a body with the same helper, `body` naming the body as a whole."""
    with pytest.raises(InvalidInput) as refused:
        parse_json_message(yaml.safe_load(text), RunSpec(), "body")
    assert str(refused.value) == said
    parsed = parse_json_message({"model": None, "reward": {"terms": []}, "schedule": {"steps": 2}}, RunSpec(), "body")
    assert not parsed.HasField("model") and parsed.schedule.steps == 2  # null is unset, as protobuf reads it


def test_a_valid_spec_file_parses(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /models/tiny}\nrollout: {group_size: 4}\n")
    assert load_spec_file(spec).rollout.group_size == 4


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("spec.txt", "is not valid YAML: while parsing a flow mapping"),
        ("spec", "is not valid YAML: while parsing a flow mapping"),
        ("spec.yml", "is not valid YAML: while parsing a flow mapping"),
        ("spec.json", "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2"),
    ],
)
def test_a_spec_file_is_json_only_when_named_so_else_yaml_and_a_parse_error_is_that_parsers(
    tmp_path: Path, name: str, error: str
) -> None:
    spec = tmp_path / name
    spec.write_text('{"model": {"path": "/models/tiny"}, "rollout": {"group_size": 4}}')  # YAML's flow style reads JSON
    assert load_spec_file(spec).rollout.group_size == 4
    if name != "spec.json":
        spec.write_text("model:\n  path: /models/tiny\nrollout: {group_size: 4}\n")
        assert load_spec_file(spec).rollout.group_size == 4
    spec.write_text("{model: {path: /models/tiny}\n")
    with pytest.raises(InvalidInput) as refused:
        load_spec_file(spec)
    assert str(refused.value).startswith(f"{spec} {error}"), refused.value


def test_a_schedule_without_steps_is_refused_as_missing_the_field(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    head = "model: {path: /models/tiny}\ndataset: {arithmetic: {}}\nreward: {terms: [{function: arith_exact}]}\n"
    spec.write_text(head + "schedule: {}\n")
    with pytest.raises(InvalidInput) as missing:
        validate(resolve(load_spec_file(spec)))
    assert str(missing.value) == "schedule.steps: is required: set the run's training steps (>= 1)"
    spec.write_text(head + "schedule: {steps: -1}\n")
    with pytest.raises(InvalidInput) as negative:
        validate(resolve(load_spec_file(spec)))
    assert str(negative.value) == "schedule.steps: must be >= 1"


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_spec_parses_and_passes_the_range_checks(example: Path) -> None:
    """The orchestrator's other checks need the fleet's files (the model is the demo's); these need nothing."""
    spec = resolve(load_spec_file(example))
    validate(spec)
    assert spec.name == example.stem, "an example is named for its file"


def test_an_exponent_without_a_dot_is_a_number_as_in_json(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "model: {path: /models/tiny}\ntrainer: {learning_rate: 1e-6}\n"
        "reward: {terms: [{function: numeric, params: {abs_tol: 1e-6, label: '1e-6'}}]}\n"
    )
    loaded = load_spec_file(spec)
    params = loaded.reward.terms[0].params
    assert loaded.trainer.learning_rate == 1e-6
    assert params["abs_tol"] == 1e-6 and params["label"] == "1e-6"  # quoted stays text


@pytest.mark.parametrize("name", ["spec.json", "spec.yaml"])
def test_a_spec_nested_too_deeply_is_refused_not_a_crash(tmp_path: Path, name: str) -> None:
    spec = tmp_path / name
    spec.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidInput, match="nested too deeply to parse"):
        load_spec_file(spec)
