"""A streamed job driven by hand as the scheduler drives it: sample ids, check the stop conditions at every token,
publish the job's text after chunks of tokens."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.stop_conditions import FinishReason, token_finish


def stream(job: GenerationJob, tokenizer: Any, ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    """The text of each output a streamed job publishes (see `stream_outputs`)."""
    return [out["text"] for out in stream_outputs(job, tokenizer, ids, chunks)]


def stream_outputs(
    job: GenerationJob, tokenizer: Any, ids: Sequence[int], chunks: Sequence[int]
) -> list[dict[str, Any]]:
    """Each output a streamed job publishes, sampling `ids` and publishing after each of `chunks` tokens, checking
    the stop conditions at every token as the scheduler does; the last output is the finished job's."""
    outputs, pending = [], list(chunks)
    for token in ids:
        job.append(token, -1.0, [], "0")
        reason = token_finish(job.output_ids, job.params, ()) or job.check_stop_strings(tokenizer)
        if reason is not None:
            job.finish_with(reason)
        pending[0] -= 1
        if reason is not None or pending[0] == 0:
            outputs.append(job.output(tokenizer, "0"))
            pending = pending[1:] or [1]
        if reason is not None:
            break
    if job.finish is None:
        job.finish_with(FinishReason("length", length=len(ids)))
        outputs.append(job.output(tokenizer, "0"))
    return outputs


def new_job(**params: Any) -> GenerationJob:
    return GenerationJob(rid="r", input_ids=[1], params=SamplingParams(**params), deliver=lambda out: None, stream=True)


def random_chunks(rng: random.Random, count: int) -> list[int]:
    return [rng.choice([1, 1, 1, 2, 3, 5, 8]) for _ in range(count)]
