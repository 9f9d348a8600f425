"""`judge`: an LLM grades the response, through the router's `/generate` or `/v1/chat/completions`; its
verdict is parsed.

The prompt is `template` with `{prompt}`, `{response}` and `{label}` replaced by the item's fields
(other braces are left alone). With `api` "generate" it is sent as raw text to SGLang's `/generate`; with "chat"
it is the user message (after `system`, if set) of an OpenAI chat completion, which the engine wraps in the
judge's chat template: an instruct-tuned judge reads its prompt as it was trained to, the graded response inside
the user's turn (a response that spells out the template's own special tokens can still end that turn: the engine
reads them as such). The judge's text must match `verdict_pattern`; the last match's
first group is the verdict: with `verdicts` set, it is looked up there (case-insensitively),
otherwise it is a number from 0 to `scale`, divided by `scale`. A judge's text with no verdict (no match, a word
`verdicts` lacks, a number out of range) scores 0 with the component `judge/no_verdict` 1: an ERROR would drop the
sample from training, so a response that keeps the judge from deciding would escape its penalty.
Calls are retried on connection errors and 5xx until `deadline_seconds`, within the item's time limit, and
so is a generation the engine aborted (finish reason `abort`: a weight update's `abort_all` on the fleet the
judge shares with the policy): its text is whatever the judge had written when it was stopped, no verdict or a
half-made one, and read as one it scored a good response 0. Each attempt carries a request id of its own
(`rid`), by which the router stops the generation at its engine when the hub gives up on it (the attempt's or
the item's time limit), rather than letting it run to `max_new_tokens` for nobody.

A text cut at `max_new_tokens` (finish reason `length`) holds no verdict either, and scores 0 with
`judge/no_verdict` and `judge/truncated` 1: the judge stopped before it had finished, so its last match is
something it wrote on the way (a tentative score in its reasoning, a score it quoted from the response) or a
verdict cut short ("Score: 1" of "Score: 10"). Read, it would let a response that keeps the judge talking pick
its own score, as an aborted text would; unlike one, asking again gives the same cut, so it is scored, not retried.

A response past `max_response_chars` reaches the judge cut in the middle, its start and end kept around a
line saying how much was left out: whole, it could pass the judge's context, which the engine refuses
(HTTP 400), an ERROR that would drop the sample, so that a response long enough would escape its penalty.

The call waits on the event loop; the verdict is parsed in a worker process (`finish`), within what is
left of the item's time limit. `verdict_pattern` is the caller's regex over the model's text, and one that
backtracks for minutes (`(a+)+b` on a run of `a`s) would hold the event loop, where no time limit can stop
it; in a worker it is an item TIMEOUT like any other function that runs too long.

`router_url` must be one of the hub's `RLFLEET_REWARD_JUDGE_ROUTER_URLS` (by default the local fleet's
router, http://127.0.0.1:30000; `rlfleet up` lists its own), so a spec cannot point the hub's POSTs at another
service; left out, it is the first router listed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator, model_validator

from rlfleet.errors import Unavailable
from rlfleet_reward.config import DEFAULT_ROUTER_URL, spec_caps
from rlfleet_reward.http_retry import post_json
from rlfleet_reward.reward_function import RewardFunction, RewardInput, Scored
from rlfleet_reward.spec_regex import MAX_PATTERN_CHARS, compiled

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\nAnswer to grade:\n"
    "{response}\n\nRate the answer from 0 (wrong) to 10 (fully correct). End with a line 'Score: N'.\n"
)
# "Score: 7", and the Markdown judges often write around it: "**Score:** 7", "Score: **7**".
DEFAULT_VERDICT_PATTERN = r"(?i)score[*_]*\s*[:=]\s*[*_]*\s*(-?\d+(?:\.\d+)?)"
_FIELDS = re.compile(r"\{(prompt|response|label)\}")
# Between generations the engine aborted: a weight update is over in seconds, so the pause need not grow long.
_FIRST_ABORT_PAUSE_SECONDS = 0.2
_MAX_ABORT_PAUSE_SECONDS = 2.0
# Where `ask_judge` leaves the finish reason for `score_verdict`, which reads the judge's text from `response`.
_FINISH_KEY = "finish_reason"


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
    api: Literal["generate", "chat"] = Field(
        default="generate",
        description="generate: the prompt as raw text to /generate; chat: as the user message to "
        "/v1/chat/completions, in the judge's chat template (an instruct-tuned judge's).",
    )
    template: str = Field(default=DEFAULT_TEMPLATE, max_length=100_000, description="The judge's prompt.")
    system: str | None = Field(
        default=None, max_length=100_000, description='The system message, sent as is; only with api "chat".'
    )
    verdict_pattern: str = Field(
        default=DEFAULT_VERDICT_PATTERN,
        max_length=MAX_PATTERN_CHARS,
        description="Regex with one capturing group, the verdict (group others with (?:...)).",
    )
    verdicts: dict[str, float] | None = Field(default=None, description='e.g. {"correct": 1, "incorrect": 0}.')
    scale: float = Field(default=10.0, gt=0, description="A numeric verdict is divided by this.")
    max_new_tokens: int = Field(default=512, ge=1, le=32768)
    max_response_chars: int = Field(
        default=16_000,
        ge=100,
        le=1_000_000,
        description="A longer response reaches the judge cut in the middle, its start and end kept.",
    )
    temperature: float = Field(default=0.0, ge=0)
    attempt_seconds: float = Field(default=60.0, gt=0, le=600, description="Timeout of one call to the judge.")
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

    @model_validator(mode="after")
    def _system_needs_chat(self) -> JudgeParams:
        if self.system is not None and self.api != "chat":
            # A raw /generate prompt has no system turn: the message would be dropped without a word.
            raise ValueError('system is sent only as a chat message: set api "chat", or put it in the template')
        return self


def render(template: str, sample: RewardInput, max_response_chars: int) -> str:
    values = {
        "prompt": sample.prompt,
        "response": shortened(sample.response, max_response_chars),
        "label": sample.label,
    }
    return _FIELDS.sub(lambda match: values[match.group(1)], template)


def shortened(response: str, limit: int) -> str:
    """`response`, or past `limit` characters its start and end (the answer is usually last) around a line
    saying how many were cut."""
    if len(response) <= limit:
        return response
    head = limit // 2
    tail = limit - head
    return f"{response[:head]}\n[... {len(response) - limit} characters cut ...]\n{response[-tail:]}"


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


class _Api(NamedTuple):
    """How one API of the router is asked, and its answer read."""

    path: str
    body: Callable[[str, Mapping[str, Any], str], dict[str, Any]]
    """The request's body, from the rendered prompt, the params and the attempt's rid."""
    read: Callable[[Any], tuple[str, str | None]]
    """The judge's text and finish reason in the answer; ValueError naming what is missing."""


