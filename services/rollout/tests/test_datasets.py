"""Datasets, the data position over epochs, group filters, staleness and truncation rules (no processes)."""

from __future__ import annotations

import codecs
import datetime
import decimal
import json
from pathlib import Path

import datasets as hf_datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import resolve
from rlfleet.v1.runs_pb2 import DatasetSpec, RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_rollout.datasets import LoadedDataset, Prompt, load_dataset
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.group_producer import apply_truncation_rule, sample_seed
from rlfleet_rollout.prompt_tokenizer import load_chat_template
from rlfleet_rollout.run_data import RunData
from rlfleet_rollout.step_producer import stale_rule

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(10)]


def _write(kind: str, rows: list[dict], path: Path) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        hf_datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _spec(kind: str, path: Path, **fields: object) -> DatasetSpec:
    ds = resolve(RunSpec(dataset=DatasetSpec(eval_size=3, seed=5, **fields))).dataset  # type: ignore[arg-type]
    source = getattr(ds, kind)
    source.path, source.prompt_column, source.answer_column = str(path), "prompt", "answer"
    source.metadata_columns.append("level")
    return ds


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_every_file_format_yields_the_same_split(kind: str, tmp_path: Path) -> None:
    loaded = load_dataset(_spec(kind, _write(kind, ROWS, tmp_path / kind)), 100)
    assert len(loaded.train) == 7 and len(loaded.eval) == 3 and not loaded.skipped
    assert {p.prompt for p in loaded.train} | {p.prompt for p in loaded.eval} == {r["prompt"] for r in ROWS}
    first = next(p for p in loaded.train + loaded.eval if p.prompt == "4+1=")
    assert first.answer == "5" and first.metadata == {"level": "1"}
    jsonl = load_dataset(_spec("jsonl", _write("jsonl", ROWS, tmp_path / "x.jsonl")), 100)
    assert [p.prompt for p in jsonl.eval] == [p.prompt for p in loaded.eval]  # the held-out rows depend on the seed


def test_no_training_row_repeats_a_held_out_prompt(tmp_path: Path) -> None:
    """Rows were held out by index: a prompt the file holds twice could land on both sides, and an eval_path
    that repeats training prompts (or is the training file) evaluated the run on what it trained on."""
    doubled = _write("jsonl", ROWS + ROWS, tmp_path / "doubled.jsonl")
    loaded = load_dataset(_spec("jsonl", doubled), 100)
    assert len(loaded.eval) == 3 and not {p.prompt for p in loaded.eval} & {p.prompt for p in loaded.train}
    assert len(loaded.train) == 20 - 3 - 3  # each held-out prompt's other row left out too
    spec = _spec("jsonl", _write("jsonl", ROWS, tmp_path / "train.jsonl"))
    spec.jsonl.eval_path = str(_write("jsonl", ROWS[:3], tmp_path / "eval.jsonl"))
    assert {p.prompt for p in load_dataset(spec, 100).train} == {r["prompt"] for r in ROWS[3:]}
    spec.jsonl.eval_path = spec.jsonl.path  # the training file itself: its first eval_size rows are held out
    assert {p.prompt for p in load_dataset(spec, 100).train} == {r["prompt"] for r in ROWS[3:]}
    spec.eval_size = 10
    with pytest.raises(InvalidInput, match=r"dataset\.jsonl\.path: every training prompt .* is also a held-out one"):
        load_dataset(spec, 100)


def test_held_out_rows_are_as_many_distinct_prompts_as_eval_size(tmp_path: Path) -> None:
    """Rows were held out by index: of a file that repeats its prompts, both rows of one prompt could be drawn, and
    the run was evaluated on fewer prompts than eval_size, that one weighing twice in accuracy and pass@k."""
    doubled = _write("jsonl", ROWS + ROWS, tmp_path / "doubled.jsonl")
    for seed in range(20):
        spec = _spec("jsonl", doubled)
        spec.seed, spec.eval_size = seed, 4
        loaded = load_dataset(spec, 100)
        held = [p.prompt for p in loaded.eval]
        assert len(set(held)) == len(held) == 4, (seed, held)
        assert len(loaded.train) == 20 - 2 * 4 and not set(held) & {p.prompt for p in loaded.train}
    spec.eval_size = 10  # 20 rows, but only 10 prompts: none left to train on
    with pytest.raises(
        InvalidInput,
        match=r"^dataset\.eval_size: 10 held-out prompts would leave no training prompt: "
        r".* holds 10 distinct prompts in 20 usable rows; lower it or set dataset\.jsonl\.eval_path$",
    ):
        load_dataset(spec, 100)


