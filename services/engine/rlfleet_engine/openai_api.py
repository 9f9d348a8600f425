"""The OpenAI-compatible endpoints over an engine core, in the shapes SGLang's OpenAI server answers.

Each request becomes a /generate request on token ids (the prompt is tokenised here, so the exact
prompt ids can be returned with `return_token_ids`), and each /generate output becomes a choice:

    completion choice: {index, text, logprobs: {tokens, token_logprobs, top_logprobs, text_offset} | null,
                        finish_reason, matched_stop[, token_ids, prompt_token_ids]}
    chat choice:       {index, message: {role: "assistant", content, reasoning_content: null, tool_calls: null},
                        logprobs: {content: [{token, bytes, logprob, top_logprobs}]} | null,
                        finish_reason, matched_stop[, prompt_token_ids, response_token_ids, meta_info]}

(SGLang names a chat choice's output ids `response_token_ids`, a completion choice's `token_ids`.) Both answers
carry `usage` (prompt tokens counted once per prompt, as SGLang does) and `metadata`, the first output's
`weight_version` and `weight_versions` spans. Streams send deltas as server-sent events (each content chunk with
its choice's `usage` so far under `stream_options.continuous_usage_stats`), then `data: [DONE]`; a streamed chat
answer cannot return token ids or meta_info (400), as SGLang's cannot.

A chat request that leaves temperature, top_p, top_k or min_p unset (or null) takes the model's
generation_config.json value (`generation_defaults`), as SGLang's chat handler does by default; a completion
request takes the OpenAI defaults, as SGLang's does. A chat request without `max_tokens` or
`max_completion_tokens` may run to the context, as SGLang's chat does (a completion's default is 16 tokens).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError, TemplateSyntaxError
from pydantic import ValidationError

from rlfleet.errors import InvalidInput
from rlfleet_engine.body_errors import describe
from rlfleet_engine.openai_schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, OpenAISampling
from rlfleet_engine.request_expansion import check_vocabulary, unicode_text
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.schemas import GenerateRequest

if TYPE_CHECKING:
    from rlfleet_engine.engine_core import EngineCore

# The sampling parameters /generate names otherwise than the OpenAI fields they come from.
_OPENAI_NAMES = {"sampling_seed": "seed", "max_new_tokens": "max_tokens"}


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    *,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt ids of a conversation, ending where the assistant's next turn begins.

    A tokenizer with a chat template renders it, with each message's tool calls (their arguments as objects),
    `tool_call_id`, `name` and `reasoning_content`, and `template_kwargs`; the text is encoded without the tokenizer's
    special tokens, because the template writes its own ({{ bos_token }}) and a BOS post-processor would add a second
    one (transformers' apply_chat_template, SGLang and the orchestrator encode it so too). One without a template (the
    sim tokenizer) gets a plain `<|role|>\\ncontent\\n` layout, encoded as a raw prompt is, so chat requests still
    work on every backend. A last assistant message is, as in SGLang's chat handler, the start of the answer with
    `continue_final_message` (its text follows the generation prompt), else rendered as a user's message.
    """
    try:
        plain = [_template_message(m) for m in messages]
    except ValueError as exc:
        raise InvalidInput(f"messages: {exc}") from exc
    for i, message in enumerate(plain):
        unicode_text(message["role"], f"messages[{i}].role")
        unicode_text(message["content"], f"messages[{i}].content")
    answer_start = ""
    if plain[-1]["role"] == "assistant":
        if continue_final_message:
            answer_start = plain.pop()["content"]
        else:
            plain[-1] = {"role": "user", "content": plain[-1]["content"]}
    if not getattr(tokenizer, "chat_template", None):
        layout = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in plain) + "<|assistant|>\n"
        return tokenizer.encode(layout + answer_start)
    try:
        text = tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=True, **dict(template_kwargs or {})
        )
    except TemplateSyntaxError:
        raise  # the model's template is broken: the server's fault, whatever the request
    except (TemplateError, TypeError) as exc:
        # raise_exception: the template says what it refused (a role, an order); a TypeError is a kwarg the call
        # already has, or a value the template cannot use. SGLang answers both 400.
        raise InvalidInput(f"messages: the model's chat template refused them: {exc}") from exc
    return tokenizer.encode(str(text) + answer_start, add_special_tokens=False)


