"""`rlfleet show RUN_ID`: one run in full, as `runs` and `watch` have no room for it: its header (state, algorithm,
model, step, weight version, when it was created, started and finished), progress counters, every evaluation,
the trainer's last metrics, and its stall or error; `--spec` adds the resolved spec as YAML, `--json` prints the
run as the API's JSON instead, for scripts.

The Runs API is found as `watch` finds it (cli/runs.py). Exit status: 0 when the run was shown, 2 on an error
(a bad run id, nothing answering, no such run: the error names the run id and the address asked).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp

from rlfleet.cli.runs import add_api_options, client_for, no_such_run, state_name
from rlfleet.runs_client import RunNotFound, spec_yaml
from rlfleet.v1.runs_pb2 import Run

LABEL_WIDTH = 11
"""Width of the header's labels, the longest ("algorithm") and two spaces."""
SPEC_HEADING = "spec (resolved: every default filled in; `rlfleet submit` takes what follows as a spec file)"


def register(areas: argparse._SubParsersAction) -> None:
    show = areas.add_parser(
        "show",
        help="show one run in full: state, timestamps, progress, every evaluation, last metrics, error",
        description="Show one run in full: its state, model, step and weight version, when it was created, started "
        "and finished, its progress counters, every evaluation, the trainer's last metrics, and why it failed or "
        "stalled. Exits with 0 when it showed the run, whatever the run's state, and 2 on an error.",
    )
    show.add_argument("run_id")
    form = show.add_mutually_exclusive_group()
    form.add_argument("--spec", action="store_true", help="add the run's resolved spec, as YAML, at the end")
    form.add_argument("--json", action="store_true", help="print the run as the Runs API's JSON instead")
    add_api_options(show)
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    client = client_for(args)
    try:
        if args.json:  # as the API answered, fields this CLI does not know included
            print(json.dumps(client.get_json(args.run_id), indent=2))
            return 0
        run = client.get(args.run_id)
    except RunNotFound:
        raise no_such_run(args, client.base_url) from None
    print(summary(run, datetime.now(UTC)), end="")
    if args.spec:
        print(f"\n{SPEC_HEADING}\n{spec_yaml(run.spec)}", end="")
    return 0


def summary(run: Run, now: datetime) -> str:
    """The run as sections of text, each line ending in a newline, a blank line between sections; a section with
    nothing to say is left out. `now` (timezone-aware) measures how long a queued or running run has been so."""
    sections = [header(run, now), progress(run), evaluations(run), metrics(run)]
    if run.error:
        sections.append(["error", *(f"  {line}" for line in run.error.splitlines())])
    return "\n".join("".join(f"{line}\n" for line in section) for section in sections if section)


def header(run: Run, now: datetime) -> list[str]:
    p = run.progress
    fields = [
        ("run", run.id),
        ("name", run.spec.name),
        ("state", state_name(run)),
        ("stalled", run.stalled),
        ("algorithm", run.spec.algorithm.name),
        ("model", run.spec.model.path),
        ("step", f"{p.step}/{p.total_steps}"),
        ("weights", f"v{p.weight_version}"),
        *timestamps(run, now),
    ]
    return [f"{label:<{LABEL_WIDTH}}{value}" for label, value in fields if value]


def timestamps(run: Run, now: datetime) -> list[tuple[str, str]]:
    """When the run was created, started and finished, each with how long the stage before it took (for a queued
    or running run: has taken so far)."""
    created = moment(run.created_at) if run.HasField("created_at") else None
    started = moment(run.started_at) if run.HasField("started_at") else None
    finished = moment(run.finished_at) if run.HasField("finished_at") else None
    notes: dict[str, list[str]] = {"created": [], "started": [], "finished": []}
    if created and not started and not finished:
        notes["created"].append(f"queued for {duration(now - created)}")
    if created and started:
        notes["started"].append(f"{duration(started - created)} after it was created")
    if started and not finished:
        notes["started"].append(f"running for {duration(now - started)}")
    if started and finished:
        notes["finished"].append(f"ran {duration(finished - started)}")
    elif created and finished:
        notes["finished"].append(f"{duration(finished - created)} after it was created; it never started")
    moments = {"created": created, "started": started, "finished": finished}
    return [
        (label, shown(at) + (f"  ({'; '.join(notes[label])})" if notes[label] else ""))
        for label, at in moments.items()
        if at
    ]


