"""Client of the reward hub: whether it takes a run's reward spec, and scores for a batch of responses."""

from __future__ import annotations

import httpx
from google.protobuf import json_format

from rlfleet.errors import Unavailable
from rlfleet.v1.reward_pb2 import (
    RewardSpec,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
    ScoreResult,
    SpecProblem,
    ValidateSpecRequest,
    ValidateSpecResponse,
)
from rlfleet_rollout.http_retry import request_json


class RewardClient:
    def __init__(
        self, client: httpx.AsyncClient, base_url: str, *, score_timeout_s: float, validate_timeout_s: float
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.score_timeout_s = score_timeout_s
        self.validate_timeout_s = validate_timeout_s

    async def spec_problems(self, spec: RewardSpec) -> list[SpecProblem]:
        """What the hub would refuse `spec` for (unknown functions, bad params, time limit), by field; [] when good."""
        body = await request_json(
            self.client,
            "POST",
            f"{self.base_url}/validate",
            deadline_s=self.validate_timeout_s,
            body=json_format.MessageToDict(ValidateSpecRequest(spec=spec), preserving_proto_field_name=True),
        )
        try:
            answer = json_format.ParseDict(body, ValidateSpecResponse(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise Unavailable(f"reward hub answered /validate with an unexpected body: {exc}") from exc
        return list(answer.problems)

    async def score(self, spec: RewardSpec, items: list[ScoreItem]) -> list[ScoreResult]:
        """One result per item, in order."""
        request = ScoreRequest(spec=spec, items=items)
        body = await request_json(
            self.client,
            "POST",
            f"{self.base_url}/score",
            deadline_s=self.score_timeout_s,
            body=json_format.MessageToDict(request, preserving_proto_field_name=True),
        )
        try:
            response = json_format.ParseDict(body, ScoreResponse(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise Unavailable(f"reward hub answered /score with an unexpected body: {exc}") from exc
        if len(response.results) != len(items):
            raise Unavailable(f"reward hub returned {len(response.results)} results for {len(items)} items")
        return list(response.results)
