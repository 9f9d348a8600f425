"""`code`: run the response's Python against the label's test cases, each in a fresh sandbox.

The label is JSON: `{"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, {"check": "assert add(1, 2) == 3"}]}`.
A `stdout` test feeds `stdin` to the program and passes when it exits 0 and prints `stdout`
(compared line by line, trailing whitespace and trailing blank lines ignored). A `check` test runs
the program followed by the check's code and passes when the check ran to its end: the run ends with a
status drawn anew for each test and kept out of the program's reach (not in its source, its directory or its
arguments), so a program that exits before the check (`sys.exit(0)`, `os._exit(0)`, or the status read from its own
file) fails it, as `check_skipped`, instead of passing every check unasked. The check runs in the program's own
process, so it is a test, not a proof: a program set on it can still defeat one (an object equal to anything, or
the status found by walking the interpreter's frames). The program is the last fenced block of the response
tagged Python (```python, ```py, ```python3), else its last untagged one (```), else the whole response.

The caller's limits (`memory_mb`, `max_processes`, `file_size_mb`, `disk_mb`) are bounded by the hub's caps
(`RLFLEET_REWARD_CODE_MAX_*`, see `config.SpecCaps`): a spec asking past one is refused when validated. Where the
hub has a memory budget (a container's limit), each test is also held to its worker's share of it (see
`sandbox_memory`): a test whose processes together pass the share counts as `code/memory_limit`, and a spec whose
`memory_mb` alone is past the share is refused when validated, naming both figures (an item scored without that
validation is an ERROR naming them).

The score is the fraction of tests passed (or 1.0/0.0 without `partial_credit`). Every failure is
counted under its reason, so a hostile or broken program is an OK item scored 0 whose components say
why: `code/passed`, `code/tests`, and `code/time_limit` (wall clock or CPU), `code/memory_limit`,
`code/output_limit` (a file past `file_size_mb`, or the run's directory past `disk_mb` or 10,000 entries),
`code/runtime_error` (a non-zero exit: an exception, or a refused operation such as opening a socket or
writing outside its directory), `code/wrong_answer`, `code/check_skipped`. A test that runs out of time ends
the item: the tests after it are not run and count as `code/time_limit` too, so a program that hangs is scored
(0) within the item's time limit rather than making the item a TIMEOUT, which training would drop.
See `sandbox.py` for what contains the program.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import signal
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rlfleet_reward.config import spec_caps
from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored
from rlfleet_reward.sandbox import RunResult, SandboxLimits, probe_isolation, run_python
from rlfleet_reward.sandbox_memory import PARAMS_CONTEXT_KEY, WorkerMemory, installed

# A fenced block with its info string (```python, ```bash, ``` alone): each fence pairs with the next, whatever
# the language, so a shell block before the program cannot shift which text reads as code.
_FENCED = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
_MB = 1 << 20
_MIN_STDOUT_READ = _MB
_CAPS = {
    "memory_mb": "code_max_memory_mb",
    "max_processes": "code_max_processes",
    "file_size_mb": "code_max_file_size_mb",
    "disk_mb": "code_max_disk_mb",
}


class CodeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="Wall-clock limit of one test run.")
    cpu_seconds: int | None = Field(default=None, ge=1, le=60, description="CPU limit of a run (default: timeout).")
    memory_mb: int = Field(
        default=512, validate_default=True, ge=64, le=16384, description="Address-space limit of each process."
    )
    file_size_mb: int = Field(
        default=16, validate_default=True, ge=1, le=1024, description="Largest file a run may write."
    )
    disk_mb: int = Field(
        default=64,
        validate_default=True,
        ge=1,
        le=65536,
        description="What a run's directory may hold (all its files, main.py too); past it the run is killed.",
    )
    max_processes: int = Field(
        default=32, validate_default=True, ge=2, le=1024, description="Processes (and threads) a run may have."
    )
    partial_credit: bool = Field(default=True, description="Score the fraction passed; else 1.0 only if all pass.")

    # Defaults are checked too (validate_default): a hub that caps below them asks specs to name a lower value.
    @field_validator("memory_mb", "max_processes", "file_size_mb", "disk_mb")
    @classmethod
    def _within_the_hubs_cap(cls, value: int, info: ValidationInfo) -> int:
        setting = _CAPS[info.field_name or ""]
        cap = getattr(spec_caps(), setting)
        if value > cap:
            raise ValueError(f"{value} is past the hub's cap of {cap} (RLFLEET_REWARD_{setting.upper()})")
        return value

    # The hub's budget comes in the validation context: the model alone cannot know how many workers split it.
    @field_validator("memory_mb")
    @classmethod
    def _within_a_workers_share(cls, value: int, info: ValidationInfo) -> int:
        budget = (info.context or {}).get(PARAMS_CONTEXT_KEY)
        if budget is not None:
            budget.check_memory_mb(value)
        return value

    @model_validator(mode="after")
    def _total_within_the_hubs_cap(self) -> CodeParams:
        # RLIMIT_AS binds each process, so one test may hold memory_mb in every process it starts.
        total, cap = self.memory_mb * self.max_processes, spec_caps().code_max_total_memory_mb
        if total > cap:
            raise ValueError(
                f"memory_mb x max_processes = {total} MiB is past the hub's cap of {cap} MiB for one test "
                "(RLFLEET_REWARD_CODE_MAX_TOTAL_MEMORY_MB); lower either"
            )
        return self


class CodeCase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stdin: str = ""
    stdout: str | None = None
    check: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> CodeCase:
        if (self.stdout is None) == (self.check is None):
            raise ValueError("a test has either `stdout` (expected output) or `check` (code to run), not both")
        return self


class CodeLabel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tests: list[CodeCase] = Field(min_length=1)


def extract_program(response: str) -> str:
    """The last block tagged Python; without one, the last untagged block; without either, the whole response.
    An untagged block after the program is most often its output or a shell session (```\n3\n```), not code."""
    blocks = [(info.strip().split(" ")[0].lower(), code) for info, code in _FENCED.findall(response)]
    tagged = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    untagged = [code for tag, code in blocks if not tag]
    return (tagged or untagged or [response])[-1]


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _stdout_read(test: CodeCase) -> int:
    """How much of a run's stdout the hub reads: what the comparison needs (twice the expected output, for line ends
    and spaces it ignores, and 4 KiB more; at least 1 MiB, for lines padded with spaces: 20,000 one-digit lines
    printed 8 wide read as cut, and wrong, in twice their expected 40 KB), so a program printing up to its
    file-size limit costs the hub no more than that."""
    return 0 if test.stdout is None else max(2 * len(test.stdout.encode()) + 4096, _MIN_STDOUT_READ)


def verdict(result: RunResult, test: CodeCase, check_exit: int = 0) -> str:
    """`passed` or the reason the run failed; a check test's run passes by ending with `check_exit`."""
    # Before the time limit: the disk watchdog ends a run with SIGKILL.
    if result.disk_exceeded or result.exit_code == 128 + signal.SIGXFSZ:
        return "output_limit"
    # Before the time limit too: the memory watchdog ends a run with SIGKILL.
    if result.memory_exceeded:
        return "memory_limit"
    if result.timed_out or result.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "time_limit"
    if result.exit_code != (check_exit if test.check is not None else 0):
        if result.exit_code == 0:
            return "check_skipped"  # it ended before the check ran
        return "memory_limit" if "MemoryError" in result.stderr[-2000:] else "runtime_error"
    if test.stdout is not None and (result.stdout_truncated or _lines(result.stdout) != _lines(test.stdout)):
        return "wrong_answer"
    return "passed"