def test_a_missing_relative_path_is_named_with_the_directory_it_was_looked_for_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestrator's directory is not the submitter's: without it, "does not exist" named a file that does."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInput) as refused:
        load_dataset(_spec("jsonl", Path("data/train.jsonl")), 8)
    assert str(refused.value) == (
        f"dataset.jsonl.path: 'data/train.jsonl' does not exist (relative to {tmp_path}, where the orchestrator runs)"
    )
    with pytest.raises(InvalidInput, match=r"'/nowhere/train.jsonl' does not exist$"):
        load_dataset(_spec("jsonl", Path("/nowhere/train.jsonl")), 8)


def test_an_eval_path_with_fewer_rows_than_eval_size_is_refused(tmp_path: Path) -> None:
    """Its rows were taken as they were: a run asking for 200 held-out rows was evaluated on 1, without a word."""
    spec = _spec("jsonl", _write("jsonl", ROWS, tmp_path / "train.jsonl"))
    spec.jsonl.eval_path = str(_write("jsonl", [{"prompt": "e=", "answer": "1", "level": 0}] * 2, tmp_path / "e.jsonl"))
    with pytest.raises(InvalidInput) as refused:
        load_dataset(spec, 100)
    assert str(refused.value) == (
        f"dataset.eval_size: 3 held-out rows, but dataset.jsonl.eval_path ({spec.jsonl.eval_path!r}) holds 2 usable "
        "rows; lower it to 2 or add rows to eval_path"
    )
    spec.eval_size = 2
    assert [p.prompt for p in load_dataset(spec, 100).eval] == ["e=", "e="]


@pytest.mark.parametrize(("kind", "content"), [("jsonl", b""), ("jsonl", b"\n  \n\t\n"), ("parquet", None)])
@pytest.mark.parametrize("which", ["path", "eval_path"])
def test_a_file_without_rows_is_said_to_hold_none(tmp_path: Path, kind: str, content: bytes | None, which: str) -> None:
    """An empty or blank JSONL file was refused as too small for dataset.eval_size."""
    empty = tmp_path / f"empty.{kind}"
    if content is None:
        pq.write_table(pa.Table.from_pylist(ROWS).slice(0, 0), empty)
    else:
        empty.write_bytes(content)
    spec = _spec(kind, _write(kind, ROWS, tmp_path / f"rows.{kind}"))
    setattr(getattr(spec, kind), which, str(empty))
    blank = " (it is empty or holds blank lines only)" if kind == "jsonl" else ""
    with pytest.raises(InvalidInput) as refused:
        load_dataset(spec, 100)
    assert str(refused.value) == f"dataset.{kind}.{which}: {str(empty)!r} holds no row{blank}"


