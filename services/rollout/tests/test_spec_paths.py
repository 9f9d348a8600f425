"""What a run spec may make the orchestrator read, and what a refusal may tell about it (security review): with
RLFLEET_ROLLOUT_DATA_ROOTS set, every dataset, model and tokenizer path must resolve (symlinks followed) under
one of the roots, refused at submit before anything is opened; a bad row's error names the value's kind and
size, never its content; a body nested too deeply to parse is a 400, not a 500."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import httpx
import pyarrow as pa
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct
from rollout_test_support import spec_json

from rlfleet.api_token import ApiTokenGuard
from rlfleet.errors import InvalidInput, Unavailable
from rlfleet.processes import free_port
from rlfleet.run_spec import resolve
from rlfleet.v1.runs_pb2 import DatasetSpec, RunSpec, SubmitRunRequest
from rlfleet_rollout.config import RolloutConfig
from rlfleet_rollout.datasets import load_dataset
from rlfleet_rollout.group_filters import FilterRegistry
from rlfleet_rollout.grpc_server import build_grpc_server
from rlfleet_rollout.http_app import build_app, parse_run_spec
from rlfleet_rollout.metrics import RolloutMetrics
from rlfleet_rollout.reward_client import RewardClient
from rlfleet_rollout.rollout_function import RolloutRegistry
from rlfleet_rollout.run_events import RunNotifier
from rlfleet_rollout.run_store import RunStore
from rlfleet_rollout.runs_core import RunsCore

DEEP_BODY = b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _core(data_roots: list[Path]) -> RunsCore:
    """A core over Redis and a reward hub that nobody serves: a path refused at submit never reaches either."""
    return RunsCore(
        RunStore(aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0"), "x:"),
        RewardClient(httpx.AsyncClient(), "http://127.0.0.1:9", score_timeout_s=1, validate_timeout_s=1),
        RunNotifier(),
        RolloutMetrics(),
        filters=FilterRegistry({}),
        rollouts=RolloutRegistry.from_entry_points(),
        poll_interval_s=0.1,
        run_data_retention_s=60,
        data_roots=data_roots,
    )


def _submit(spec: dict[str, Any], data_roots: list[Path]) -> None:
    asyncio.run(_core(data_roots).submit(json_format.ParseDict(spec, RunSpec()), validate_only=True))


def _accepted(spec: dict[str, Any], data_roots: list[Path]) -> None:
    """Every check of submit passes up to the reward hub's, the last, which nobody serves here: the model,
    tokenizer and dataset were taken and read."""
    with pytest.raises(Unavailable, match="the reward hub could not check"):
        _submit(spec, data_roots)


def _jsonl(path: Path, rows: int = 12) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(rows)))
    return path


@pytest.fixture
def roots(tmp_path: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """A data root holding a model (the tokenizer's directory, copied) and a dataset; a directory outside it."""
    root, outside = tmp_path / "data", tmp_path / "elsewhere"
    (root / "model").mkdir(parents=True)
    outside.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (root / "model" / name).write_bytes((tokenizer_dir / name).read_bytes())
    _jsonl(root / "rows.jsonl")
    _jsonl(outside / "rows.jsonl")
    (outside / "secret.json").write_text(json.dumps({"db": {"password": "s3cr3t", "user": "admin"}}))
    return {"root": root, "outside": outside}


def _dataset(path: Path, **more: Any) -> dict[str, Any]:
    return {"jsonl": {"path": str(path), "prompt_column": "prompt", "answer_column": "answer", **more}, "eval_size": 2}


def test_paths_under_the_roots_are_taken(roots: dict[str, Path]) -> None:
    root = roots["root"]
    _accepted(spec_json(root / "model", dataset=_dataset(root / "rows.jsonl")), [root])
    _accepted(spec_json(root / "model", dataset=_dataset(roots["outside"] / "rows.jsonl")), [roots["outside"], root])


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("model.path", lambda r: spec_json(r["outside"], dataset=_dataset(r["root"] / "rows.jsonl"))),
        (
            "model.tokenizer_path",
            lambda r: spec_json(
                r["root"] / "model",
                model={"path": str(r["root"] / "model"), "tokenizer_path": str(r["outside"])},
                dataset=_dataset(r["root"] / "rows.jsonl"),
            ),
        ),
        (
            "dataset.jsonl.path",
            lambda r: spec_json(r["root"] / "model", dataset=_dataset(r["outside"] / "secret.json")),
        ),
        (
            "dataset.jsonl.eval_path",
            lambda r: spec_json(
                r["root"] / "model",
                dataset=_dataset(r["root"] / "rows.jsonl", eval_path=str(r["outside"] / "rows.jsonl")),
            ),
        ),
        # `..` and symlinks are resolved before the check.
        (
            "dataset.jsonl.path",
            lambda r: spec_json(r["root"] / "model", dataset=_dataset(r["root"] / ".." / "elsewhere" / "rows.jsonl")),
        ),
        ("dataset.jsonl.path", lambda r: spec_json(r["root"] / "model", dataset=_dataset(r["root"] / "link.jsonl"))),
        ("dataset.jsonl.path", lambda r: spec_json(r["root"] / "model", dataset=_dataset(Path("/etc/passwd")))),
        # Paths that cannot be resolved at all.
        ("dataset.jsonl.path", lambda r: spec_json(r["root"] / "model", dataset=_dataset(r["root"] / "a\0b"))),
        ("dataset.jsonl.path", lambda r: spec_json(r["root"] / "model", dataset=_dataset(r["root"] / "loop"))),
    ],
)
def test_a_path_outside_the_roots_is_refused_naming_the_field_and_the_roots(
    roots: dict[str, Path], field: str, make: Any
) -> None:
    (roots["root"] / "link.jsonl").symlink_to(roots["outside"] / "secret.json")
    (roots["root"] / "loop").symlink_to(roots["root"] / "loop")
    with pytest.raises(InvalidInput) as refused:
        _submit(make(roots), [roots["root"]])
    message = str(refused.value)
    assert message.startswith(f"{field}: "), message
    assert "RLFLEET_ROLLOUT_DATA_ROOTS" in message and str(roots["root"].resolve()) in message, message
    assert "s3cr3t" not in message and "does not exist" not in message and "JSON" not in message, message


