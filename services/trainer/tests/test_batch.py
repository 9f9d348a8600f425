"""Sequences, packed rows and micro-batches: response tokens line up with the positions that
predict them, and packed log-probs equal those of each sequence alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_trainer.batch import TrainSequence, pack, pack_rows, plan_micro_batches, sequences_from_groups
from rlfleet_trainer.policy import load_policy, token_logprobs


def sample(prompt: list[int], response: list[int], reward: float, status=SampleStatus.SAMPLE_STATUS_OK) -> Sample:
    return Sample(
        prompt_token_ids=prompt,
        response_token_ids=response,
        rollout_logprobs=[-0.1 * (i + 1) for i in range(len(response))],
        loss_mask=[1] * len(response),
        reward=reward,
        status=status,
    )


def test_alignment_in_a_packed_row() -> None:
    group = SampleGroup(group_id="g", run_id="r", samples=[sample([5, 6, 7], [8, 9], 1.0), sample([5], [4], 0.0)])
    seqs = sequences_from_groups([group])
    batch = pack(seqs, [[0, 1]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 5, 4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # response tokens 8, 9 are predicted at positions 2, 3; token 4 (second sequence) at position 5
    assert batch.index.tolist() == [[2, 3], [5, 0]]
    assert batch.targets.flatten()[batch.index].tolist() == [[8, 9], [4, 6]]  # the 6 fills a masked-out slot
    assert batch.mask.tolist() == [[1, 1], [1, 0]]
    assert torch.allclose(batch.old_logp, torch.tensor([[-0.1, -0.2], [-0.1, 0.0]]))
    allowed = batch.attention_mask[0, 0] == 0  # (L, L)
    assert allowed[6].tolist() == [False] * 5 + [True, True]  # the second sequence never sees the first
    assert allowed[4].tolist() == [True] * 5 + [False, False]
    assert batch.tokens == 7


def test_failed_samples_are_left_out_and_groups_are_numbered() -> None:
    failed = sample([1], [4], 0.0, status=SampleStatus.SAMPLE_STATUS_FAILED)
    groups = [
        SampleGroup(group_id="a", run_id="r", samples=[sample([1], [2], 1.0), sample([1], [3], 0.0), failed]),
        SampleGroup(group_id="b", run_id="r", samples=[sample([2], [2], 1.0)], weight=0.5),
    ]
    seqs = sequences_from_groups(groups)
    assert [(s.tokens, s.group, s.weight, s.reward) for s in seqs] == [
        ((1, 2), 0, 1.0, 1.0),
        ((1, 3), 0, 1.0, 0.0),
        ((2, 2), 1, 0.5, 1.0),
    ]


def test_rows_are_first_fit_decreasing_and_micro_batches_respect_the_budget() -> None:
    lengths = [3, 9, 4, 5, 2, 7]
    assert pack_rows(lengths, 9) == [[1], [5, 4], [3, 2], [0]]
    plan = plan_micro_batches(lengths, token_budget=20)
    assert sorted(i for mb in plan for row in mb for i in row) == list(range(len(lengths)))
    for mb in plan:
        longest = max(sum(lengths[i] for i in row) for row in mb)
        assert len(mb) == 1 or len(mb) * longest <= 20
    assert plan_micro_batches([50, 3], token_budget=20) == [[[0]], [[1]]]  # a row over budget goes alone


def random_sequences(lengths: list[tuple[int, int]], seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, prompt in lengths:
        tokens = torch.randint(3, 30, (n,), generator=g).tolist()
        out.append(
            TrainSequence(
                tokens=tuple(tokens), prompt_len=prompt, old_logp=(0.0,) * (n - prompt), mask=(1,) * (n - prompt)
            )
        )
    return out


@pytest.mark.parametrize("row_tokens", [0, 40])
def test_packed_logprobs_equal_unpacked(small_model_dir: Path, row_tokens: int) -> None:
    model = load_policy(small_model_dir)
    seqs = random_sequences([(9, 4), (5, 2), (17, 6), (3, 1), (8, 3), (12, 5)])
    plan = plan_micro_batches([len(s.tokens) for s in seqs], token_budget=64, row_tokens=row_tokens)
    assert any(len(row) > 1 for mb in plan for row in mb), "the test must pack sequences together"
    with torch.no_grad():
        for rows in plan:
            batch = pack(seqs, rows, pad_id=0)
            scored = token_logprobs(model, batch, temperature=0.7, with_entropy=True)
            for b, i in enumerate(batch.seq_ids.tolist()):
                seq = seqs[i]
                logits = model(torch.tensor([seq.tokens])).logits[0, :-1] / 0.7  # plain, unpacked forward
                logp = torch.log_softmax(logits, -1)
                positions = range(seq.prompt_len - 1, len(seq.tokens) - 1)
                alone = torch.stack([logp[p, seq.tokens[p + 1]] for p in positions])
                entropy = torch.stack([-(logp[p].exp() * logp[p]).sum() for p in positions])
                assert torch.allclose(scored.logp[b, : seq.response_len], alone, atol=1e-5)
                assert torch.allclose(scored.entropy[b, : seq.response_len], entropy, atol=1e-5)
