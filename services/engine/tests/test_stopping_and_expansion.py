"""Stop handling and request expansion without HTTP or a model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rlfleet.errors import InvalidInput, ResourceExhausted
from rlfleet_engine import request_expansion
from rlfleet_engine.generation_job import GenerationJob
from rlfleet_engine.request_expansion import expand
from rlfleet_engine.sampling_params import SamplingParams
from rlfleet_engine.schemas import GenerateRequest
from rlfleet_engine.stop_conditions import FinishReason, partial_stop_length, token_finish

EOS = 1


class CharTokenizer:
    """ids 3.. are 'a', 'b', ...; 1 is eos (special)."""

    decodes_token_by_token = True
    """A running job publishes its text as it is decoded (a tokenizer not known to decode locally publishes none)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") + 3 for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "" if t == EOS and skip_special_tokens else "<eos>" if t == EOS else chr(t - 3 + 97) for t in token_ids
        )


def ids(text: str) -> list[int]:
    return CharTokenizer().encode(text)


def run(job: GenerationJob, tokens: list[int]) -> GenerationJob:
    """Feeds tokens until the job finishes, as the scheduler does."""
    for token in tokens:
        job.append(token, -1.0, [], "0")
        reason = token_finish(job.output_ids, job.params, {EOS}) or job.check_stop_strings(CharTokenizer())
        if reason:
            job.finish_with(reason)
            break
    return job


def new_job(**params: object) -> GenerationJob:
    return GenerationJob(rid="r", input_ids=[3], params=SamplingParams(**params), deliver=lambda out: None)


def test_length_is_checked_before_eos() -> None:
    reason = token_finish([5, EOS], SamplingParams(max_new_tokens=2), {EOS})
    assert reason == FinishReason("length", length=2)
    assert reason.to_json() == {"type": "length", "length": 2}


def test_eos_stops_unless_ignored() -> None:
    assert token_finish([5, EOS], SamplingParams(), {EOS}).to_json() == {"type": "stop", "matched": EOS}
    assert token_finish([5, EOS], SamplingParams(ignore_eos=True), {EOS}) is None


def test_ignore_eos_turns_off_stop_token_ids_too() -> None:
    params = SamplingParams(ignore_eos=True, stop_token_ids=[7])
    assert token_finish([5, 7], params, {EOS}) is None
    assert token_finish([5, 7], SamplingParams(stop_token_ids=[7]), {EOS}) == FinishReason("stop", matched=7)
    job = run(new_job(ignore_eos=True, stop=["bc"], stop_token_ids=ids("b")), ids("abcd"))
    assert job.finish == FinishReason("stop", matched="bc"), "stop strings still apply"


def test_stop_token_ids_stop_and_are_trimmed_from_text_but_not_ids() -> None:
    job = run(new_job(stop_token_ids=[ids("c")[0]]), ids("abcd"))
    assert job.finish == FinishReason("stop", matched=ids("c")[0])
    out = job.output(CharTokenizer(), "v1")
    assert out["text"] == "ab" and out["output_ids"] == ids("abc")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids("c")[0]}
    assert out["meta_info"]["weight_version"] == "v1"


def test_stop_string_is_found_across_tokens_and_trimmed() -> None:
    job = run(new_job(stop=["cd", "zz"]), ids("abcdef"))
    assert job.finish == FinishReason("stop", matched="cd")
    assert job.text(CharTokenizer()) == "ab"
    assert job.output_ids == ids("abcd")


def test_no_stop_trim_keeps_the_stop_string() -> None:
    job = run(new_job(stop=["cd"], no_stop_trim=True), ids("abcdef"))
    assert job.text(CharTokenizer()) == "abcd"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_special_token_stop_string_matches_and_is_trimmed(skip_special_tokens: bool) -> None:
    tokens = [*ids("ab"), EOS, *ids("cd")]
    job = run(new_job(stop=["<eos>"], ignore_eos=True, skip_special_tokens=skip_special_tokens), tokens)
    assert job.finish == FinishReason("stop", matched="<eos>")
    assert job.output_ids == [*ids("ab"), EOS] and job.text(CharTokenizer()) == "ab"
    # A stop string that starts before the special token is cut where it starts.
    job = run(new_job(stop=["b<eos>"], ignore_eos=True, skip_special_tokens=skip_special_tokens), tokens)
    assert job.finish == FinishReason("stop", matched="b<eos>") and job.text(CharTokenizer()) == "a"


