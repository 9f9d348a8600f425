"""Sequences and micro-batches line up response tokens with the positions that predict them."""

from __future__ import annotations

import torch

from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_trainer.batch import collate, micro_batches, sequences_from_groups


def sample(prompt: list[int], response: list[int], reward: float, status=SampleStatus.SAMPLE_STATUS_OK) -> Sample:
    return Sample(
        prompt_token_ids=prompt,
        response_token_ids=response,
        rollout_logprobs=[-0.1 * (i + 1) for i in range(len(response))],
        loss_mask=[1] * len(response),
        reward=reward,
        status=status,
    )


def test_alignment_on_the_target_grid() -> None:
    group = SampleGroup(group_id="g", run_id="r", samples=[sample([5, 6, 7], [8, 9], 1.0), sample([5], [4], 0.0)])
    seqs = sequences_from_groups([group])
    batch = collate(seqs, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 9], [4, 0, 0, 0]]
    # response tokens 8, 9 are predicted at positions 2, 3; token 4 at position 0
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert torch.allclose(batch.old_logp, torch.tensor([[0, 0, -0.1, -0.2], [-0.1, 0, 0, 0]]))
    assert batch.advantages[0] > 0 > batch.advantages[1]


def test_failed_samples_are_left_out_of_advantages_and_loss() -> None:
    group = SampleGroup(
        group_id="g",
        run_id="r",
        samples=[
            sample([1], [2], 1.0),
            sample([1], [3], 0.0),
            sample([1], [4], 0.0, status=SampleStatus.SAMPLE_STATUS_FAILED),
        ],
    )
    seqs = sequences_from_groups([group])
    assert [s.tokens for s in seqs] == [(1, 2), (1, 3)]
    assert seqs[0].advantage == -seqs[1].advantage


def test_group_weight_scales_advantages_and_zero_means_one() -> None:
    samples = [sample([1], [2], 1.0), sample([1], [3], 0.0)]
    full = sequences_from_groups([SampleGroup(group_id="a", run_id="r", samples=samples)])
    half = sequences_from_groups([SampleGroup(group_id="b", run_id="r", samples=samples, weight=0.5)])
    assert half[0].advantage == 0.5 * full[0].advantage


def test_micro_batches_respect_the_token_budget() -> None:
    group = SampleGroup(group_id="g", run_id="r", samples=[sample([1] * n, [2], float(n)) for n in (3, 9, 4, 5, 2)])
    seqs = sequences_from_groups([group])
    chunks = micro_batches(seqs, token_budget=12)
    assert sorted(len(s.tokens) for c in chunks for s in c) == sorted(len(s.tokens) for s in seqs)
    for chunk in chunks:
        assert len(chunk) == 1 or len(chunk) * max(len(s.tokens) for s in chunk) <= 12