def test_parquet_reads_only_the_columns_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every column was read, then three kept: a file of long traces or images the run never reads was read whole."""
    rows = [{**row, "trace": "x" * 1000} for row in ROWS]
    path = _write("parquet", rows, tmp_path / "wide.parquet")
    asked: list[object] = []
    read = pq.ParquetDataset.read

    def spied(dataset: pq.ParquetDataset, columns: object = None, **kwargs: object) -> pa.Table:
        asked.append(columns)
        return read(dataset, columns=columns, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pq.ParquetDataset, "read", spied)
    loaded = load_dataset(_spec("parquet", path), 100)
    assert asked == [["prompt", "answer", "level"]]
    assert len(loaded.train) + len(loaded.eval) == len(ROWS)


@pytest.mark.parametrize("kind", ["parquet", "hf_disk"])
def test_a_missing_column_names_its_field_and_the_file(tmp_path: Path, kind: str) -> None:
    spec = _spec(kind, _write(kind, ROWS, tmp_path / "train"))
    source = getattr(spec, kind)
    source.metadata_columns.append("difficulty")
    with pytest.raises(InvalidInput) as refused:
        load_dataset(spec, 100)
    assert str(refused.value) == (
        f"dataset.{kind}.metadata_columns[1]: dataset.{kind}.path {source.path!r} has no column 'difficulty' "
        "(columns: ['prompt', 'answer', 'level']); set it to one of them"
    )
    source.metadata_columns.pop()
    source.eval_path = str(_write(kind, [{"question": "1+1=", "answer": "2", "level": 0}] * 3, tmp_path / "eval"))
    with pytest.raises(InvalidInput, match=rf"^dataset\.{kind}\.prompt_column: dataset\.{kind}\.eval_path '.*eval' "):
        load_dataset(spec, 100)


def test_a_dataset_dicts_held_out_rows_come_from_its_test_split(tmp_path: Path) -> None:
    """Pointed at a train/test DatasetDict, eval_path read its train split: the run was evaluated on the rows
    it trained on."""
    splits = {"train": hf_datasets.Dataset.from_list(ROWS[:7]), "test": hf_datasets.Dataset.from_list(ROWS[7:])}
    hf_datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    spec = _spec("hf_disk", tmp_path / "dd")
    spec.hf_disk.eval_path = str(tmp_path / "dd")
    loaded = load_dataset(spec, 100)
    assert [p.prompt for p in loaded.train] == [r["prompt"] for r in ROWS[:7]]
    assert [p.prompt for p in loaded.eval] == [r["prompt"] for r in ROWS[7:]]
    hf_datasets.DatasetDict({"train": splits["train"]}).save_to_disk(str(tmp_path / "only_train"))
    spec.hf_disk.eval_path = str(tmp_path / "only_train")
    with pytest.raises(InvalidInput, match=r"dataset\.hf_disk\.eval_path: .* without a 'test' or 'validation' split"):
        load_dataset(spec, 100)


def test_a_column_no_row_has_is_named_when_rows_are_skipped(tmp_path: Path) -> None:
    """Skipping every row left none, refused as too few for eval_size: a misnamed column read as a small dataset."""
    path = _write("jsonl", ROWS, tmp_path / "train.jsonl")
    spec = _spec("jsonl", path, bad_rows="skip")
    spec.jsonl.prompt_column = "question"
    with pytest.raises(
        InvalidInput,
        match=r"dataset\.jsonl\.path: none of the 10 rows is usable; the first: .* line 1: "
        r"column 'question' is missing",
    ):
        load_dataset(spec, 100)


def test_a_malformed_row_is_named_and_rejected_or_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in ROWS[:4]] + ["{not json", json.dumps({"answer": "1", "level": 0})]
    path.write_text("\n".join(lines + [json.dumps(r) for r in ROWS[4:]]) + "\n")
    with pytest.raises(InvalidInput, match=r"dataset\.jsonl\.path: .* line 5: not JSON"):
        load_dataset(_spec("jsonl", path), 100)
    loaded = load_dataset(_spec("jsonl", path, bad_rows="skip"), 100)
    assert len(loaded.train) + len(loaded.eval) == 10
    assert [m.split(" ", 1)[1].split(":")[0] for m in loaded.skipped] == ["line 5", "line 6"]
    rows = [*ROWS[:2], {"prompt": " \n", "answer": "0", "level": 1}, *ROWS[2:]]  # blank: nothing to ask
    parquet = _write("parquet", rows, tmp_path / "bad.parquet")
    with pytest.raises(InvalidInput, match=r"row 2: column 'prompt' must be a non-empty string"):
        load_dataset(_spec("parquet", parquet), 100)
    with pytest.raises(InvalidInput, match="no column 'level'"):
        load_dataset(_spec("parquet", _write("parquet", [{"prompt": "a", "answer": "b"}], tmp_path / "c.parquet")), 9)


def test_a_line_of_invalid_utf8_is_one_malformed_row_and_a_byte_order_mark_none(tmp_path: Path) -> None:
    """Before, one bad byte refused the whole file whatever bad_rows said, naming no line, and a file starting
    with a byte-order mark lost its first row as not JSON."""
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(r).encode() for r in ROWS]
    lines[5] = lines[5].replace(b'"prompt": "', b'"prompt": "caf\xe9 ')  # Latin-1, not UTF-8
    path.write_bytes(codecs.BOM_UTF8 + b"\n".join(lines) + b"\n")
    with pytest.raises(InvalidInput, match=r"dataset\.jsonl\.path: .* line 6: not UTF-8 text"):
        load_dataset(_spec("jsonl", path), 100)
    loaded = load_dataset(_spec("jsonl", path, bad_rows="skip"), 100)
    assert len(loaded.train) + len(loaded.eval) == len(ROWS) - 1
    assert [m.split(" ", 1)[1].split(":")[0] for m in loaded.skipped] == ["line 6"]
    assert ROWS[0]["prompt"] in {p.prompt for p in [*loaded.train, *loaded.eval]}


def test_decimal_date_and_binary_columns_read_as_their_text(tmp_path: Path) -> None:
    """They were written as JSON strings, quotes and all: no response matched an answer of `"3.14"`."""
    table = pa.table(
        {
            "prompt": [f"{i}+1=" for i in range(6)],
            "answer": pa.array([decimal.Decimal(f"{i}.25") for i in range(6)], pa.decimal128(6, 2)),
            "level": pa.array([datetime.date(2024, 1, i + 1) for i in range(6)], pa.date32()),
        }
    )
    path = tmp_path / "typed.parquet"
    pq.write_table(table, path)
    loaded = load_dataset(_spec("parquet", path), 100)
    prompts = sorted([*loaded.train, *loaded.eval], key=lambda p: p.prompt)
    assert [(p.answer, p.metadata["level"]) for p in prompts] == [(f"{i}.25", f"2024-01-0{i + 1}") for i in range(6)]

    answers = [b"42", b"7", b"\xff", b"1", b"5", b"6"]
    binary = pa.table({"prompt": [f"{c}=" for c in "abcdef"], "answer": answers, "level": [1] * 6})
    pq.write_table(binary, path)
    with pytest.raises(InvalidInput, match=r"row 2: column 'answer' holds bytes that are not UTF-8 text"):
        load_dataset(_spec("parquet", path), 100)
    loaded = load_dataset(_spec("parquet", path, bad_rows="skip"), 100)
    assert sorted(p.answer for p in [*loaded.train, *loaded.eval]) == ["1", "42", "5", "6", "7"]


def test_positions_run_through_seeded_epochs(tmp_path: Path) -> None:
    spec = resolve(RunSpec())
    spec.dataset.CopyFrom(_spec("jsonl", _write("jsonl", ROWS, tmp_path / "d.jsonl")))
    data, again = RunData.from_spec(spec), RunData.from_spec(spec)
    epochs = [[data.prompt_at(p).prompt for p in range(e * 7, (e + 1) * 7)] for e in range(3)]
    train = {p.prompt for p in data.train}
    assert all(sorted(epoch) == sorted(train) for epoch in epochs)  # each epoch uses every prompt once
    assert len({tuple(epoch) for epoch in epochs}) == 3  # shuffled anew per epoch
    assert [again.prompt_at(p).prompt for p in range(21)] == [x for epoch in epochs for x in epoch]
    assert data.epoch_of(13) == 1 and not train & {p.prompt for p in data.eval_prompts}


def test_arithmetic_runs_longer_than_its_problems_cycle_through_epochs() -> None:
    spec = RunSpec(dataset=DatasetSpec(eval_size=5))
    spec.dataset.arithmetic.digits = 1
    spec = resolve(spec)
    spec.rollout.groups_per_step, spec.schedule.steps = 16, 20  # 320 prompts from at most 100 problems
    data = RunData.from_spec(spec)
    n = len(data.train)
    assert n < 100 and sorted(data.prompt_at(n + i).prompt for i in range(n)) == sorted(p.prompt for p in data.train)


def test_a_step_across_an_epoch_boundary_takes_no_prompt_twice() -> None:
    """The next epoch's shuffle could start with a row that ended the previous one: a step taking positions on
    both sides of the boundary then trained that prompt twice in one batch."""
    rows = [Prompt(f"q{i}", str(i)) for i in range(30)]
    window = 10  # rollout.max_prompts_per_step: the most positions one step spans
    for seed in range(40):
        data = RunData(LoadedDataset(rows, [], []), seed=seed, window=window)
        names = [data.prompt_at(p).prompt for p in range(5 * 30)]
        for epoch in range(5):
            assert sorted(names[epoch * 30 : (epoch + 1) * 30]) == sorted(p.prompt for p in rows)
        for start in range(len(names) - window + 1):
            span = names[start : start + window]
            assert len(set(span)) == window, (seed, start, span)
    # The first epoch is the plain seeded shuffle: positions already recorded by runs keep their prompts.
    plain = RunData(LoadedDataset(rows, [], []), seed=3)
    guarded = RunData(LoadedDataset(rows, [], []), seed=3, window=window)
    assert [plain.prompt_at(p) for p in range(30)] == [guarded.prompt_at(p) for p in range(30)]


def _group(
    rewards: list[float], versions: list[int] | None = None, status: SampleStatus = SampleStatus.SAMPLE_STATUS_OK
) -> SampleGroup:
    versions = versions or [0] * len(rewards)
    return SampleGroup(
        samples=[
            Sample(index=j, reward=r, status=status, weight_versions=[v])
            for j, (r, v) in enumerate(zip(rewards, versions, strict=True))
        ]
    )


def test_filters_come_from_entry_points_and_name_the_first_that_drops() -> None:
    registry = FilterRegistry.from_entry_points()
    assert {"zero_variance", "all_failed", "any_failed", "all_truncated"} <= set(registry.names())
    with pytest.raises(InvalidInput, match=r"rollout.filters\[1\]: unknown group filter 'nope'"):
        registry.check(["zero_variance", "nope"])
    assert registry.reason_to_drop(["zero_variance"], _group([1.0, 1.0, 1.0])) == "zero_variance"
    assert registry.reason_to_drop(["zero_variance"], _group([1.0, 0.0, 1.0])) is None
    failed = _group([0.0, 0.0], status=SampleStatus.SAMPLE_STATUS_FAILED)
    assert registry.reason_to_drop(["all_failed", "zero_variance"], failed) == "all_failed"
    truncated = _group([0.0, 1.0], status=SampleStatus.SAMPLE_STATUS_TRUNCATED)
    assert registry.reason_to_drop(["zero_variance", "all_truncated"], truncated) == "all_truncated"


def test_stale_groups_are_dropped_or_down_weighted() -> None:
    assert stale_rule(_group([0.0, 1.0], [3, 4]), 4, 1, "drop", 0.5) is None
    assert stale_rule(_group([0.0, 1.0], [2, 4]), 4, 1, "drop", 0.5) == "stale"
    group = _group([0.0, 1.0], [2, 4])
    assert stale_rule(group, 4, 1, "downweight", 0.25) is None and group.weight == 0.25


def test_truncation_rules_and_seeds() -> None:
    for rule, reward, mask in [("keep", 1.0, [1, 1]), ("zero_reward", 0.0, [1, 1]), ("mask", 1.0, [0, 0])]:
        sample = Sample(reward=1.0, loss_mask=[1, 1], status=SampleStatus.SAMPLE_STATUS_TRUNCATED)
        apply_truncation_rule(sample, rule)
        assert (sample.reward, list(sample.loss_mask)) == (reward, mask)
    seeds = {sample_seed(7, p, j) for p in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**31 for s in seeds) and sample_seed(7, 3, 1) == sample_seed(7, 3, 1)


def test_chat_template_renders_the_user_turn_or_is_refused(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    assert load_chat_template(str(tmp_path))("2+2=") == "<s><user>2+2=<assistant>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(InvalidInput, match="dataset.chat_template: .* has no chat template"):
        load_chat_template(str(tmp_path))
