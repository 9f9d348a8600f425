"""Reading a run's dataset: the arithmetic generator, JSONL and Parquet files, and `save_to_disk` directories.

Every source becomes a list of `Prompt` rows (prompt, reference answer, metadata columns as
strings). A malformed row (not an object, a missing or empty prompt, a missing column, a string that
is not valid Unicode, nesting too deep to read) is named by its line (JSONL, 1-based) or row (Parquet
and Arrow, 0-based) and either refuses the run or is skipped, as `dataset.bad_rows` says. A
`save_to_disk` directory is read with pyarrow directly: the orchestrator does not need (or import) the
`datasets` library.
"""

from __future__ import annotations

import codecs
import datetime
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlfleet.errors import InvalidInput
from rlfleet.run_spec import arithmetic_heldout, arithmetic_task, relative_note
from rlfleet.v1.runs_pb2 import DatasetSpec, FileDataset

logger = logging.getLogger(__name__)

# A run cycles through at most this many arithmetic problems (epoch after epoch).
MAX_ARITHMETIC_POOL = 20_000
# The split of a DatasetDict that held-out rows come from, by preference (training rows: "train").
HELD_OUT_SPLITS = ("test", "validation")


@dataclass(frozen=True)
class Prompt:
    prompt: str
    answer: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadedDataset:
    train: list[Prompt]
    eval: list[Prompt]
    skipped: list[str]
    """One message per malformed row left out (dataset.bad_rows "skip")."""


class _BadRow(ValueError):
    pass


def eval_path_rows(ds: DatasetSpec) -> int | None:
    """The usable rows of a resolved DatasetSpec's eval_path, None without one; InvalidInput as `load_dataset`."""
    source = ds.WhichOneof("source")
    if source in (None, "arithmetic"):
        return None
    spec: FileDataset = getattr(ds, source)
    if not spec.eval_path:
        return None
    field_name = f"dataset.{source}.eval_path"
    return len(_read_rows(source, Path(spec.eval_path), spec, field_name, ds.bad_rows, []))


def load_dataset(ds: DatasetSpec, train_prompts_wanted: int) -> LoadedDataset:
    """The train and held-out prompts of a resolved DatasetSpec; InvalidInput naming the field on any fault."""
    source = ds.WhichOneof("source")
    if source == "arithmetic":
        # Bounded work at submit: at most MAX_ARITHMETIC_POOL train problems, fewer when the split holds
        # fewer, and eval_size is bounded by the spec's validation.
        pool = arithmetic_task(ds).train_pool(max(1, min(train_prompts_wanted, MAX_ARITHMETIC_POOL)))
        heldout = arithmetic_heldout(ds)
        return LoadedDataset(
            [Prompt(p.prompt, p.answer) for p in pool], [Prompt(p.prompt, p.answer) for p in heldout], []
        )
    if source is None:
        raise InvalidInput("dataset: must set one of arithmetic, jsonl, parquet, hf_disk")
    spec: FileDataset = getattr(ds, source)
    field_name = f"dataset.{source}"
    skipped: list[str] = []
    rows = _read_rows(source, Path(spec.path), spec, f"{field_name}.path", ds.bad_rows, skipped)
    if spec.eval_path:
        held = _read_rows(source, Path(spec.eval_path), spec, f"{field_name}.eval_path", ds.bad_rows, skipped)
        train = rows
        if len(held) < ds.eval_size:  # taken as they were, the run was evaluated on fewer rows than it asked for
            raise InvalidInput(
                f"dataset.eval_size: {ds.eval_size} held-out rows, but {field_name}.eval_path ({spec.eval_path!r}) "
                f"holds {len(held)} usable rows; lower it to {len(held)} or add rows to eval_path"
            )
        held = held[: ds.eval_size]
    else:
        prompts = len({p.prompt for p in rows})
        if prompts <= ds.eval_size:
            raise InvalidInput(
                f"dataset.eval_size: {ds.eval_size} held-out prompts would leave no training prompt: {spec.path!r} "
                f"holds {prompts} distinct prompts in {len(rows)} usable rows; lower it or set {field_name}.eval_path"
            )
        # The held-out rows depend on the seed only, never on how far the run has got: in a seeded order of the
        # rows, the first row of each of the first eval_size distinct prompts (without repeated prompts, the first
        # eval_size rows). Drawn by row, a prompt the file repeats could be held out twice: the evaluation had
        # fewer prompts than eval_size, and weighed that one twice in accuracy and pass@k.
        order = list(range(len(rows)))
        random.Random(f"{ds.seed}/heldout").shuffle(order)
        first_row: dict[str, int] = {}
        for i in order:
            first_row.setdefault(rows[i].prompt, i)
            if len(first_row) == ds.eval_size:
                break
        held_idx = set(first_row.values())
        held = [rows[i] for i in sorted(held_idx)]
        train = [row for i, row in enumerate(rows) if i not in held_idx]
    # A training row that repeats a held-out prompt would let the run train on its own evaluation.
    held_prompts = {p.prompt for p in held}
    leaked = sum(p.prompt in held_prompts for p in train)
    if leaked:
        train = [p for p in train if p.prompt not in held_prompts]
        logger.warning("left out %d training row(s) whose prompt is a held-out one", leaked)
        if not train:
            raise InvalidInput(
                f"{field_name}.path: every training prompt of {spec.path!r} is also a held-out one; point "
                f"{field_name}.eval_path at other rows, or unset it to hold out dataset.eval_size rows of path"
            )
    for message in skipped:
        logger.warning("skipped a malformed row: %s", message)
    return LoadedDataset(train, held, skipped)


