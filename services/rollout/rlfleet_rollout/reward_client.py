"""Client of the reward hub: which functions exist, and scores for a batch of responses."""

from __future__ import annotations

import httpx
from google.protobuf import json_format

from rlfleet.errors import Unavailable
from rlfleet.v1.reward_pb2 import ListFunctionsResponse, RewardSpec, ScoreItem, ScoreRequest, ScoreResponse, ScoreResult
from rlfleet_rollout.http_retry import request_json


class RewardClient:
    def __init__(
        self, client: httpx.AsyncClient, base_url: str, *, score_timeout_s: float, list_timeout_s: float
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.score_timeout_s = score_timeout_s
        self.list_timeout_s = list_timeout_s

    async def function_names(self) -> list[str]:
        body = await request_json(self.client, "GET", f"{self.base_url}/functions", deadline_s=self.list_timeout_s)
        try:
            listing = json_format.ParseDict(body, ListFunctionsResponse(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise Unavailable(f"reward hub answered /functions with an unexpected body: {exc}") from exc
        return [f.name for f in listing.functions]

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
