"""The memory the hub's sandboxed `code` tests may hold together, and each worker's share of it.

A `code` test runs under RLIMIT_AS of `memory_mb` in each of up to `max_processes` processes: with the default
params one test may hold 512 MiB x 32 = 16 GiB, and every worker runs a test at once. In a container with a
memory limit (a pod's 2 GiB) that is far past what the container has, and the kernel's OOM killer then picks a
victim inside it, the hub's own workers among the candidates, losing every score they held.

So the hub has a budget for its tests: `code_memory_budget_mb` when set, else the container's memory limit
(cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`) less `code_memory_reserve_mb` for the hub's own
processes; no limit ("max", or v1's page-rounded LONG_MAX) means no budget, and tests run as they always did.
The budget is split evenly among the workers. A worker runs one test at a time (items one after another, tests
one after another), so tests never hold more than the budget together, and no test ever waits for another's
memory: there is no accounting across processes to keep, to leak when a worker is killed mid-test, or to
deadlock on. The cost: a test cannot borrow the share of an idle worker.

Within its share a test gets what it asks as long as the kernel can hold it there: RLIMIT_AS binds each
process, so a test whose `memory_mb` x `max_processes` fits its share is bound by the kernel alone. One that does
not (the defaults, against any share under 16 GiB) keeps its limits, and the sandbox's watchdog also bounds what
its processes hold together (their proportional set size, read every 50 ms with the disk check), killing it past
the share: `code/memory_limit`. A test whose `memory_mb` alone is past the share could not be held by it at all:
the hub refuses such a spec when it validates it (`/validate` at submit, every `/score`), naming the param and the
share, as it refuses a param past its cap. The hub hands its budget to the params models in pydantic's validation
context (`PARAMS_CONTEXT_KEY`), since they cannot know how many workers split it; a worker checks again before a
test runs (`check_memory_mb`), for callers that skip validation, and makes such an item an ERROR.

`WorkerMemory` is one worker's side of this: the budget, and what its running test may hold now, in shared memory
the hub reads for its metrics. The worker installs it at start; `code` finds it with `installed()`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20
# Where the hub puts its `MemoryBudget` (or None) in the validation context of a spec's params.
PARAMS_CONTEXT_KEY = "code_memory_budget"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as LONG_MAX rounded down to a page; anything this large is no limit either.
_NO_LIMIT_BYTES = 1 << 60


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 `memory.max`, else v1 `memory.limit_in_bytes`), or
    None when there is none ("max", no such file: not in a container, or no memory controller)."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            raise ValueError(f"{path} holds {text[:40]!r}, not a number of bytes or 'max'") from None
        return None if limit >= _NO_LIMIT_BYTES else limit
    return None


@dataclass(frozen=True)
class MemoryBudget:
    """What the hub's sandboxed tests may hold together (`total_mb`), split among `workers`; `source` says where
    the figure came from, for messages and the log."""

    total_mb: int
    workers: int
    source: str

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"a memory budget is split among at least one worker, got workers={self.workers}")

    @property
    def share_mb(self) -> int:
        """What one worker's test may hold: its worker runs one test at a time."""
        return max(0, self.total_mb) // self.workers

    def describe(self) -> str:
        return f"{self.share_mb} MiB per test: {self.source}, over {self.workers} workers"

    def check_memory_mb(self, memory_mb: int) -> None:
        """Raises ValueError, naming the figures, when one process's `memory_mb` is past the share: no test asking
        it could be held within its worker's share."""
        if memory_mb > self.share_mb:
            raise ValueError(
                f"memory_mb {memory_mb} MiB is past what one test may hold on this hub, {self.describe()}; ask for "
                "less memory_mb, or give the hub more memory (RLFLEET_REWARD_CODE_MEMORY_BUDGET_MB, the container's "
                "memory limit) or fewer workers"
            )


def memory_budget(
    budget_mb: int | None, reserve_mb: int, workers: int, root: Path = CGROUP_ROOT
) -> MemoryBudget | None:
    """The hub's budget for sandboxed tests: `budget_mb` as given, else the cgroup's limit less `reserve_mb`;
    None when neither is set (no limit: tests run as they always did)."""
    if budget_mb is not None:
        return MemoryBudget(budget_mb, workers, f"a budget of {budget_mb} MiB (code_memory_budget_mb)")
    limit = cgroup_memory_limit(root)
    if limit is None:
        return None
    limit_mb = limit // MIB
    source = (
        f"the container's memory limit of {limit_mb} MiB less {reserve_mb} MiB for the hub "
        f"(code_memory_reserve_mb) = {limit_mb - reserve_mb} MiB"
    )
    return MemoryBudget(limit_mb - reserve_mb, workers, source)


class WorkerMemory:
    """One worker's share of the budget (`budget`, None without one), and what its running test may hold now, an
    int64 in shared memory (`shared_cell`) that the worker sets around each test and the hub reads for its
    metrics. A worker killed mid-test takes its cell with it: nothing is left counted."""

    def __init__(self, cell: Any, budget: MemoryBudget | None) -> None:
        self._cell = cell
        self.budget = budget

    @property
    def held_bytes(self) -> int:
        """What the worker's running test may hold now; 0 between tests."""
        return int(self._cell.value)

    def hold(self, nbytes: int) -> None:
        self._cell.value = nbytes


_installed: list[WorkerMemory] = []


def install(memory: WorkerMemory) -> None:
    """Makes `memory` this worker process's, for `code` to find: a worker is one process with one share, set once
    at its start (as `sandbox.probe_isolation` is probed once per process)."""
    _installed[:] = [memory]


def installed() -> WorkerMemory | None:
    """This worker's memory, or None outside a worker (a test calling `score_code` directly): no budget."""
    return _installed[0] if _installed else None


def shared_cell(context: Any) -> Any:
    """The shared int64 a `WorkerMemory` keeps its held figure in, from a multiprocessing context (the pool's)."""
    return context.RawValue(ctypes.c_int64, 0)
