"""The cap on scoring jobs the hub holds at once, across requests: past it a request is refused, not queued.

A job is one (item, term) pair of a request being scored, waiting for a worker or running. Without a cap
the hub takes every request however far behind its workers are: twenty requests of 4096 items behind one
busy worker queued 65,472 jobs, minutes to hours of work for clients that would time out long before. A
request that would take the hub past `max_pending_jobs` is refused at once (HTTP 429 with Retry-After,
gRPC RESOURCE_EXHAUSTED), so the client backs off or goes to another replica, unless the hub holds nothing:
an idle hub serves any request within `max_batch_size`, whatever its terms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rlfleet.errors import ResourceExhausted

# The hub frees jobs continuously, so a short wait is as good a guess as any, and a refusal costs little.
RETRY_AFTER_SECONDS = 1


class Overloaded(ResourceExhausted):
    """The hub holds as many jobs as it may take; the same request may succeed after `RETRY_AFTER_SECONDS`."""

    http_status = 429
    kind = "overloaded"


class Admission:
    def __init__(self, max_pending_jobs: int) -> None:
        if max_pending_jobs < 1:
            raise ValueError(f"max_pending_jobs must be at least 1, got {max_pending_jobs}")
        self.max_pending_jobs = max_pending_jobs
        self.pending = 0

    @contextlib.contextmanager
    def admit(self, jobs: int) -> Iterator[None]:
        """Holds `jobs` for the duration of the block; Overloaded when they would pass the cap."""
        if self.pending and self.pending + jobs > self.max_pending_jobs:
            raise Overloaded(
                f"the hub is scoring {self.pending} jobs (items x terms) and this request adds {jobs}, past its "
                f"limit of {self.max_pending_jobs} (max_pending_jobs); retry in {RETRY_AFTER_SECONDS} s or send "
                "fewer items"
            )
        self.pending += jobs
        try:
            yield
        finally:
            self.pending -= jobs
