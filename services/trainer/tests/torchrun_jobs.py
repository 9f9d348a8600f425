"""Starting the scripts in tests/torchrun/ as real torchrun jobs and waiting for them, bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlfleet.processes import ServiceProcess

SCRIPTS = Path(__file__).parent / "torchrun"


def torchrun(nproc: int, args: list[str], log: Path) -> ServiceProcess:
    return ServiceProcess(
        f"torchrun-{nproc}",
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args],
        log,
        env={"OMP_NUM_THREADS": "1"},
    )


def finish(job: ServiceProcess, timeout_s: float) -> None:
    """Waits for `job` to exit 0 within `timeout_s`; kills it (by process group) otherwise."""
    try:
        code = job.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        job.stop(timeout=5)
    assert code == 0, f"{job.name} exited with {code}; last lines of its log:\n{job.log_tail(40)}"
