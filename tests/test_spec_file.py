"""`rlfleet submit SPEC.yaml`: a spec file the CLI cannot parse is refused with the field's dotted path and,
for a misspelt field, the names the file could have used."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.errors import InvalidInput
from rlfleet.runs_client import load_spec_file


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


def test_a_valid_spec_file_parses(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {path: /models/tiny}\nrollout: {group_size: 4}\n")
    assert load_spec_file(spec).rollout.group_size == 4