def test_without_roots_any_path_is_read_as_before(roots: dict[str, Path]) -> None:
    model = roots["outside"] / ".." / "data" / "model"
    _accepted(spec_json(model, dataset=_dataset(roots["outside"] / "rows.jsonl")), [])


def _save_to_disk(directory: Path, prompts: list[str], data_file: str = "data-00000-of-00001.arrow") -> Path:
    """A `save_to_disk` directory as the orchestrator reads it: an Arrow stream file and the state.json naming it."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.table({"prompt": prompts, "answer": [str(i) for i in range(len(prompts))]})
    with pa.OSFile(str(directory / data_file), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": data_file}]}))
    return directory


def _escape(r: dict[str, Path], how: str) -> Path:
    """A dataset directory under the root whose manifests lead, `how`, to rows or a file outside it."""
    secret, ds = _save_to_disk(r["outside"] / "secret_ds", [f"secret prompt {i}" for i in range(5)]), r["root"] / "ds"
    ds.mkdir()
    if how == "split symlink":
        (ds / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
        (ds / "train").symlink_to(secret)
    elif how == "state.json symlink":
        (ds / "state.json").symlink_to(secret / "state.json")
    else:
        names = {
            "absolute": str(secret / "data-00000-of-00001.arrow"),
            "dot-dot": "../../elsewhere/secret_ds/data-00000-of-00001.arrow",
            "a file not Arrow": str(r["outside"] / "secret.json"),  # pyarrow's refusal told its size
            "data file symlink": "data.arrow",
        }
        (ds / "data.arrow").symlink_to(secret / "data-00000-of-00001.arrow")
        (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": names[how]}]}))
    return ds


@pytest.mark.parametrize(
    "how", ["absolute", "dot-dot", "a file not Arrow", "data file symlink", "split symlink", "state.json symlink"]
)
def test_a_save_to_disk_manifest_leading_outside_the_dataset_is_refused_before_it_is_read(
    roots: dict[str, Path], how: str
) -> None:
    """The roots bound the spec's paths; the files a state.json names, and a DatasetDict's split directories, were
    followed wherever they led: the orchestrator read rows outside the roots, and quoted pyarrow on any file."""
    dataset = {"hf_disk": {"path": str(_escape(roots, how))}, "eval_size": 1}
    with pytest.raises(InvalidInput) as refused:
        _submit(spec_json(roots["root"] / "model", dataset=dataset), [roots["root"]])
    message = str(refused.value)
    assert message.startswith(f"dataset.hf_disk.path: '{roots['root'] / 'ds'}' is not a `save_to_disk` directory: ")
    assert "leads outside it (symlinks followed)" in message, message
    assert "secret prompt" not in message and "s3cr3t" not in message and "bytes" not in message, message


def test_a_save_to_disk_directory_reached_through_a_symlink_under_the_roots_is_read(roots: dict[str, Path]) -> None:
    _save_to_disk(roots["root"] / "ds", [f"{i}+1=" for i in range(5)])
    (roots["root"] / "link").symlink_to(roots["root"] / "ds")
    dataset = {"hf_disk": {"path": str(roots["root"] / "link")}, "eval_size": 1}
    _accepted(spec_json(roots["root"] / "model", dataset=dataset), [roots["root"]])


def test_the_roots_setting_reads_a_json_list_and_defaults_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RolloutConfig().data_roots == []
    monkeypatch.setenv("RLFLEET_ROLLOUT_DATA_ROOTS", '["/data", "/models"]')
    assert RolloutConfig().data_roots == [Path("/data"), Path("/models")]


def _rows_spec(path: Path, prompt_column: str) -> DatasetSpec:
    ds = resolve(RunSpec(dataset=DatasetSpec(eval_size=1, seed=5))).dataset
    ds.jsonl.path, ds.jsonl.prompt_column, ds.jsonl.answer_column = str(path), prompt_column, "user"
    return ds


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"password": "s3cr3t", "user": "admin"}, "got a mapping of 2 keys"),
        (["s3cr3t", "admin"], "got a list of 2 items"),
        (12345, "got a number"),
        (None, "got null"),
        (True, "got true or false"),
        ("   \t s3cr3t"[:4], "got a blank string of 4 characters"),
    ],
)
def test_a_bad_rows_error_names_the_values_kind_never_its_content(tmp_path: Path, value: Any, said: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"db": value, "user": "admin"}) + "\n")
    with pytest.raises(InvalidInput) as refused:
        load_dataset(_rows_spec(path, "db"), 10)
    message = str(refused.value)
    assert f"line 1: column 'db' must be a non-empty string, {said}" in message, message
    assert "s3cr3t" not in message and "12345" not in message, message


def test_a_missing_prompt_column_is_said_to_be_missing(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"user": "admin"}) + "\n")
    with pytest.raises(InvalidInput, match=r"line 1: column 'db' is missing"):
        load_dataset(_rows_spec(path, "db"), 10)


def test_a_body_nested_too_deeply_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match=r"^body: nested too deeply"):
        parse_run_spec(DEEP_BODY)


def test_a_body_nested_too_deeply_gets_a_400_not_a_500() -> None:
    metrics = RolloutMetrics()
    guard = ApiTokenGuard(None, metrics.registry, "rollout")
    app = build_app(_core([]), metrics, aioredis.Redis(), guard, watch_keepalive_s=15.0)
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/v1/runs", content=DEEP_BODY, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"].startswith("body: nested too deeply"), answer.text


def test_a_submit_nested_too_deeply_over_grpc_is_invalid_argument() -> None:
    """gRPC needs nothing of its own: protobuf's decoder stops at 100 levels, which the servicer answers as a malformed
    request (a Struct of 300 levels in a reward's params here)."""
    params = Struct()
    level = params
    for _ in range(300):
        level = level.fields["a"].struct_value
    request = SubmitRunRequest(validate_only=True)
    request.spec.reward.terms.add(function="arith_exact").params.CopyFrom(params)

    async def scenario() -> grpc.StatusCode:
        metrics = RolloutMetrics()
        guard = ApiTokenGuard(None, metrics.registry, "rollout")
        server, port = build_grpc_server(_core([]), "127.0.0.1", 0, guard, keepalive_s=30)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                submit = channel.unary_unary("/rlfleet.v1.Runs/Submit", request_serializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await submit(request.SerializeToString(), timeout=10)
                assert "malformed request" in (refused.value.details() or "")
                return refused.value.code()
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_eval_path_is_evaluated_on_every_row_up_to_the_default_unless_eval_size_says(
    roots: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eval file of 3 rows with eval_size unset (200 by default) was refused as holding fewer rows than asked."""
    root = roots["root"]
    core = _core([root])

    async def hub_agrees(spec: RunSpec) -> None:
        return None

    monkeypatch.setattr(core, "_check_reward", hub_agrees)
    dataset: dict[str, Any] = {
        "jsonl": {"path": str(root / "rows.jsonl"), "eval_path": str(_jsonl(root / "e.jsonl", 3))}
    }

    def submitted() -> RunSpec:
        spec = json_format.ParseDict(spec_json(root / "model", dataset=dataset), RunSpec())
        return asyncio.run(core.submit(spec, validate_only=True)).spec

    assert submitted().dataset.eval_size == 3  # stored resolved: the trainer and a resumed run read as many
    dataset["eval_size"] = 2
    assert submitted().dataset.eval_size == 2
    dataset["eval_size"] = 4
    with pytest.raises(InvalidInput, match=r"^dataset\.eval_size: 4 held-out rows, but .* holds 3 usable rows"):
        submitted()
