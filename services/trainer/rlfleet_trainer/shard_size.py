"""The size of an exported model's safetensors shards (`export --max-shard-size`), read without torch so the
command's arguments are checked before anything heavy is imported."""

from __future__ import annotations

import re
from decimal import Decimal

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""As the Hugging Face Hub's `save_torch_state_dict` and transformers before 5 shard (transformers 5 writes up to
50GB a file): a 7B model in bf16 is three files, each small enough to upload, copy or download on its own."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_shard_size(size: str | int) -> int:
    """Bytes of `size`: a whole number of bytes, or a number and a unit, `5GB` or `500MiB` (KB, MB, GB, TB count
    powers of 1000; KiB, MiB, GiB, TiB of 1024; any case). ValueError, naming --max-shard-size, for anything else
    or a size under one byte."""
    if isinstance(size, int) and not isinstance(size, bool):
        count = size
    else:
        found = _SIZE.fullmatch(str(size))
        unit = found.group(2).lower() if found else ""
        if found is None or unit not in _UNITS:
            raise ValueError(
                f"--max-shard-size {size!r} is not a size: give bytes or a number with a unit, "
                f"e.g. {DEFAULT_MAX_SHARD_SIZE} or 500MiB"
            )
        count = int(Decimal(found.group(1)) * _UNITS[unit])
    if count < 1:
        raise ValueError(f"--max-shard-size {size!r} is under one byte: give at least 1, e.g. {DEFAULT_MAX_SHARD_SIZE}")
    return count
