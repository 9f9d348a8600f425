"""Which processes listen on a TCP port, read from Linux's /proc.

The local launcher asks this before it counts a health check: an answer on a service's port proves
nothing when another process (say, a fleet started earlier) already listens there, and the child it
started dies a moment later with "address already in use". gRPC servers bind with SO_REUSEPORT, so a
second one on a port does not fail: it silently gets part of the connections, which only the sockets
listening there tell.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"
"""The TCP state LISTEN in /proc/net/tcp's `st` column."""


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on `port` (IPv4 or IPv6); None when /proc/net/tcp cannot be read."""
    inodes: set[str] = set()
    readable = False
    for table in ("tcp", "tcp6"):
        try:
            lines = (_PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes if readable else None


def listening_sockets(port: int) -> list[set[int]] | None:
    """The sockets that listen on `port`, each as the pids of the processes holding it, among those this user
    may inspect (an empty set: a socket no process this user can see holds).

    More than one socket listens on a port when servers bind it with SO_REUSEPORT, as gRPC's do by default: the
    kernel then splits the connections among them. None when this cannot be known: no /proc (not Linux), or no
    socket listens on `port`.
    """
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    holders: dict[str, set[int]] = {f"socket:[{inode}]": set() for inode in inodes}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # another user's process, or one that just ended
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in holders:
                holders[target].add(int(entry.name))
    return list(holders.values())


def listening_pids(port: int) -> set[int] | None:
    """Pids of the processes holding a socket that listens on `port`, among those this user may inspect.

    None when this cannot be known: no /proc (not Linux), or no socket listens on `port`. An empty set
    means a socket listens there but no process this user can see holds it.
    """
    sockets = listening_sockets(port)
    return None if sockets is None else set().union(*sockets)


def descends_from(pid: int, ancestor: int, max_depth: int = 64) -> bool:
    """Whether `pid` is `ancestor` or one of its descendants (torchrun's ranks run in sessions of their own,
    so a process group would not tell)."""
    for _ in range(max_depth):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
        except OSError:
            return False
        # The command name (2nd field) is in parentheses and may hold spaces; the parent pid follows the state.
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False
