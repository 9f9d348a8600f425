"""`rlfleet show RUN_ID` against a scripted Runs API (httpx's mock transport) answering as the orchestrator does
(its JSON and its error bodies): a succeeded run in full (every evaluation aligned, however many), a failed run
with its error, a queued one without the sections it has nothing for, a run the orchestrator does not hold
(named with the address asked), `--json` as the API's JSON, and `--spec` as a spec file `submit --dry-run`
takes back."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf import json_format

from rlfleet.cli import runs, show
from rlfleet.cli.main import build_parser, main
from rlfleet.cli.show import duration, summary
from rlfleet.errors import InvalidInput, NotFound
from rlfleet.http_errors import error_body
from rlfleet.local_spec_check import check_spec_here
from rlfleet.processes import free_port
from rlfleet.run_spec import resolve
from rlfleet.runs_client import RunsClient, load_spec_file
from rlfleet.v1.runs_pb2 import EvalResult, Run, RunProgress, RunSpec, RunState
from rlfleet_rollout.http_app import to_json

API = "http://rollout:8000"
"""The scripted Runs API's address."""
EXAMPLE_SPEC = Path(__file__).resolve().parents[1] / "examples" / "runs" / "arith-grpo.yaml"
CREATED = datetime(2025, 5, 1, 12, 0, 3, tzinfo=UTC)
ERROR = (
    "step 3 could not fill its groups: 256 prompts consumed (rollout.max_prompts_per_step), 0 groups passed the filters"
)


def resolved_spec() -> RunSpec:
    """The example spec as the orchestrator stores it: every default filled in, a seed past int64 (protobuf JSON
    carries it as a string)."""
    spec = load_spec_file(EXAMPLE_SPEC)
    spec.trainer.seed = 2**64 - 1
    return resolve(spec)


def at(seconds: float) -> datetime:
    return CREATED + timedelta(seconds=seconds)


def stamped(run: Run, started_s: float | None = None, finished_s: float | None = None) -> Run:
    run.created_at.FromDatetime(CREATED)
    if started_s is not None:
        run.started_at.FromDatetime(at(started_s))
    if finished_s is not None:
        run.finished_at.FromDatetime(at(finished_s))
    return run


def succeeded_run(evals: int = 3) -> Run:
    run = Run(id="run-ok", spec=resolved_spec(), state=RunState.RUN_STATE_SUCCEEDED)
    run.progress.CopyFrom(
        RunProgress(
            step=40,
            total_steps=40,
            weight_version=40,
            groups_produced=1350,
            groups_trained=1280,
            groups_filtered=70,
            mean_reward=0.6131,
            prompts_consumed=1350,
        )
    )
    run.progress.filtered_by_reason.update({"zero_variance": 61, "surplus": 9})
    run.metrics.update({"loss": 0.01234, "kl": 0.00041, "lr": 5e-05, "samples": 256.0})
    for i in range(evals):
        step = i * 40 // max(1, evals - 1)
        run.evals.append(
            EvalResult(
                step=step,
                weight_version=step,
                size=200,
                k=1,
                accuracy=0.12 + 0.005 * step,
                pass_at_k=0.12 + 0.005 * step,
                mean_length=3.25,
                truncation_rate=0.01,
                failed=12 if i == 1 else 0,
            )
        )
    return stamped(run, started_s=2.25, finished_s=875)


def failed_run() -> Run:
    run = Run(id="run-failed", spec=resolved_spec(), state=RunState.RUN_STATE_FAILED, error=ERROR)
    run.progress.CopyFrom(
        RunProgress(
            step=2, total_steps=40, weight_version=2, groups_produced=300, groups_trained=64, prompts_consumed=300
        )
    )
    run.evals.append(EvalResult(step=0, size=200, k=4, accuracy=0.125, pass_at_k=0.25, mean_length=6, failed=0))
    return stamped(run, started_s=2, finished_s=155)


def queued_run() -> Run:
    run = Run(id="run-queued", spec=resolved_spec(), state=RunState.RUN_STATE_QUEUED)
    run.progress.total_steps = 40
    return stamped(run)


RUNS = {run.id: run for run in (succeeded_run(), failed_run(), queued_run())}
RUNS["run-long"] = succeeded_run(evals=125)
RUNS["run-long"].id = "run-long"


