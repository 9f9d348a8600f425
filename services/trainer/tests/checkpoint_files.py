"""Damaging a DCP checkpoint on purpose, for the tests of what a load makes of it."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader


def flip_a_bit(path: Path, shard_name: str | None = None) -> Path:
    """Flips one bit inside the largest weight of the policy in the checkpoint at `path` (only among those stored in
    the file `shard_name`, if given); returns the file."""
    storage = FileSystemReader(str(path)).read_metadata().storage_data
    where = max(
        (
            where
            for index, where in storage.items()
            if index.fqn.startswith("model.") and shard_name in (None, where.relative_path)
        ),
        key=lambda where: where.length,
    )
    shard = path / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset + where.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard
