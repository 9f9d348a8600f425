"""`remote`: a reward model behind HTTP. The hub POSTs the item and reads back a score and components.

Request body: `{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}`. Answer:
`{"score": 0.7, "components": {"helpfulness": 0.9}}` (`components` optional; field names are
params). Connection errors, timeouts and 5xx are retried with backoff until `deadline_seconds`; the
item's time limit still bounds the whole call. The function runs on the hub's event loop, so many
calls wait at once without holding worker processes.

`url` must lie under one of the hub's `RLFLEET_REWARD_REMOTE_URL_PREFIXES` (none by default, which turns
`remote` off): a spec is the caller's, and without the list it could make the hub POST anywhere it reaches
(an engine's `/pause_generation`). Errors name the HTTP status or the missing field, never the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator

from rlfleet_reward.config import spec_caps
from rlfleet_reward.http_retry import post_json
from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored


class RemoteParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: AnyHttpUrl = Field(description="The reward model's scoring endpoint, e.g. http://rm:8080/score.")
    attempt_seconds: float = Field(default=10.0, gt=0, le=300, description="Timeout of one attempt.")
    deadline_seconds: float = Field(default=30.0, gt=0, le=600, description="Give up retrying after this long.")
    score_field: str = Field(default="score", description="Field of the answer holding the score.")
    components_field: str = Field(default="components", description="Field holding named sub-scores, if any.")

    @field_validator("url")
    @classmethod
    def _listed_by_the_hub(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        caps = spec_caps()
        if not caps.allows_remote(url):
            listed = ", ".join(str(prefix) for prefix in caps.remote_url_prefixes) or "none"
            raise ValueError(
                f"{url} is under none of the URL prefixes this hub allows "
                f"(RLFLEET_REWARD_REMOTE_URL_PREFIXES: {listed})"
            )
        return url


async def score_remote(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    body = {
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": dict(sample.metadata),
    }
    answer = await post_json(
        str(params["url"]), body, attempt_seconds=params["attempt_seconds"], deadline_seconds=params["deadline_seconds"]
    )
    # The answer is not quoted in errors: they reach the run's owner, and the model is the operator's.
    if not isinstance(answer, dict) or params["score_field"] not in answer:
        raise ValueError(f"the reward model's answer has no {params['score_field']!r}")
    # Only absent or null means none: `0`, `false`, `""` or `[]` is a model answering in another shape.
    parts = answer.get(params["components_field"])
    if parts is None:
        parts = {}
    if not isinstance(parts, dict):
        raise ValueError(f"{params['components_field']!r} in the reward model's answer is not an object")
    return Scored(score=answer[params["score_field"]], parts=parts)


REMOTE = RewardFunction(
    fn=score_remote,
    inputs=frozenset({"prompt", "response", "label", "metadata"}),
    description="the score (and components) an HTTP reward model returns for the item",
    params=RemoteParams,
)