def answer(request: httpx.Request) -> httpx.Response:
    """The orchestrator's answers to the requests `show` and `submit --dry-run` make."""
    path = request.url.path
    if request.method == "GET" and path.startswith("/v1/runs/"):
        run_id = path.removeprefix("/v1/runs/")
        if run_id not in RUNS:
            return httpx.Response(404, json=error_body(NotFound(f"run {run_id!r} not found")))
        return httpx.Response(200, json=to_json(RUNS[run_id]))
    if request.method == "POST" and path == "/v1/runs" and request.url.params.get("validate_only") == "true":
        spec = json_format.ParseDict(json.loads(request.content), RunSpec())
        try:
            check_spec_here(spec)  # the checks of a submit that need none of the fleet's services
        except InvalidInput as exc:
            return httpx.Response(400, json=error_body(exc))
        resolved = resolve(spec)
        run = Run(
            spec=resolved, state=RunState.RUN_STATE_QUEUED, progress=RunProgress(total_steps=resolved.schedule.steps)
        )
        return httpx.Response(200, json=to_json(run))
    return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture(autouse=True)
def scripted_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command's client of API talks to `answer`; the address is found as ever (--api, the variable, the
    state dir)."""
    monkeypatch.delenv("RLFLEET_API_URL", raising=False)

    def scripted(real: Callable[..., RunsClient]) -> Callable[..., RunsClient]:
        def client_for(args: Any) -> RunsClient:
            client = real(args)
            if client.base_url == API:
                client.http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(answer))
            return client

        return client_for

    monkeypatch.setattr(show, "client_for", scripted(show.client_for))
    monkeypatch.setattr(runs, "client_for", scripted(runs.client_for))


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Times are shown in the local zone: UTC here, whatever the machine's."""
    with monkeypatch.context() as patch:
        patch.setenv("TZ", "UTC")
        time.tzset()
        yield
    time.tzset()


def shown(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["show", *argv, "--api", API])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_succeeded_run_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = shown(["run-ok"], capsys)
    assert (code, err) == (0, "")
    assert out == (
        "run        run-ok\n"
        "name       arith-grpo\n"
        "state      succeeded\n"
        "algorithm  grpo\n"
        "model      .rlfleet/demo/sft\n"
        "step       40/40\n"
        "weights    v40\n"
        "created    2025-05-01 12:00:03 UTC\n"
        "started    2025-05-01 12:00:05 UTC  (2.2 s after it was created)\n"
        "finished   2025-05-01 12:14:38 UTC  (ran 14 min 33 s)\n"
        "\n"
        "progress\n"
        "  mean reward       0.613 (of the last step's samples)\n"
        "  prompts consumed  1350 (epoch 0)\n"
        "  groups produced   1350\n"
        "  groups trained    1280\n"
        "  groups filtered   70 (zero_variance 61, surplus 9)\n"
        "\n"
        "evaluations (3; the accuracy counts failed samples as wrong)\n"
        "  STEP  WEIGHTS  SIZE  K  ACCURACY  PASS@K  MEAN LEN  TRUNCATED  FAILED\n"
        "     0       v0   200  1     0.120   0.120       3.2      0.010       -\n"
        "    20      v20   200  1     0.220   0.220       3.2      0.010  12/200\n"
        "    40      v40   200  1     0.320   0.320       3.2      0.010       -\n"
        "\n"
        "trainer metrics (last step)\n"
        "  kl       0.00041\n"
        "  loss     0.01234\n"
        "  lr       5e-05\n"
        "  samples  256\n"
    )


def test_every_evaluation_of_a_long_run_is_shown_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = shown(["run-long"], capsys)
    assert code == 0
    lines = out.splitlines()
    head = lines.index("evaluations (125; the accuracy counts failed samples as wrong)")
    table = lines[head + 1 : head + 127]
    assert [row.split()[0] for row in table[1:]] == [str(e.step) for e in RUNS["run-long"].evals]
    assert len({len(row) for row in table}) == 1, "every row as wide as the header"
    for column_end in (len("  STEP"), len("  STEP  WEIGHTS")):  # right-aligned: each column ends where its head does
        assert all(row[column_end - 1] != " " and row[column_end] == " " for row in table), column_end


def test_a_failed_run_ends_with_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = shown(["run-failed"], capsys)
    assert (code, err) == (0, ""), "the run was shown: its failure is the run's, not the command's"
    assert "state      failed\n" in out
    assert "finished   2025-05-01 12:02:38 UTC  (ran 2 min 33 s)\n" in out
    assert out.endswith(f"\nerror\n  {ERROR}\n")
    assert "evaluations (1)\n  STEP  WEIGHTS  SIZE  K  ACCURACY  PASS@K" in out
    assert "     0       v0   200  4     0.125   0.250       6.0      0.000       -\n" in out
    assert "trainer metrics" not in out, "no section for what the run does not have"