# The message fields besides role and content that chat templates render (an assistant's tool calls, a tool's answer).
_TEMPLATE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template reads it: its text, and the fields of `_TEMPLATE_FIELDS` it has, an assistant's
    tool call arguments parsed from their JSON text into objects, as SGLang gives them to the template."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    extra = message.model_extra or {}
    for name in _TEMPLATE_FIELDS:
        if extra.get(name) is not None:
            rendered[name] = extra[name]
    if message.role == "assistant" and isinstance(rendered.get("tool_calls"), list):
        rendered["tool_calls"] = [_with_parsed_arguments(call) for call in rendered["tool_calls"]]
    return rendered


def _with_parsed_arguments(call: object) -> object:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError as exc:
        raise ValueError("Assistant tool call function.arguments must be valid JSON.") from exc
    if not isinstance(arguments, dict):
        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
    return {**call, "function": {**function, "arguments": arguments}}


def _finish(meta: dict[str, Any]) -> tuple[str | None, int | str | None]:
    reason = meta.get("finish_reason")
    if not isinstance(reason, dict):
        return None, None
    return str(reason.get("type")), reason.get("matched")


def _answer_id(first_output_id: str, outputs: int) -> str:
    """The id of an answer, streamed or whole: its one output's rid (the client's `rid`, as SGLang answers),
    or a fresh id for an answer of several outputs (n > 1, several prompts)."""
    return first_output_id if outputs == 1 else uuid.uuid4().hex


