"""Property-based requests against a live service's OpenAPI schema (schemathesis), bounded per operation.

Every operation of the schema gets `examples` generated requests (valid and invalid ones); each must be
answered below 500. The count of requests sent is returned so the tests can report it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.core.result import Err
from schemathesis.generation.case import Case


def fuzz_operations(
    base_url: str, headers: dict[str, str], *, examples: int, skip: Iterable[str] = ()
) -> dict[str, int]:
    """Requests sent per operation label (`POST /v1/runs`); raises AssertionError on a 5xx."""
    raw = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=10)
    raw.raise_for_status()
    schema = schemathesis.openapi.from_dict(raw.json())
    skipped = set(skip)
    sent: dict[str, int] = {}
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise AssertionError(f"{base_url}/openapi.json has an operation schemathesis cannot read: {result.err()}")
        operation = result.ok()
        if operation.label not in skipped:
            sent[operation.label] = 0
            _fuzz_one(operation, base_url, headers, examples, sent)
    return sent


def _fuzz_one(operation: Any, base_url: str, headers: dict[str, str], examples: int, sent: dict[str, int]) -> None:
    label = operation.label

    @given(case=operation.as_strategy())
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests on every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def answered_below_500(case: Case) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=15)
        sent[label] += 1
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}\n"
            f"reproduce: {case.as_curl_command()}"
        )

    answered_below_500()
