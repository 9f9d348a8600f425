"""A streamed job with return_text_in_logprobs publishes every token's text at every output: each token id is
decoded once per job, not once per output (which made a long stream quadratic in decodes)."""

from __future__ import annotations

from collections.abc import Sequence

from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.sampling_params import SamplingParams


class CountingTokenizer:
    def __init__(self) -> None:
        self.single_token_decodes = 0

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) == 1 and not skip_special_tokens:  # a token's text (the output's text skips them)
            self.single_token_decodes += 1
        return "".join(chr(ord("a") + token_id % 26) for token_id in token_ids)


def test_each_token_text_is_decoded_once_per_job_however_many_outputs_publish_it() -> None:
    tokenizer = CountingTokenizer()
    job = GenerationJob(
        rid="r",
        input_ids=[3],
        params=SamplingParams(max_new_tokens=200),
        deliver=lambda out: None,
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        stream=True,
    )
    outputs = []
    for step in range(100):
        token = step % 40  # 40 distinct ids, among them those of the top logprobs
        job.append(token, -0.5, [(-0.5, token), (-1.5, (token + 1) % 40)], "0")
        outputs.append(job.output(tokenizer, "0"))
    assert tokenizer.single_token_decodes == 40
    last = outputs[-1]["meta_info"]
    assert [text for _, _, text in last["output_token_logprobs"]] == [chr(ord("a") + n % 40 % 26) for n in range(100)]
    assert last["output_top_logprobs"][-1] == [[-0.5, 19, "t"], [-1.5, 20, "u"]]