def _read_rows(
    source: str, path: Path, spec: FileDataset, field_name: str, bad_rows: str, skipped: list[str]
) -> list[Prompt]:
    try:
        found = path.exists()
    except OSError as exc:  # a name too long, a directory it may not search: not "not there"
        raise InvalidInput(f"{field_name}: cannot read {str(path)!r}: {exc.strerror}") from None
    if not found:
        raise InvalidInput(f"{field_name}: {str(path)!r} does not exist{relative_note(path, 'the orchestrator')}")
    try:
        splits = HELD_OUT_SPLITS if field_name.endswith(".eval_path") else ("train",)
        readers: dict[str, Callable[[Path, FileDataset], Iterator[tuple[str, Any]]]] = {
            "jsonl": _jsonl_records,
            "parquet": partial(_parquet_records, field_name=field_name),
            "hf_disk": partial(_arrow_dir_records, splits=splits, field_name=field_name),
        }
        records = readers[source]
        out: list[Prompt] = []
        left_out = len(skipped)
        for where, record in records(path, spec):
            try:
                out.append(_to_prompt(record, spec))
            except _BadRow as exc:
                message = f"{path} {where}: {exc}"
                if bad_rows != "skip":
                    raise InvalidInput(
                        f'{field_name}: {message} (set dataset.bad_rows to "skip" to leave such rows out)'
                    ) from exc
                skipped.append(message)
        # No row: said so, not as rows too few for dataset.eval_size.
        if not out and len(skipped) > left_out:  # a column misnamed
            raise InvalidInput(
                f"{field_name}: none of the {len(skipped) - left_out} rows is usable; the first: {skipped[left_out]}"
            )
        if not out:
            blank = " (it is empty or holds blank lines only)" if source == "jsonl" else ""
            raise InvalidInput(f"{field_name}: {str(path)!r} holds no row{blank}")
        return out
    except InvalidInput:
        raise
    except (OSError, pa.ArrowException, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InvalidInput(f"{field_name}: cannot read {str(path)!r} as {source}: {exc}") from exc


def _to_prompt(record: Any, spec: FileDataset) -> Prompt:
    if isinstance(record, _BadRow):
        raise record
    if not isinstance(record, dict):
        raise _BadRow(f"expected an object, got {type(record).__name__}")
    if spec.prompt_column not in record:
        raise _BadRow(f"column {spec.prompt_column!r} is missing")
    prompt = record[spec.prompt_column]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _BadRow(f"column {spec.prompt_column!r} must be a non-empty string, got {_kind(prompt)}")
    if spec.answer_column not in record or record[spec.answer_column] is None:
        raise _BadRow(f"column {spec.answer_column!r} is missing")
    metadata: dict[str, str] = {}
    for column in spec.metadata_columns:
        if column not in record:
            raise _BadRow(f"metadata column {column!r} is missing")
        metadata[column] = _as_text(record[column], column)
    return Prompt(
        _as_text(prompt, spec.prompt_column), _as_text(record[spec.answer_column], spec.answer_column), metadata
    )


def _kind(value: Any) -> str:
    """What a value is and how big, never what it holds: the file may be one the client could not read itself
    (a config file read as a dataset), and a refusal quoting the value would hand its content over."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return f"a {'blank ' if not value.strip() else ''}string of {len(value)} characters"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    return f"a value of type {type(value).__name__}"


def _as_text(value: Any, column: str) -> str:
    """The text of a column's value: a string as it is; a decimal, date or time as it reads (`3.14`, `2024-01-01`);
    bytes decoded as UTF-8; anything else (numbers, lists, mappings) as JSON. A bad row when the value is nested too
    deeply to write out, or is not valid Unicode: a lone surrogate, which JSON's "\\ud800" escape writes, reaches the
    tokenizer and protobuf, which refuse it hours into the run. (Parquet's decimal, date and binary columns were
    JSON strings, quotes and all, so no answer matched `"3.14"`.)"""
    try:
        text = _scalar_text(value)
        if text is None:
            text = json.dumps(value, default=_json_default)
        text.encode("utf-8")
    except RecursionError:
        raise _BadRow(f"column {column!r} is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise _BadRow(f"column {column!r} holds bytes that are not UTF-8 text (byte {exc.start})") from None
    except UnicodeEncodeError as exc:
        raise _BadRow(
            f"column {column!r} is not valid Unicode text (lone surrogate at character {exc.start})"
        ) from None
    return text


def _scalar_text(value: Any) -> str | None:
    """The text of a string, decimal, date, time or bytes value; None for any other (written as JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")  # UnicodeDecodeError: a bad row (_as_text)
    return None


def _json_default(value: Any) -> Any:
    text = _scalar_text(value)
    return str(value) if text is None else text


def _jsonl_records(path: Path, spec: FileDataset) -> Iterator[tuple[str, Any]]:
    # Read as bytes and decoded line by line, so that a line of invalid UTF-8 is a malformed row of its own, not
    # the whole file's failure; a byte-order mark (as some editors write) is not part of the first row.
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            # Reported like any other malformed row.
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield f"line {number}", _BadRow(f"not UTF-8 text: {exc}")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                record = _BadRow(f"not JSON: {exc}")
            except RecursionError:
                record = _BadRow("nested too deeply to parse")
            yield f"line {number}", record


def _columns(spec: FileDataset, names: list[str], path: Path, field_name: str) -> list[str]:
    """The columns the rows are read from (once each) of a table whose columns are `names`; InvalidInput naming the
    field of the first that is none of them (`dataset.parquet.prompt_column`, ...) and the file's field (path or
    eval_path)."""
    source_field = field_name.rsplit(".", 1)[0]
    fields = {"prompt_column": spec.prompt_column, "answer_column": spec.answer_column}
    fields |= {f"metadata_columns[{i}]": column for i, column in enumerate(spec.metadata_columns)}
    for column_field, column in fields.items():
        if column not in names:
            raise InvalidInput(
                f"{source_field}.{column_field}: {field_name} {str(path)!r} has no column {column!r} "
                f"(columns: {names}); set it to one of them"
            )
    return list(dict.fromkeys(fields.values()))


def _table_records(table: pa.Table) -> Iterator[tuple[str, Any]]:
    for index, record in enumerate(table.to_pylist()):
        yield f"row {index}", record


def _parquet_records(path: Path, spec: FileDataset, field_name: str) -> Iterator[tuple[str, Any]]:
    # Only the columns the rows need: a column of long traces or images the run never reads was read whole.
    dataset = pq.ParquetDataset(path)
    yield from _table_records(dataset.read(columns=_columns(spec, dataset.schema.names, path, field_name)))


def _arrow_dir_records(
    path: Path, spec: FileDataset, splits: tuple[str, ...], field_name: str
) -> Iterator[tuple[str, Any]]:
    """A `Dataset.save_to_disk` directory (state.json lists its Arrow stream files), or the first of `splits` a
    DatasetDict's directory holds ("train" for training rows; "test", else "validation", for held-out ones).

    What the manifests lead to must be inside the directory, checked before it is opened: RLFLEET_ROLLOUT_DATA_ROOTS
    bounds the spec's paths only, and a state.json naming `/etc/shadow` had it read, pyarrow's refusal telling its
    size."""
    inside = partial(_inside, dataset=path, field_name=field_name)
    directory = path.resolve()
    dict_file = inside(directory, "dataset_dict.json")
    if dict_file.is_file():
        manifest = json.loads(dict_file.read_text())
        present = manifest.get("splits") if isinstance(manifest, dict) else None
        if not isinstance(present, list):
            raise InvalidInput(
                f"{field_name}: {str(path / 'dataset_dict.json')!r} is not a DatasetDict's manifest (an object "
                'listing its "splits"); point the path at a `save_to_disk` directory'
            )
        split = next((name for name in splits if name in present), None)
        if split is None:
            raise InvalidInput(
                f"{field_name}: {str(path)!r} is a DatasetDict without a {' or '.join(repr(n) for n in splits)} "
                f"split (it has {present}); point {field_name} at the split's directory"
            )
        path, directory = path / split, inside(directory, split)
    state_file = inside(directory, "state.json")
    if not state_file.is_file():
        raise InvalidInput(f"{field_name}: {str(path)!r} is not a `save_to_disk` directory (no state.json)")
    files = [inside(directory, entry["filename"]) for entry in json.loads(state_file.read_text())["_data_files"]]
    tables = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())  # mapped: columns not selected stay on disk
    table = pa.concat_tables(tables)
    yield from _table_records(table.select(_columns(spec, table.column_names, path, field_name)))


def _inside(directory: Path, name: str, *, dataset: Path, field_name: str) -> Path:
    """`directory / name` with symlinks followed (an absolute `name` replaces `directory`), refused unless it is in
    `directory` (resolved): naming the entry, never what the file it leads to holds, or whether it exists."""
    try:
        target: Path | None = (directory / name).resolve()
    except RuntimeError:  # a symlink loop
        target = None
    if target is None or not target.is_relative_to(directory):
        raise InvalidInput(
            f"{field_name}: {str(dataset)!r} is not a `save_to_disk` directory: {name!r} leads outside it (symlinks "
            "followed); its manifests (dataset_dict.json, state.json), and the splits and files they name, must be "
            "inside it"
        )
    return target
