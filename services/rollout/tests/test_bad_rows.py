"""Rows and files a dataset read used to take in, or fail on as an internal error, that are bad input: a string
that is not valid Unicode (failed the run hours in), a JSONL line nested too deeply to parse, a
dataset_dict.json that is not an object (both a 500 at submit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollout_test_support import Orchestrator, spec_json

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import resolve
from rlfleet.v1.runs_pb2 import DatasetSpec, RunSpec
from rlfleet_rollout.datasets import load_dataset

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": str(i % 3)} for i in range(10)]
DEEP = "[" * 50_000 + "]" * 50_000


def _spec(path: Path, bad_rows: str = "reject", kind: str = "jsonl") -> DatasetSpec:
    ds = resolve(RunSpec(dataset=DatasetSpec(eval_size=2, seed=5, bad_rows=bad_rows))).dataset
    source = getattr(ds, kind)
    source.path, source.prompt_column, source.answer_column = str(path), "prompt", "answer"
    source.metadata_columns.append("level")
    return ds


def _with_line(tmp_path: Path, line: str) -> Path:
    """ROWS as JSONL with `line` as line 4."""
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(3, line)
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("line", "column"),
    [
        # Valid JSON (the escape "\\ud800"), which json.loads turns into a str that no UTF-8 encoder takes.
        (json.dumps({"prompt": "1+\ud800=", "answer": "2", "level": "0"}), "prompt"),
        (json.dumps({"prompt": "1+1=", "answer": "\udfff", "level": "0"}), "answer"),
        (json.dumps({"prompt": "1+1=", "answer": "2", "level": "a\ud83d"}), "level"),
    ],
)
def test_a_string_that_is_not_valid_unicode_is_a_bad_row(tmp_path: Path, line: str, column: str) -> None:
    path = _with_line(tmp_path, line)
    message = rf"line 4: column '{column}' is not valid Unicode text \(lone surrogate"
    with pytest.raises(InvalidInput, match=rf"dataset\.jsonl\.path: .*{message}"):
        load_dataset(_spec(path), 100)
    loaded = load_dataset(_spec(path, bad_rows="skip"), 100)
    assert len(loaded.train) + len(loaded.eval) == len(ROWS) and len(loaded.skipped) == 1
    assert "line 4" in loaded.skipped[0]


def test_an_escaped_surrogate_pair_is_one_character_and_a_non_string_is_written_as_json(tmp_path: Path) -> None:
    path = _with_line(tmp_path, '{"prompt": "\\ud83d\\ude00+1=", "answer": {"x": "\\ud800"}, "level": 1}')
    loaded = load_dataset(_spec(path), 100)
    (row,) = [p for p in loaded.train + loaded.eval if p.prompt.endswith("+1=") and not p.prompt[0].isdigit()]
    assert row.prompt == "\U0001f600+1=" and row.answer == '{"x": "\\ud800"}' and row.metadata == {"level": "1"}


def test_a_line_nested_too_deeply_to_parse_is_a_bad_row(tmp_path: Path) -> None:
    path = _with_line(tmp_path, f'{{"prompt": "1+1=", "answer": {DEEP}, "level": "0"}}')
    with pytest.raises(InvalidInput, match=r"dataset\.jsonl\.path: .* line 4: nested too deeply"):
        load_dataset(_spec(path), 100)
    loaded = load_dataset(_spec(path, bad_rows="skip"), 100)
    assert len(loaded.train) + len(loaded.eval) == len(ROWS) and "line 4" in loaded.skipped[0]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ('["train", "test"]', r"'.*dataset_dict\.json' is not a DatasetDict's manifest"),
        ('{"splits": "train"}', r"'.*dataset_dict\.json' is not a DatasetDict's manifest"),
        ("7", r"'.*dataset_dict\.json' is not a DatasetDict's manifest"),
        (DEEP, r"cannot read '.*' as hf_disk: maximum recursion depth exceeded"),
    ],
)
def test_a_dataset_dict_json_that_is_not_a_manifest_is_named(tmp_path: Path, manifest: str, message: str) -> None:
    (tmp_path / "dataset_dict.json").write_text(manifest)
    with pytest.raises(InvalidInput, match=rf"dataset\.hf_disk\.path: {message}"):
        load_dataset(_spec(tmp_path, kind="hf_disk"), 100)


@pytest.mark.e2e
def test_submit_answers_400_naming_the_line_or_file(
    orchestrator: Orchestrator, tokenizer_dir: Path, tmp_path: Path
) -> None:
    deep = _with_line(tmp_path, f'{{"prompt": "1+1=", "answer": {DEEP}, "level": "0"}}')
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('["train", "test"]')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, {"prompt": "1+\ud800=", "answer": "1"}]))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"jsonl": {"path": str(deep)}}, "line 4: nested too deeply"),
        ({"jsonl": {"path": str(surrogate)}}, "line 11: column 'prompt' is not valid Unicode text"),
        ({"hf_disk": {"path": str(tmp_path / "dd")}}, "dataset_dict.json' is not a DatasetDict's manifest"),
    ]
    for dataset, message in cases:
        spec = spec_json(tokenizer_dir, dataset={**dataset, "seed": 1, "eval_size": 2})
        answer = httpx.post(f"{orchestrator.url}/v1/runs", json=spec, timeout=20)
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