def test_a_queued_run_says_how_long_it_has_waited_and_nothing_it_has_not_done() -> None:
    out = summary(queued_run(), now=at(3 * 3600 + 125))
    assert out == (
        "run        run-queued\n"
        "name       arith-grpo\n"
        "state      queued\n"
        "algorithm  grpo\n"
        "model      .rlfleet/demo/sft\n"
        "step       0/40\n"
        "weights    v0\n"
        "created    2025-05-01 12:00:03 UTC  (queued for 3 h 02 min)\n"
    )


def test_a_stalled_run_says_why_and_how_long_it_has_run() -> None:
    run = stamped(Run(id="run-s", state=RunState.RUN_STATE_RUNNING, stalled="no progress for 15 s"), started_s=1)
    run.progress.CopyFrom(RunProgress(step=2, total_steps=6, prompts_consumed=64, groups_produced=64, rows_skipped=3))
    lines = summary(run, now=at(61)).splitlines()
    assert lines[:2] == ["run        run-s", "state      stalled"]
    assert "stalled    no progress for 15 s" in lines
    assert "started    2025-05-01 12:00:04 UTC  (1.0 s after it was created; running for 1 min 00 s)" in lines
    assert "  rows skipped      3" in lines and not any("downweighted" in line for line in lines)


def test_a_run_the_orchestrator_does_not_hold_is_named_with_the_address_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = shown(["run-none"], capsys)
    assert (code, out) == (2, "")
    assert err == (
        f"rlfleet: error: no run 'run-none' at {API} (the address came from --api); `rlfleet runs --api {API}` "
        "lists the runs it holds\n"
    )


def test_nothing_answering_is_an_error_naming_the_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nothing_there = f"http://127.0.0.1:{free_port()}"
    code = main(["show", "run-ok", "--api", nothing_there, "--state-dir", str(tmp_path), "--timeout", "5"])
    assert code == 2
    assert f"the orchestrator at {nothing_there} did not answer" in capsys.readouterr().err


def test_json_is_the_apis_json_of_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = shown(["run-ok", "--json"], capsys)
    assert code == 0
    printed = json.loads(out)
    assert printed == to_json(RUNS["run-ok"])
    assert json_format.ParseDict(printed, Run()) == RUNS["run-ok"]


def test_spec_adds_a_spec_file_that_submit_dry_run_takes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = shown(["run-failed", "--spec"], capsys)
    assert code == 0
    summary_part, spec_part = out.split(f"\n{show.SPEC_HEADING}\n")
    assert summary_part.endswith(f"error\n  {ERROR}\n"), "the spec comes after the summary"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec_part)
    assert load_spec_file(spec_file) == RUNS["run-failed"].spec
    assert f"seed: {2**64 - 1}\n" in spec_part, "a uint64 as a number, not its protobuf JSON string"
    assert main(["submit", str(spec_file), "--dry-run", "--api", API]) == 0
    out = capsys.readouterr().out
    assert out.endswith(
        f"# {spec_file} is valid (the spec above is it with every default filled in); nothing was submitted\n"
    )
    assert out.removesuffix(out.splitlines()[-1] + "\n") == spec_part, "already resolved: the dry run changes nothing"


def test_spec_and_json_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as usage:
        main(["show", "run-ok", "--spec", "--json"])
    assert usage.value.code == 2
    assert "argument --json: not allowed with argument --spec" in capsys.readouterr().err


def test_rlfleet_help_lists_show_and_show_takes_the_watch_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "show      show one run in full" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["show", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--api API", "--state-dir STATE_DIR", "--timeout TIMEOUT", "--api-token-file API_TOKEN_FILE"):
        assert option in text
    assert "seconds to wait for connecting and for each answer (default 30.0)" in text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.42, "0.4 s"),
        (42, "42 s"),
        (873, "14 min 33 s"),
        (3 * 3600 + 300, "3 h 05 min"),
        (2 * 86400 + 4 * 3600, "2 d 4 h"),
        (-5, "0.0 s"),
    ],
)
def test_durations_read_as_a_person_says_them(seconds: float, text: str) -> None:
    assert duration(timedelta(seconds=seconds)) == text


def test_held_out_prompts_left_out_as_too_long_are_named_beside_the_size() -> None:
    """SIZE counts the prompts evaluated; without the note, 180 of a held-out split of 200 read as the whole split."""
    run = succeeded_run(evals=2)
    run.evals[1].size, run.evals[1].prompts_too_long = 180, 20
    assert (
        "evaluations (2; the accuracy counts failed samples as wrong; SIZE leaves out up to 20 held-out prompts too "
        "long to evaluate, as training skips them)\n" in summary(run, now=at(900))
    )
