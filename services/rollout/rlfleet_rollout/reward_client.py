"""Client of the reward hub: whether it takes a run's reward spec, and scores for a batch of responses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from google.protobuf import json_format

from rlfleet.errors import Conflict, Unavailable
from rlfleet.v1.reward_pb2 import (
    RewardSpec,
    ScoreItem,
    ScoreResponse,
    ScoreResult,
    SpecProblem,
    ValidateSpecRequest,
    ValidateSpecResponse,
)
from rlfleet_rollout.http_retry import Refused, request_json

# A /score request's bounds, well within the hub's defaults (64 MiB bodies, 4096 items): a group repeats its answer
# and metadata in each of its items, and a large one (a code task's tests) passed the hub's limit, whose 413 failed
# the run.
SCORE_REQUEST_BYTES = 8 * 1024 * 1024
SCORE_REQUEST_ITEMS = 1024


class RewardClient:
    def __init__(
        self, client: httpx.AsyncClient, base_url: str, *, score_timeout_s: float, validate_timeout_s: float
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.score_timeout_s = score_timeout_s
        self.validate_timeout_s = validate_timeout_s

    async def spec_problems(self, spec: RewardSpec) -> list[SpecProblem]:
        """What the hub would refuse `spec` for (unknown functions, bad params, time limit), by field; [] when good.

        The hub answers a spec it refuses with its problems in a 200, so a 4xx is no judgement of the spec: the URL
        reaches no hub with /validate (an older hub, another service) or a proxy refuses this orchestrator. That is a
        Conflict (FAILED_PRECONDITION) naming the URL and the status; as InvalidInput it read as a fault of the spec,
        which no edit of the spec could mend."""
        url = f"{self.base_url}/validate"
        try:
            body = await request_json(
                self.client,
                "POST",
                url,
                deadline_s=self.validate_timeout_s,
                body=json_format.MessageToDict(ValidateSpecRequest(spec=spec), preserving_proto_field_name=True),
            )
        except Refused as exc:
            raise Conflict(
                f"the reward hub at {self.base_url} answered POST /validate with HTTP {exc.status}, not with the "
                f"spec's problems ({exc}): check the orchestrator's --reward-url, that the hub there is one with "
                "POST /validate, and any proxy in front of it; nothing was stored"
            ) from exc
        try:
            answer = json_format.ParseDict(body, ValidateSpecResponse(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise Unavailable(f"reward hub answered /validate with an unexpected body: {exc}") from exc
        return list(answer.problems)

    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        """One result per item, in order; sent in requests of at most SCORE_REQUEST_ITEMS items and about
        SCORE_REQUEST_BYTES of JSON each, one after the other (an item larger alone goes alone). Conflict when the
        hub answers with a 4xx (not 429), Unavailable or DeadlineExceeded when it fails or does not answer in time."""
        spec_json = json_format.MessageToDict(spec, preserving_proto_field_name=True)
        results: list[ScoreResult] = []
        for chunk in _chunks([json_format.MessageToDict(item, preserving_proto_field_name=True) for item in items]):
            results += await self._score(spec_json, chunk)
        return results

    async def _score(self, spec: dict[str, Any], items: list[dict[str, Any]]) -> list[ScoreResult]:
        """The results of one request. A hub took the run's spec at Submit (/validate) and answers an item it
        cannot score with an ERROR result in a 200, so a 4xx is the refusal of this orchestrator by the hub or a
        proxy (a route the hub lacks, a 401/403, a hub replaced since): a Conflict naming the URL and the status,
        as in spec_problems. As InvalidInput it failed the run blaming its spec, which no edit could mend."""
        try:
            body = await request_json(
                self.client,
                "POST",
                f"{self.base_url}/score",
                deadline_s=self.score_timeout_s,
                body={"spec": spec, "items": items},
            )
        except Refused as exc:
            raise Conflict(
                f"the reward hub at {self.base_url} answered POST /score with HTTP {exc.status} ({exc}): a hub took "
                "the run's reward spec at submit, so the hub or a proxy in front of it refuses this orchestrator: "
                "check the orchestrator's --reward-url, that the hub there is one with POST /score and the run's "
                "reward functions, and any proxy in front of it (its auth); a retry gets the same answer"
            ) from exc
        try:
            response = json_format.ParseDict(body, ScoreResponse(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise Unavailable(f"reward hub answered /score with an unexpected body: {exc}") from exc
        if len(response.results) != len(items):
            raise Unavailable(f"reward hub returned {len(response.results)} results for {len(items)} items")
        return list(response.results)


def _chunks(items: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """`items` in runs of at most SCORE_REQUEST_ITEMS and, but for a lone item, SCORE_REQUEST_BYTES of JSON."""
    chunk: list[dict[str, Any]] = []
    size = 0
    for item in items:
        item_size = len(json.dumps(item))
        if chunk and (len(chunk) == SCORE_REQUEST_ITEMS or size + item_size > SCORE_REQUEST_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk
