"""Turns one /generate request into the jobs it asks for: one per prompt and sample (`n`), in SGLang's order.

Order is prompt-major: prompt 0 sample 0..n-1, then prompt 1, ... Request ids follow SGLang: a string
rid of a batch (or of n > 1 samples) becomes `rid_<k>`, a list of rids gives one per prompt (with
`_<j>` appended per sample when n > 1), and a missing rid becomes a fresh hex id.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from rlfleet.errors import InvalidInput, ResourceExhausted
from rlfleet_engine.sampling_params import UNTIL_CONTEXT, SamplingParams
from rlfleet_engine.schemas import GenerateRequest, lone_surrogate

T = TypeVar("T")
# Sequences (prompts x n) one request may ask for: far above a GRPO group or an evaluation batch, far
# below what would let a single request hold the engine's memory and scheduler hostage.
MAX_SEQUENCES_PER_REQUEST = 4096
# Prompt tokens over all of those sequences (each prompt counted once per sample: each is prefilled, held and
# matched as a sequence of its own). A few KiB of body with a large n would otherwise ask for millions of
# tokens; this is 128 samples of a 32k-token prompt, or 4096 of a 1k-token one.
MAX_PROMPT_TOKENS_PER_REQUEST = 4_194_304
# Most alternatives reported per output token (`top_logprobs_num`), as vLLM's --max-logprobs bounds them (OpenAI's
# chat API takes 20). Unbounded, a few bytes of body asked for the whole vocabulary at every token: 65536 at each
# of 16 tokens was a 34 MB answer that held a sim engine 30 s, and every request behind it.
MAX_TOP_LOGPROBS_NUM = 256


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def unicode_text(text: str, field: str) -> str:
    """`text`, unless it holds a lone UTF-16 surrogate (`lone_surrogate`): then InvalidInput naming `field`."""
    problem = lone_surrogate(text)
    if problem is not None:
        raise InvalidInput(f"{field}: {problem}")
    return text


def check_vocabulary(ids: Iterable[int], vocab_size: int, field: str) -> None:
    """InvalidInput naming `field` (as the client sent it) unless every id is a token id of the vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"{field} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class JobSpec:
    rid: str
    input_ids: tuple[int, ...]
    """Shared, not copied, by the n samples of a prompt."""
    params: SamplingParams
    prompt_index: int
    """Which prompt of the request this job samples."""
    sample_index: int
    """Which of its prompt's n samples this job is."""
    return_logprob: bool
    top_logprobs_num: int


