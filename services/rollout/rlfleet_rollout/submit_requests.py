"""A Submit's request_id (AIP-155): its format, and what the run store keeps of it to answer a repeat.

A client sends the same request_id with every retry of one Submit; the store records `request_id -> the run it
made + the digest of the spec it came with` in the transaction that creates the run (RunStore.create), for
REQUEST_ID_RETENTION_S. A repeat with the same spec is answered that run; one with another spec is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from rlfleet.errors import InvalidInput
from rlfleet.v1.runs_pb2 import RunSpec

REQUEST_ID_MAX_CHARS = 64
REQUEST_ID_RETENTION_S = 24 * 3600
"""How long a request_id is honoured: far beyond any client's retries of one Submit (`rlfleet submit` retries for
30 s), and fixed rather than the run data's retention (7 days), which a deployment may shorten to minutes to
save space while clients still retry."""
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class SubmitRequest:
    """One Submit as its request_id names it: the id and the SHA-256 of the spec as sent (before defaults)."""

    request_id: str
    spec_sha256: str

    @classmethod
    def of(cls, request_id: str, spec: RunSpec) -> SubmitRequest:
        """InvalidInput naming request_id unless it is 1 to REQUEST_ID_MAX_CHARS characters of A-Z a-z 0-9 . _ -"""
        if len(request_id) > REQUEST_ID_MAX_CHARS:
            raise InvalidInput(
                f"request_id: {len(request_id)} characters, at most {REQUEST_ID_MAX_CHARS} are taken (a UUID4 is 36)"
            )
        if not _REQUEST_ID.fullmatch(request_id):
            raise InvalidInput(
                f"request_id: {request_id[:REQUEST_ID_MAX_CHARS]!r} holds a character other than A-Z a-z 0-9 . _ - "
                "(a UUID4 such as 3f9c0a1b-... is recommended)"
            )
        # Deterministic serialization orders map entries (reward params), so one spec always has one digest,
        # whether it came as REST JSON or as a gRPC message.
        digest = hashlib.sha256(spec.SerializeToString(deterministic=True)).hexdigest()
        return cls(request_id, digest)


@dataclass(frozen=True)
class RequestRecord:
    """What the store holds for a request_id: the run its first Submit created, and that Submit's spec digest."""

    run_id: str
    spec_sha256: str

    def to_bytes(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "spec_sha256": self.spec_sha256}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | str) -> RequestRecord:
        data = json.loads(raw)
        return cls(str(data["run_id"]), str(data["spec_sha256"]))