def _group_memory_bound(params: Mapping[str, Any], memory: WorkerMemory | None) -> int | None:
    """What the test's processes may hold together: None when the kernel's per-process bound keeps them within the
    worker's share (or the hub has no budget), else the share, which the sandbox's watchdog enforces. Raises when
    even one process may pass the share (params the hub's validation would have refused): the run could hold more
    than the hub has for it."""
    if memory is None or memory.budget is None:
        return None
    memory.budget.check_memory_mb(params["memory_mb"])
    share = memory.budget.share_mb * _MB
    return None if params["memory_mb"] * params["max_processes"] * _MB <= share else share


def score_code(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    try:
        label = CodeLabel.model_validate(json.loads(sample.label))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f'the label is not {{"tests": [...]}} JSON: {exc}'[:500]) from None
    memory = installed()
    limits = SandboxLimits(
        wall_seconds=params["timeout_seconds"],
        cpu_seconds=params["cpu_seconds"] or math.ceil(params["timeout_seconds"]),
        memory_bytes=params["memory_mb"] * _MB,
        file_size_bytes=params["file_size_mb"] * _MB,
        disk_bytes=params["disk_mb"] * _MB,
        max_processes=params["max_processes"],
        group_memory_bytes=_group_memory_bound(params, memory),
    )
    isolation = probe_isolation()
    program = extract_program(sample.response)
    verdicts: Counter[str] = Counter()
    for test in label.tests:
        source, check_exit = program, 0
        if test.check is not None:
            check_exit = 3 + secrets.randbelow(100)  # 3-102: no status a program or Python ends with unasked
            source = f"{program}\n\n{test.check}\n"
        held = limits.memory_bytes * limits.max_processes
        if limits.group_memory_bytes is not None:
            held = min(held, limits.group_memory_bytes)
        if memory is not None:
            memory.hold(held)
        try:
            result = run_python(
                source, test.stdin, limits, isolation, max_stdout_bytes=_stdout_read(test), end_status=check_exit
            )
        finally:
            if memory is not None:
                memory.hold(0)
        verdicts[verdict(result, test, check_exit)] += 1
        if not params["partial_credit"] and verdicts["passed"] < sum(verdicts.values()):
            break  # the score is 0 whatever the remaining tests do
        if verdicts["time_limit"]:
            # A program that hangs would hang on every test, and their timeouts together pass the item's time
            # limit: an item TIMEOUT, dropped from training, where a hang should be an answer scored 0.
            verdicts["time_limit"] += len(label.tests) - sum(verdicts.values())
            break
    total = len(label.tests)
    passed = verdicts.pop("passed", 0)
    score = passed / total if params["partial_credit"] else float(passed == total)
    return Scored(score=score, parts={"passed": float(passed), "tests": float(total), **verdicts})


CODE = RewardFunction(
    fn=score_code,
    inputs=frozenset({"response", "label"}),
    description="fraction of the label's test cases the response's Python passes, each run in a sandbox",
    params=CodeParams,
    timeout_score=0.0,
)
