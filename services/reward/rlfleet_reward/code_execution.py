"""`code`: run the response's Python against the label's test cases, each in a fresh sandbox.

The label is JSON: `{"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, {"check": "assert add(1, 2) == 3"}]}`.
A `stdout` test feeds `stdin` to the program and passes when it exits 0 and prints `stdout`
(compared line by line, trailing whitespace and trailing blank lines ignored). A `check` test runs
the program followed by the check's code and passes when that exits 0. The program is the last
fenced code block of the response (```python ... ```), or the whole response when it has none.

The score is the fraction of tests passed (or 1.0/0.0 without `partial_credit`). Every failure is
counted under its reason, so a hostile or broken program is an OK item scored 0 whose components say
why: `code/passed`, `code/tests`, and `code/time_limit` (wall clock or CPU), `code/memory_limit`,
`code/output_limit` (file size), `code/runtime_error` (a non-zero exit: an exception, or a refused
operation such as opening a socket or writing outside its directory), `code/wrong_answer`.
See `sandbox.py` for what contains the program.
"""

from __future__ import annotations

import json
import math
import re
import signal
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored
from rlfleet_reward.sandbox import RunResult, SandboxLimits, probe_isolation, run_python

_FENCED = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_MB = 1 << 20


class CodeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_seconds: float = Field(default=5.0, gt=0, le=60, description="Wall-clock limit of one test run.")
    cpu_seconds: int | None = Field(default=None, ge=1, le=60, description="CPU limit of a run (default: timeout).")
    memory_mb: int = Field(default=512, ge=64, le=16384, description="Address-space limit of each process.")
    file_size_mb: int = Field(default=16, ge=0, le=1024, description="Largest file a run may write.")
    max_processes: int = Field(default=32, ge=2, le=1024, description="Processes (and threads) a run may have.")
    partial_credit: bool = Field(default=True, description="Score the fraction passed; else 1.0 only if all pass.")


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
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def verdict(result: RunResult, test: CodeCase) -> str:
    """`passed` or the reason the run failed."""
    if result.timed_out or result.exit_code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "time_limit"
    if result.exit_code == 128 + signal.SIGXFSZ:
        return "output_limit"
    if result.exit_code != 0:
        return "memory_limit" if "MemoryError" in result.stderr[-2000:] else "runtime_error"
    if test.stdout is not None and _lines(result.stdout) != _lines(test.stdout):
        return "wrong_answer"
    return "passed"


def score_code(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    try:
        label = CodeLabel.model_validate(json.loads(sample.label))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f'the label is not {{"tests": [...]}} JSON: {exc}'[:500]) from None
    isolation = probe_isolation()
    limits = SandboxLimits(
        wall_seconds=params["timeout_seconds"],
        cpu_seconds=params["cpu_seconds"] or math.ceil(params["timeout_seconds"]),
        memory_bytes=params["memory_mb"] * _MB,
        file_size_bytes=params["file_size_mb"] * _MB,
        max_processes=params["max_processes"],
    )
    program = extract_program(sample.response)
    verdicts: Counter[str] = Counter()
    for test in label.tests:
        source = program if test.check is None else f"{program}\n\n{test.check}\n"
        verdicts[verdict(run_python(source, test.stdin, limits, isolation), test)] += 1
        if not params["partial_credit"] and verdicts["passed"] < sum(verdicts.values()):
            break  # the score is 0 whatever the remaining tests do
    total = len(label.tests)
    passed = verdicts.pop("passed", 0)
    score = passed / total if params["partial_credit"] else float(passed == total)
    return Scored(score=score, parts={"passed": float(passed), "tests": float(total), **verdicts})


CODE = RewardFunction(
    fn=score_code,
    inputs=frozenset({"response", "label"}),
    description="fraction of the label's test cases the response's Python passes, each run in a sandbox",
    params=CodeParams,
)
