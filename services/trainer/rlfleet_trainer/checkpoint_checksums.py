"""SHA-256 sums of a checkpoint's files, kept beside them in `SHA256SUMS` (the format `sha256sum -c` reads).

DCP stores tensors as their raw bytes, so a bit flipped on disk or in a copy between machines loads as a
slightly different policy or optimizer state, without an error. Every rank sums the files it wrote (DCP
names them `__<rank>_<n>.distcp`) right after writing them, while they are still in its page cache; rank 0
sums the rest (`.metadata`) and writes the list. Before a load every rank checks its share of the listed
files, so a checkpoint whose file is missing or differs from its sum is refused as damaged, naming the file.
A checkpoint written before the sums were kept has no list and loads unchecked.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

SUMS_FILE = "SHA256SUMS"
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class ChecksumMismatch(Exception):
    """A checkpoint file differs from the sum written when it was saved."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _writer(name: str) -> int:
    """The rank that wrote the file called `name` (DCP's shards), 0 for the others."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else 0


def sum_own_files(directory: Path, rank: int) -> dict[str, str]:
    """The SHA-256 of every file in `directory` that `rank` wrote (file name -> hex digest)."""
    return {
        path.name: _sha256(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != SUMS_FILE and _writer(path.name) == rank
    }


def write_sums(directory: Path, sums: Mapping[str, str]) -> None:
    text = "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))
    with (directory / SUMS_FILE).open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_sums(directory: Path) -> dict[str, str] | None:
    """The sums written with the checkpoint in `directory`; None for one saved before they were kept."""
    path = directory / SUMS_FILE
    if not path.exists():
        return None
    sums = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        digest, separator, name = line.partition("  ")
        if not separator or len(digest) != 64 or not name:
            raise ChecksumMismatch(f"{path} line {number} is no '<sha256>  <file>' line: {line[:120]!r}")
        sums[name] = digest
    return sums


def check_share(directory: Path, sums: Mapping[str, str], rank: int, world_size: int) -> None:
    """Checks the listed files that fall to `rank` of `world_size` (every world_size-th, so the ranks of a job
    that resumes on another number of ranks still share the work); raises ChecksumMismatch or FileNotFoundError
    naming the first bad file."""
    for index, (name, digest) in enumerate(sorted(sums.items())):
        if index % world_size != rank:
            continue
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint file {path} is missing (listed in {SUMS_FILE})")
        actual = _sha256(path)
        if actual != digest:
            raise ChecksumMismatch(
                f"checkpoint file {path} has SHA-256 {actual}, not the {digest} it was saved with: it changed on disk"
            )