def _outputs(result: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return result if isinstance(result, list) else [result]


class OpenAIServer:
    """Turns OpenAI requests into /generate requests on `core`, and its outputs into OpenAI answers.
    `chat_defaults`: the sampling values a chat request leaves unset takes."""

    def __init__(self, core: EngineCore, chat_defaults: Mapping[str, float]) -> None:
        self._core = core
        self._chat_defaults = chat_defaults

    # ---- requests ------------------------------------------------------------------------------

    @staticmethod
    def _refuse_what_cannot_be_honoured(req: CompletionRequest | ChatCompletionRequest) -> None:
        unsupported = req.unsupported_fields()
        if unsupported:
            raise InvalidInput(f"{', '.join(unsupported)}: not supported by rlfleet-engine (leave out, or null)")
        if isinstance(req, ChatCompletionRequest):
            problem = req.tool_choice_problem()
            if problem is not None:
                raise InvalidInput(problem)

    def _prompts(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        encode = self._core.tokenizer.encode
        if isinstance(req, ChatCompletionRequest):
            if req.input_ids is not None:  # SGLang's chat sends them as they are, the messages not rendered
                check_vocabulary(req.input_ids, self._core.backend.vocab_size, "input_ids")
                return [list(req.input_ids)]
            ids = chat_prompt_ids(
                self._core.tokenizer,
                req.messages,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.template_kwargs(),
            )
            return [ids]
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [encode(unicode_text(prompt, "prompt"))]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [[p for p in prompt if isinstance(p, int)]]
            check_vocabulary(prompts[0], self._core.backend.vocab_size, "prompt")
        else:
            prompts = []
            for i, p in enumerate(prompt):
                if isinstance(p, str):
                    prompts.append(encode(unicode_text(p, f"prompt[{i}]")))
                elif isinstance(p, list):
                    check_vocabulary(p, self._core.backend.vocab_size, f"prompt[{i}]")
                    prompts.append(list(p))
        if not all(prompts):
            raise InvalidInput("prompt: must not be empty")
        return prompts

    def _generate_request(
        self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]]
    ) -> GenerateRequest:
        if isinstance(req, ChatCompletionRequest):
            return_logprob, top = req.logprobs, req.top_logprobs or 0
        else:
            return_logprob, top = req.logprobs is not None, req.logprobs or 0
        requested = req.sampling_params()
        if isinstance(req, ChatCompletionRequest):  # the model's defaults were checked at start: they pass
            requested.update({k: v for k, v in self._chat_defaults.items() if k not in req.model_fields_set})
        try:
            params = SamplingParams.model_validate(requested)
        except ValidationError as exc:
            # Named as the client sent the field.
            errors = [
                {**err, "loc": ("body", *(_OPENAI_NAMES.get(str(p), p) for p in err["loc"]))} for err in exc.errors()
            ]
            raise InvalidInput(describe(errors)) from exc
        # Checked here too, so a refusal names the field the client sent rather than /generate's.
        check_vocabulary(params.stop_token_ids, self._core.backend.vocab_size, "stop_token_ids")
        batch = len(prompts) > 1
        return GenerateRequest(
            input_ids=prompts if batch else prompts[0],
            sampling_params=params,
            rid=req.rid,
            return_logprob=return_logprob,
            top_logprobs_num=top,
            return_text_in_logprobs=True,
            stream=req.stream,
        )

    # ---- whole answers -------------------------------------------------------------------------

    async def complete(self, req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        self._refuse_what_cannot_be_honoured(req)
        prompts = self._prompts(req)
        outputs = _outputs(await self._core.generate(self._generate_request(req, prompts)))
        chat = isinstance(req, ChatCompletionRequest)
        choices = []
        for index, out in enumerate(outputs):
            prompt_ids = prompts[index // req.n]
            choice = self._chat_choice(out, index) if chat else self._completion_choice(out, index)
            if req.return_token_ids:
                choice["response_token_ids" if chat else "token_ids"] = list(out["output_ids"])
                choice["prompt_token_ids"] = prompt_ids
            if isinstance(req, ChatCompletionRequest):
                if req.return_prompt_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                if req.return_meta_info:
                    choice["meta_info"] = out["meta_info"]
            choices.append(choice)
        return {
            "id": _answer_id(outputs[0]["meta_info"]["id"], len(outputs)),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": self._usage(outputs, prompts, req.n),
            "metadata": {key: outputs[0]["meta_info"][key] for key in ("weight_version", "weight_versions")},
        }

    def _completion_choice(self, out: dict[str, Any], index: int) -> dict[str, Any]:
        meta = out["meta_info"]
        reason, matched = _finish(meta)
        return {
            "index": index,
            "text": out["text"],
            "logprobs": self._completion_logprobs(meta, 0) if "output_token_logprobs" in meta else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }

    def _chat_choice(self, out: dict[str, Any], index: int) -> dict[str, Any]:
        meta = out["meta_info"]
        reason, matched = _finish(meta)
        message = {"role": "assistant", "content": out["text"], "reasoning_content": None, "tool_calls": None}
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": self._chat_logprobs(meta, 0)} if "output_token_logprobs" in meta else None,
            "finish_reason": reason,
            "matched_stop": matched,
        }

    @staticmethod
    def _completion_logprobs(meta: dict[str, Any], start: int) -> dict[str, Any]:
        entries = meta["output_token_logprobs"][start:]
        tops = meta.get("output_top_logprobs", [])[start:]
        tokens = [str(text) for _, _, text in entries]
        # Offsets in the whole completion's text: a stream's chunk goes on from the tokens sent before it.
        offsets, position = [], sum(len(str(text)) for _, _, text in meta["output_token_logprobs"][:start])
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [{str(t): lp for lp, _, t in row} for row in tops] if tops else [None] * len(entries),
            "text_offset": offsets,
        }

    @staticmethod
    def _chat_logprobs(meta: dict[str, Any], start: int) -> list[dict[str, Any]]:
        entries = meta["output_token_logprobs"][start:]
        tops = meta.get("output_top_logprobs", [])[start:] or [[] for _ in entries]
        return [
            {
                "token": str(text),
                "bytes": list(str(text).encode()),
                "logprob": lp,
                "top_logprobs": [{"token": str(t), "bytes": list(str(t).encode()), "logprob": tl} for tl, _, t in row],
            }
            for (lp, _, text), row in zip(entries, tops, strict=True)
        ]

    @staticmethod
    def _usage(outputs: list[dict[str, Any]], prompts: list[list[int]], n: int) -> dict[str, Any]:
        completion = sum(int(o["meta_info"]["completion_tokens"]) for o in outputs)
        prompt = sum(len(p) for p in prompts)
        cached = sum(int(o["meta_info"].get("cached_tokens") or 0) for o in outputs[::n])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- streams -------------------------------------------------------------------------------

    def stream(self, req: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[bytes]:
        """Submits `req` now (bad input raises before the response starts) and returns its SSE byte stream."""
        self._refuse_what_cannot_be_honoured(req)
        if isinstance(req, ChatCompletionRequest):
            # In SGLang's words.
            for field in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
                if getattr(req, field):
                    where = " on /v1/chat/completions" if field == "return_token_ids" else ""
                    raise InvalidInput(
                        f"{field} is not supported with streaming{where}. Please set stream=false when using "
                        f"{field}=true."
                    )
        prompts = self._prompts(req)
        chunks = self._core.generate_stream(self._generate_request(req, prompts))
        return self._events(req, prompts, chunks)

    async def _events(
        self, req: OpenAISampling, prompts: list[list[int]], chunks: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        chat = isinstance(req, ChatCompletionRequest)
        stream_id = ""  # named by the first output, as a whole answer is
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, dict[str, Any]] = {}

        def event(choice: dict[str, Any], usage: dict[str, int] | None = None) -> bytes:
            body: dict[str, Any] = {
                "id": stream_id,
                "object": kind,
                "created": int(time.time()),
                "model": req.model,
                "choices": [choice],
            }
            if usage is not None:
                body["usage"] = usage
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        async for out in chunks:
            index = int(out.get("index", 0))
            meta = out["meta_info"]
            stream_id = stream_id or _answer_id(meta["id"], len(prompts) * req.n)
            if chat and index not in sent_text:
                yield event({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            text_from, token_from = sent_text.get(index, 0), sent_tokens.get(index, 0)
            sent_text[index], sent_tokens[index] = len(out["text"]), len(out["output_ids"])
            reason, matched = _finish(meta)
            choice: dict[str, Any] = {"index": index, "finish_reason": reason, "matched_stop": matched}
            if chat:  # a chat stream ends each choice with a chunk of its own (below), as SGLang's does
                choice.update(finish_reason=None, matched_stop=None)
            delta = out["text"][text_from:]  # a streamed text only grows (GenerationJob.text): the new part is its tail
            if chat:
                choice["delta"] = {"content": delta}
                has_logprobs = "output_token_logprobs" in meta
                choice["logprobs"] = {"content": self._chat_logprobs(meta, token_from)} if has_logprobs else None
            else:
                choice["text"] = delta
                has_logprobs = "output_token_logprobs" in meta
                choice["logprobs"] = self._completion_logprobs(meta, token_from) if has_logprobs else None
            if req.return_token_ids:
                choice["token_ids"] = list(out["output_ids"][token_from:])
                if token_from == 0:
                    choice["prompt_token_ids"] = prompts[index // req.n]
            if reason is not None:
                finals[index] = out
            if req.continuous_usage_stats:  # this choice's usage so far, as SGLang puts it on each content chunk
                prompt, completion = len(prompts[index // req.n]), int(meta["completion_tokens"])
                so_far = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
                yield event(choice, so_far)
            else:
                yield event(choice)
        if chat:
            for index, out in finals.items():
                reason, matched = _finish(out["meta_info"])
                yield event({"index": index, "delta": {}, "finish_reason": reason, "matched_stop": matched})
        if req.include_usage:
            outputs = [finals[i] for i in sorted(finals)]
            usage = {
                "id": stream_id,
                "object": kind,
                "created": int(time.time()),
                "model": req.model,
                "choices": [],
                "usage": self._usage(outputs, prompts, req.n) if outputs else None,
            }
            yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