def progress(run: Run) -> list[str]:
    """The run's counters, once it has taken a prompt (before that, all are 0); those that count what only some
    specs do (down-weighted stale groups, skipped dataset rows) only when not 0."""
    p = run.progress
    if not (p.prompts_consumed or p.groups_produced):
        return []
    by_count = sorted(p.filtered_by_reason.items(), key=lambda item: (-item[1], item[0]))  # the main reason first
    reasons = ", ".join(f"{reason} {count}" for reason, count in by_count if count)
    counters = [
        ("mean reward", f"{p.mean_reward:.3f} (of the last step's samples)"),
        ("prompts consumed", f"{p.prompts_consumed} (epoch {p.epoch})"),
        ("groups produced", str(p.groups_produced)),
        ("groups trained", str(p.groups_trained)),
        ("groups filtered", f"{p.groups_filtered} ({reasons})" if reasons else str(p.groups_filtered)),
        ("groups downweighted", str(p.groups_downweighted) if p.groups_downweighted else ""),
        ("rows skipped", str(p.rows_skipped) if p.rows_skipped else ""),
    ]
    present = [(label, value) for label, value in counters if value]
    width = max(len(label) for label, _ in present) + 2
    return ["progress", *(f"  {label:<{width}}{value}" for label, value in present)]


def evaluations(run: Run) -> list[str]:
    """Every evaluation, oldest first, as a table."""
    if not run.evals:
        return []
    rows = [
        [
            str(e.step),
            f"v{e.weight_version}",
            str(e.size),
            str(e.k),
            f"{e.accuracy:.3f}",
            f"{e.pass_at_k:.3f}",
            f"{e.mean_length:.1f}",
            f"{e.truncation_rate:.3f}",
            f"{e.failed}/{e.size * e.k}" if e.failed else "-",
        ]
        for e in run.evals
    ]
    head = ["STEP", "WEIGHTS", "SIZE", "K", "ACCURACY", "PASS@K", "MEAN LEN", "TRUNCATED", "FAILED"]
    # Without the note, a fleet failing to answer would read as a model that got worse.
    note = "; the accuracy counts failed samples as wrong" if any(e.failed for e in run.evals) else ""
    if too_long := max(e.prompts_too_long for e in run.evals):
        # SIZE would otherwise read as the whole held-out split.
        note += f"; SIZE leaves out up to {too_long} held-out prompts too long to evaluate, as training skips them"
    return [f"evaluations ({len(rows)}{note})", *table(head, rows)]


def metrics(run: Run) -> list[str]:
    """The trainer's metrics of its last step, by name."""
    if not run.metrics:
        return []
    width = max(len(name) for name in run.metrics) + 2
    return [
        "trainer metrics (last step)",
        *(f"  {name:<{width}}{value:.6g}" for name, value in sorted(run.metrics.items())),
    ]


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """`head` and `rows` indented by two spaces, each column right-aligned to its widest cell."""
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows, strict=True)]
    return [
        "  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in (head, *rows)
    ]


def moment(timestamp: Timestamp) -> datetime:
    return timestamp.ToDatetime(tzinfo=UTC)


def shown(at: datetime) -> str:
    """`at` in the local time zone, to the second, naming the zone."""
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def duration(span: timedelta) -> str:
    """`span` as a person reads it: `0.4 s`, `42 s`, `14 min 35 s`, `3 h 05 min`, `2 d 4 h`. A negative span (the
    client's clock behind the orchestrator's) is 0."""
    seconds = max(0.0, span.total_seconds())
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"
