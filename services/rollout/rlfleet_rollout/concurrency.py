"""Running a batch of coroutines together so that one failure stops the rest instead of orphaning them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_cancelling(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Results in order; on the first exception (or cancellation) the unfinished ones are cancelled."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
