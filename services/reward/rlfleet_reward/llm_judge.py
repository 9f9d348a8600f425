"""`judge`: an LLM grades the response, through the router's `/generate`; its verdict is parsed.

The prompt is `template` with `{prompt}`, `{response}` and `{label}` replaced by the item's fields
(other braces are left alone). The judge's text must match `verdict_pattern`; the last match's
first group is the verdict: with `verdicts` set, it is looked up there (case-insensitively),
otherwise it is a number from 0 to `scale`, divided by `scale`. A judge's text with no verdict (no match, a word
`verdicts` lacks, a number out of range) scores 0 with the component `judge/no_verdict` 1: an ERROR would drop the
sample from training, so a response that keeps the judge from deciding would escape its penalty.
Calls are retried on connection errors and 5xx until `deadline_seconds`, within the item's time limit.

The call waits on the event loop; the verdict is parsed in a worker process (`finish`), within what is
left of the item's time limit. `verdict_pattern` is the caller's regex over the model's text, and one that
backtracks for minutes (`(a+)+b` on a run of `a`s) would hold the event loop, where no time limit can stop
it; in a worker it is an item TIMEOUT like any other function that runs too long.

`router_url` must be one of the hub's `RLFLEET_REWARD_JUDGE_ROUTER_URLS` (by default the local fleet's
router, http://127.0.0.1:30000; `rlfleet up` lists its own), so a spec cannot point the hub's POSTs at another
service; left out, it is the first router listed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator

from rlfleet_reward.config import DEFAULT_ROUTER_URL, spec_caps
from rlfleet_reward.http_retry import post_json
from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored
from rlfleet_reward.spec_regex import MAX_PATTERN_CHARS, compiled

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\nAnswer to grade:\n"
    "{response}\n\nRate the answer from 0 (wrong) to 10 (fully correct). End with a line 'Score: N'.\n"
)
_FIELDS = re.compile(r"\{(prompt|response|label)\}")


def first_listed_router() -> AnyHttpUrl:
    """`router_url`'s default: the first router the hub lists (the fleet's own, wherever it runs)."""
    listed = spec_caps().judge_router_urls
    return listed[0] if listed else AnyHttpUrl(DEFAULT_ROUTER_URL)


class JudgeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    router_url: AnyHttpUrl = Field(
        default_factory=lambda: first_listed_router(),
        validate_default=True,  # a hub that lists no router refuses the default too, saying so
        description="The router, one the hub lists in RLFLEET_REWARD_JUDGE_ROUTER_URLS (default: the first listed).",
    )
    template: str = Field(default=DEFAULT_TEMPLATE, max_length=100_000, description="The judge's prompt.")
    verdict_pattern: str = Field(
        default=r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
        max_length=MAX_PATTERN_CHARS,
        description="Regex with one capturing group, the verdict (group others with (?:...)).",
    )
    verdicts: dict[str, float] | None = Field(default=None, description='e.g. {"correct": 1, "incorrect": 0}.')
    scale: float = Field(default=10.0, gt=0, description="A numeric verdict is divided by this.")
    max_new_tokens: int = Field(default=512, ge=1, le=32768)
    temperature: float = Field(default=0.0, ge=0)
    attempt_seconds: float = Field(default=60.0, gt=0, le=600, description="Timeout of one /generate call.")
    deadline_seconds: float = Field(default=120.0, gt=0, le=1200, description="Give up retrying after this long.")

    @field_validator("router_url")
    @classmethod
    def _listed_by_the_hub(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        caps = spec_caps()
        if not caps.allows_judge_router(url):
            listed = ", ".join(str(router) for router in caps.judge_router_urls) or "none"
            raise ValueError(
                f"{url} is none of the routers this hub allows (RLFLEET_REWARD_JUDGE_ROUTER_URLS: {listed})"
            )
        return url

    @field_validator("template")
    @classmethod
    def _shows_the_response(cls, template: str) -> str:
        if "{response}" not in template:
            raise ValueError("the template must contain {response}")
        return template

    @field_validator("verdict_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        groups = compiled(pattern).groups
        if groups != 1:
            # With more, the verdict would be read from the first alone: one captured by another read as none.
            raise ValueError(
                f"the pattern needs exactly one capturing group, the verdict; it has {groups} "
                "(write other groups as (?:...))"
            )
        return pattern


def render(template: str, sample: RewardInput) -> str:
    values = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return _FIELDS.sub(lambda match: values[match.group(1)], template)


def parse_verdict(text: str, params: Mapping[str, Any]) -> float | None:
    """The verdict in the judge's `text` as a score in [0, 1] (a table's value as it is), or None if it holds none:
    no match, a word the table does not have, or a number outside 0 to `scale` (a response that talks the judge
    into "Score: 100" would otherwise be worth ten right answers)."""
    found = re.findall(params["verdict_pattern"], text)
    if not found:
        return None
    verdict = found[-1]  # one group (checked): findall gives its text
    if params["verdicts"] is not None:
        table = {key.casefold(): value for key, value in params["verdicts"].items()}
        return table.get(verdict.casefold())
    try:
        value = float(verdict)
    except ValueError:
        return None
    return value / params["scale"] if 0 <= value <= params["scale"] else None


async def ask_judge(sample: RewardInput, params: Mapping[str, Any]) -> RewardInput:
    """The judge's text, as the response `score_verdict` reads."""
    body = {
        "text": render(params["template"], sample),
        "sampling_params": {"max_new_tokens": params["max_new_tokens"], "temperature": params["temperature"]},
    }
    url = str(params["router_url"]).rstrip("/") + "/generate"
    answer = await post_json(
        url, body, attempt_seconds=params["attempt_seconds"], deadline_seconds=params["deadline_seconds"]
    )
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        raise ValueError("/generate answered without a string 'text'")
    return RewardInput(response=answer["text"])


def score_verdict(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    """The verdict in the judge's text, which `ask_judge` put in `response`; 0 with `no_verdict` when it holds none."""
    verdict = parse_verdict(sample.response, params)
    if verdict is None:
        logger.info("the judge gave no verdict matching %r: %r", params["verdict_pattern"], sample.response[-200:])
        return Scored(score=0.0, parts={"no_verdict": 1.0})
    return Scored(score=verdict, parts={"no_verdict": 0.0})


JUDGE = RewardFunction(
    fn=ask_judge,
    finish=score_verdict,
    inputs=frozenset({"prompt", "response", "label"}),
    description="an LLM judge's verdict on the response, through the router's /generate",
    params=JudgeParams,
)