def test_a_running_job_holds_back_what_may_become_a_stop_string() -> None:
    job = new_job(stop=["cde", "xy"])
    texts = []
    for token in ids("abcdxcdy"):
        run(job, [token])
        texts.append(job.text(CharTokenizer()))
    assert texts == ["a", "ab", "ab", "ab", "abcd", "abcdx", "abcdx", "abcdxcdy"]
    job = run(new_job(stop=["b<eos>"], ignore_eos=True), ids("ab"))
    assert job.text(CharTokenizer()) == "a"
    assert partial_stop_length("xxab", ["abc", "bcd"]) == 2 and partial_stop_length("xxab", ["ab"]) == 0


class ByteTokenizer:
    """ids 0..255 are bytes, decoded as UTF-8 with U+FFFD for what does not decode, as byte-level BPE decodes."""

    decodes_token_by_token = True
    """Decodes locally, as byte-level BPE: a byte's text depends only on the bytes of its character."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def streamed_texts(job: GenerationJob, tokens: bytes) -> list[str]:
    """The text of each output the job publishes as it samples `tokens` one by one (the last when it finishes)."""
    texts = []
    for token in tokens:
        job.append(token, -1.0, [], "0")
        reason = token_finish(job.output_ids, job.params, ()) or job.check_stop_strings(ByteTokenizer())
        if reason:
            job.finish_with(reason)
        texts.append(job.text(ByteTokenizer()))
        if reason:
            break
    return texts


@pytest.mark.parametrize(
    ("params", "final"),
    [
        ({}, "aé中z"),
        ({"stop": ["中z"]}, "aé"),
        ({"stop": ["z"]}, "aé中"),
        ({"stop": ["é"]}, "a"),
        ({"max_new_tokens": 4}, "aé\ufffd"),  # finished mid-character: the whole decode
    ],
)
def test_a_running_job_holds_back_a_character_still_missing_bytes(params: dict[str, object], final: str) -> None:
    texts = streamed_texts(new_job(**params), "aé中z".encode())
    assert texts[-1] == final
    assert all(final.startswith(text) for text in texts), texts
    assert "\ufffd" not in "".join(texts[:-1])


def test_the_stop_string_completed_first_ends_the_job_and_of_two_the_first_listed() -> None:
    job = run(new_job(stop=["yy", "ab"]), ids("xxabyy"))
    assert (job.finish, job.output_ids, job.text(CharTokenizer())) == (
        FinishReason("stop", matched="ab"),
        ids("xxab"),
        "xx",
    )
    # "bc" and "abc" both end at "c": SGLang checks them in their order and cuts the text where the match begins.
    for stops, text in ((["bc", "abc"], "xa"), (["abc", "bc"], "x")):
        job = run(new_job(stop=stops), ids("xabcd"))
        assert (job.finish, job.output_ids, job.text(CharTokenizer())) == (
            FinishReason("stop", matched=stops[0]),
            ids("xabc"),
            text,
        )


def test_a_stop_string_is_found_by_the_tokens_that_end_it_after_a_long_output() -> None:
    """Only the newest tokens are decoded for the check, each byte a token here (3 for 中)."""
    job = new_job(stop=["中z"], max_new_tokens=10_000)
    texts = streamed_texts(job, ("é" * 3000 + "中z!").encode())
    assert job.finish == FinishReason("stop", matched="中z") and texts[-1] == "é" * 3000
    assert len(job.output_ids) == 6000 + 4


def test_abort_reason_shape() -> None:
    assert FinishReason("abort", message="gone").to_json() == {"type": "abort", "message": "gone"}


def expand_request(body: dict[str, object], context: int = 64) -> list:
    return expand(GenerateRequest(**body), CharTokenizer(), vocab_size=40, context_length=context)


def test_batch_with_n_is_prompt_major_with_sglang_rids() -> None:
    specs = expand_request({"text": ["ab", "c"], "sampling_params": {"n": 2, "max_new_tokens": 4}, "rid": "q"})
    assert [s.rid for s in specs] == ["q_0", "q_1", "q_2", "q_3"]
    assert [list(s.input_ids) for s in specs] == [ids("ab"), ids("ab"), ids("c"), ids("c")]


def test_the_samples_of_a_prompt_share_one_immutable_copy_of_it() -> None:
    specs = expand_request({"text": ["ab", "c"], "sampling_params": {"n": 3}})
    assert specs[0].input_ids is specs[1].input_ids is specs[2].input_ids and isinstance(specs[0].input_ids, tuple)
    assert specs[3].input_ids is not specs[0].input_ids


def test_a_request_over_the_prompt_token_bound_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_expansion, "MAX_PROMPT_TOKENS_PER_REQUEST", 100)
    assert len(expand_request({"input_ids": [3] * 25, "sampling_params": {"n": 4}})) == 4  # 100 tokens
    with pytest.raises(ResourceExhausted, match=r"2 prompt\(s\) x n=4 hold 104 prompt tokens; at most 100"):
        expand_request({"input_ids": [[3] * 25, [4]], "sampling_params": {"n": 4}})


def test_more_top_logprobs_per_token_than_the_bound_are_refused_naming_it() -> None:
    """A few bytes of body asked for the whole vocabulary at every token: 34 MB for 16 tokens, 30 s of a sim engine."""
    top = request_expansion.MAX_TOP_LOGPROBS_NUM
    assert (
        expand_request({"input_ids": [3], "return_logprob": True, "top_logprobs_num": top})[0].top_logprobs_num == top
    )
    with pytest.raises(
        ResourceExhausted, match=rf"^top_logprobs_num {top + 1} asks for more .* than the {top} an engine"
    ):
        expand_request({"input_ids": [[3], [4]], "return_logprob": True, "top_logprobs_num": [1, top + 1]})


def test_single_prompt_keeps_its_rid_and_lists_of_rids_get_sample_suffixes() -> None:
    assert [s.rid for s in expand_request({"input_ids": [3, 4], "rid": "one"})] == ["one"]
    specs = expand_request({"input_ids": [[3], [4]], "rid": ["a", "b"], "sampling_params": {"n": 2}})
    assert [s.rid for s in specs] == ["a_0", "a_1", "b_0", "b_1"]


def test_per_prompt_sampling_params_and_logprob_flags() -> None:
    specs = expand_request(
        {
            "input_ids": [[3], [4]],
            "sampling_params": [{"temperature": 0}, {"top_k": 5}],
            "return_logprob": [True, False],
            "top_logprobs_num": 3,
        }
    )
    assert specs[0].params.is_greedy and specs[1].params.top_k == 5
    assert (specs[0].return_logprob, specs[0].top_logprobs_num) == (True, 3)
    assert (specs[1].return_logprob, specs[1].top_logprobs_num) == (False, 0)


def test_a_budget_is_cut_to_what_the_context_leaves_but_one_sent_reaching_it_is_refused() -> None:
    """As SGLang: a prompt and a max_new_tokens sent that together reach the context are refused (its tokenizer
    manager's check), and every budget is cut to the context less the prompt less 2 (its scheduler's)."""
    assert expand_request({"input_ids": [3] * 60})[0].params.max_new_tokens == 2
    # A null budget asks for everything the context leaves.
    specs = expand_request({"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": None}})
    assert specs[0].params.max_new_tokens == 52
    assert (
        expand_request({"input_ids": [3] * 60, "sampling_params": {"max_new_tokens": 3}})[0].params.max_new_tokens == 2
    )
    for budget in (4, 5):  # 60 + 4 reaches the context of 64: the orchestrator's cut to 4 was taken, SGLang's 400
        with pytest.raises(InvalidInput, match="maximum context length"):
            expand_request({"input_ids": [3] * 60, "sampling_params": {"max_new_tokens": budget}})


def test_a_top_k_past_the_vocabulary_is_clamped_to_it() -> None:
    specs = expand_request({"input_ids": [[3], [4]], "sampling_params": [{"top_k": 2**63}, {"top_k": 7}]})
    assert [s.params.top_k for s in specs] == [40, 7]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": [3, 99]}, "token id 99"),
        ({"input_ids": [3] * 64}, "context length"),
        ({"input_ids": [3] * 10, "sampling_params": {"max_new_tokens": 60}}, "maximum context length"),
        ({"input_ids": [[3], [4]], "sampling_params": [{}]}, "sampling_params has 1 entries"),
        ({"input_ids": [[3], [4]], "rid": ["a", "a"]}, "duplicates"),
        ({"input_ids": [3], "rid": ""}, "rid must not be empty"),
        ({"input_ids": [[3], [4]], "rid": ["a", ""]}, "rid must not be empty"),
        ({"input_ids": [[3], [4]], "sampling_params": [{"n": 1}, {"n": 2}]}, "n must be the same"),
        ({"input_ids": [3], "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": [3], "sampling_params": {"stop_token_ids": [-5]}}, "stop_token_ids holds token id -5"),
        ({"input_ids": [3], "sampling_params": {"stop_token_ids": [4, 40]}}, "stop_token_ids holds token id 40"),
    ],
)
def test_requests_the_engine_cannot_run_name_the_problem(body: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=fragment):
        expand_request(body)
