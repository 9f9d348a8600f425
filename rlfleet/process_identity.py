"""Whether a recorded pid still names the process that was recorded, read from Linux's /proc.

fleet.json outlives its processes when `rlfleet up` is killed or the machine restarts, and pids are
reused: `rlfleet down` must not signal whatever process holds a recorded pid now. A process is known by
its pid and its start time together.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch; None when it cannot be read (gone, not Linux)."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
        boot = next(line for line in (_PROC / "stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    # Fields after the parenthesised command name start with the 3rd (state); the 22nd is the start time in
    # clock ticks since boot.
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def is_another_process(pid: int, started: float | None) -> bool:
    """Whether `pid` is alive but is not the process recorded as starting at `started` (its pid was reused).
    False when it cannot tell: no recorded start time, or none readable now."""
    now = start_time(pid)
    return started is not None and now is not None and abs(now - started) > 1.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