def _generate_body(text: str, params: Mapping[str, Any], rid: str) -> dict[str, Any]:
    sampling = {"max_new_tokens": params["max_new_tokens"], "temperature": params["temperature"]}
    return {"text": text, "sampling_params": sampling, "rid": rid}


def _generate_answer(answer: Any) -> tuple[str, str | None]:
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        raise ValueError("/generate answered without a string 'text'")
    return answer["text"], finish_reason(answer)


def finish_reason(answer: Mapping[str, Any]) -> str | None:
    """The type of `meta_info.finish_reason` in SGLang's answer (`stop`, `length`, `abort`), if it says."""
    meta = answer.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    kind = finish.get("type") if isinstance(finish, dict) else finish
    return kind if isinstance(kind, str) else None


def _chat_body(text: str, params: Mapping[str, Any], rid: str) -> dict[str, Any]:
    system = [] if params["system"] is None else [{"role": "system", "content": params["system"]}]
    return {
        "model": "default",  # SGLang serves one model under any name, but some of its versions require the field
        "messages": [*system, {"role": "user", "content": text}],
        "max_tokens": params["max_new_tokens"],
        "temperature": params["temperature"],
        "stream": False,
        "rid": rid,
    }


def _chat_answer(answer: Any) -> tuple[str, str | None]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise ValueError("/v1/chat/completions answered without choices[0].message")
    content = choice["message"].get("content")
    # null when the judge wrote nothing but what a reasoning parser took apart (`reasoning_content`): no verdict.
    if content is not None and not isinstance(content, str):
        raise ValueError("/v1/chat/completions answered with a choices[0].message.content that is not a string")
    reason = choice.get("finish_reason")
    return content or "", reason if isinstance(reason, str) else None


_APIS = {
    "generate": _Api("/generate", _generate_body, _generate_answer),
    "chat": _Api("/v1/chat/completions", _chat_body, _chat_answer),
}


async def ask_judge(sample: RewardInput, params: Mapping[str, Any]) -> RewardInput:
    """The judge's text, as the response `score_verdict` reads, and its finish reason, in the metadata."""
    text = render(params["template"], sample, params["max_response_chars"])
    api = _APIS[params["api"]]
    url = str(params["router_url"]).rstrip("/") + api.path
    deadline = time.monotonic() + params["deadline_seconds"]
    pause = _FIRST_ABORT_PAUSE_SECONDS
    while (remaining := deadline - time.monotonic()) > 0:
        answer = await post_json(
            url,
            lambda: api.body(text, params, f"rlfleet-judge-{uuid.uuid4().hex}"),
            attempt_seconds=params["attempt_seconds"],
            deadline_seconds=remaining,
        )
        judged, reason = api.read(answer)
        if reason != "abort":
            return RewardInput(response=judged, metadata={} if reason is None else {_FINISH_KEY: reason})
        logger.info("the judge's generation at %s was aborted; asking again", url)
        await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, _MAX_ABORT_PAUSE_SECONDS)
    raise Unavailable(
        f"POST {url}: the engine aborted every generation of the judge for {params['deadline_seconds']:g} s "
        "(deadline_seconds): a weight update that long, or a client aborting every request"
    )


def score_verdict(sample: RewardInput, params: Mapping[str, Any]) -> Scored:
    """The verdict in the judge's text, which `ask_judge` put in `response`; 0 with `no_verdict` when it holds none,
    and with `truncated` too when the text was cut at `max_new_tokens`."""
    if sample.metadata.get(_FINISH_KEY) == "length":
        logger.info("the judge's text was cut at max_new_tokens (%d): no verdict read", params["max_new_tokens"])
        return Scored(score=0.0, parts={"no_verdict": 1.0, "truncated": 1.0})
    verdict = parse_verdict(sample.response, params)
    if verdict is None:
        logger.info("the judge gave no verdict matching %r: %r", params["verdict_pattern"], sample.response[-200:])
        return Scored(score=0.0, parts={"no_verdict": 1.0, "truncated": 0.0})
    return Scored(score=verdict, parts={"no_verdict": 0.0, "truncated": 0.0})


JUDGE = RewardFunction(
    fn=ask_judge,
    finish=score_verdict,
    inputs=frozenset({"prompt", "response", "label"}),
    description="an LLM judge's verdict on the response, through the router's /generate or /v1/chat/completions",
    params=JudgeParams,
)