def expand(req: GenerateRequest, tokenizer: Encoder, vocab_size: int, context_length: int) -> list[JobSpec]:
    """The jobs of `req`; raises InvalidInput naming the field for anything the engine cannot run."""
    size = req.batch_size
    prompts = _prompts(req, tokenizer)
    params = list(_per_prompt(req.sampling_params, size, "sampling_params", SamplingParams()))
    n = params[0].n
    if any(p.n != n for p in params):
        raise InvalidInput("sampling_params: n must be the same for every prompt of a batch")
    if size * n > MAX_SEQUENCES_PER_REQUEST:
        raise ResourceExhausted(
            f"the request asks for {size} prompt(s) x n={n} = {size * n} sequences; at most "
            f"{MAX_SEQUENCES_PER_REQUEST} per request: split it"
        )
    prompt_tokens = sum(len(ids) for ids in prompts) * n
    if prompt_tokens > MAX_PROMPT_TOKENS_PER_REQUEST:
        raise ResourceExhausted(
            f"the request's {size} prompt(s) x n={n} hold {prompt_tokens} prompt tokens; at most "
            f"{MAX_PROMPT_TOKENS_PER_REQUEST} per request (MAX_PROMPT_TOKENS_PER_REQUEST): split it or lower n"
        )
    logprob = _per_prompt(req.return_logprob, size, "return_logprob", False)
    tops = _per_prompt(req.top_logprobs_num, size, "top_logprobs_num", 0)
    starts = _per_prompt(req.logprob_start_len, size, "logprob_start_len", -1)
    if any(s not in (-1, None) for s in starts):
        raise InvalidInput("logprob_start_len: only -1 (output logprobs only) is supported by rlfleet-engine")
    if any(t < 0 for t in tops):
        raise InvalidInput("top_logprobs_num must be >= 0")
    if any(t > MAX_TOP_LOGPROBS_NUM for t in tops):
        raise ResourceExhausted(
            f"top_logprobs_num {max(tops)} asks for more alternatives per token than the {MAX_TOP_LOGPROBS_NUM} an "
            "engine reports (MAX_TOP_LOGPROBS_NUM)"
        )
    rids = _rids(req.rid, size, n, single=not req.is_batch and n == 1)

    for i, ids in enumerate(prompts):
        where = f"input_ids[{i}]" if req.is_batch else "input_ids"
        if not ids:
            raise InvalidInput(f"prompt {i} is empty after tokenization")
        check_vocabulary(ids, vocab_size, where)
        check_vocabulary(params[i].stop_token_ids, vocab_size, "sampling_params.stop_token_ids")
        if params[i].top_k > vocab_size:  # every token, as -1 (SGLang's reading), in a range torch can hold
            params[i] = params[i].model_copy(update={"top_k": vocab_size})
        room = context_length - len(ids)
        if room <= 0:
            raise InvalidInput(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({context_length} tokens)."
            )
        explicit = "max_new_tokens" in params[i].model_fields_set and params[i].max_new_tokens != UNTIL_CONTEXT
        if explicit and params[i].max_new_tokens >= room:
            # SGLang refuses a prompt and a max_new_tokens sent that together reach the context, in these words
            # (clients parse them), which name no field: an OpenAI client sent max_tokens.
            total = len(ids) + params[i].max_new_tokens
            raise InvalidInput(
                f"Requested token count exceeds the model's maximum context length of {context_length} tokens. You "
                f"requested a total of {total} tokens: {len(ids)} tokens from the input messages and "
                f"{params[i].max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit."
            )
        # Then its scheduler cuts every budget, a default or null one too, to what a request of at most
        # context - 1 tokens leaves with one position to spare: room - 2.
        params[i] = params[i].model_copy(update={"max_new_tokens": min(params[i].max_new_tokens, max(0, room - 2))})
    return [
        JobSpec(
            rid=rids[i * n + j],
            input_ids=prompts[i],
            params=params[i],
            prompt_index=i,
            sample_index=j,
            return_logprob=bool(logprob[i]),
            top_logprobs_num=int(tops[i] or 0) if logprob[i] else 0,
        )
        for i in range(size)
        for j in range(n)
    ]


def _prompts(req: GenerateRequest, tokenizer: Encoder) -> list[tuple[int, ...]]:
    """One immutable copy of each prompt's ids, for all its samples to share."""
    if isinstance(req.text, str):
        return [tuple(tokenizer.encode(unicode_text(req.text, "text")))]
    if req.text is not None:
        return [tuple(tokenizer.encode(unicode_text(t, f"text[{i}]"))) for i, t in enumerate(req.text)]
    assert req.input_ids is not None
    if req.is_batch:
        return [tuple(ids) for ids in req.input_ids]  # type: ignore[arg-type]
    return [tuple(req.input_ids)]  # type: ignore[arg-type]


def _per_prompt(value: T | list[T] | None, size: int, name: str, default: T) -> list[T]:
    if value is None:
        return [default] * size
    if isinstance(value, list):
        if len(value) != size:
            raise InvalidInput(f"{name} has {len(value)} entries for a batch of {size} prompts")
        return [default if v is None else v for v in value]
    return [value] * size


def _rids(rid: str | list[str] | None, size: int, n: int, single: bool) -> list[str]:
    total = size * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if rid == "" or (isinstance(rid, list) and "" in rid):
        # /abort_request reads an empty rid as naming no request: such a request could not be aborted by rid.
        raise InvalidInput("rid must not be empty: give a request id, or none for a fresh one")
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{k}" for k in range(total)]
    if len(rid) != size:
        raise InvalidInput(f"rid has {len(rid)} entries for a batch of {size} prompts")
    if len(set(rid)) != len(rid):
        raise InvalidInput(f"rid holds duplicates: {sorted({r for r in rid if rid.count(r) > 1})}")
    return list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]
