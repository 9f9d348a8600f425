"""Small SampleGroups scored by a real model, for the trainer's step tests."""

from __future__ import annotations

import torch

from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus


def scored_groups(model: torch.nn.Module, count: int, noise: float = 0.0) -> list[SampleGroup]:
    """`count` groups of four responses of different lengths, rewards mixed within every group, rollout
    log-probs `model`'s own plus Gaussian `noise` (as an engine's numerics would give; 0: exactly its own)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = [20 + i, 15, 21, 33]
        samples = []
        for j in range(4):
            response = [22 + j, 23, 24 + i, 1][: 2 + (i + j) % 3]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0, :-1], -1)
            picked = [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(response)]
            if noise:
                picked = [p + noise * float(torch.randn(1, generator=g)) for p in picked]
            samples.append(
                Sample(
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    rollout_logprobs=picked,
                    loss_mask=[1] * len(response),
                    reward=float((i + j) % 2),
                    status=SampleStatus.SAMPLE_STATUS_OK,
                )
            )
        out.append(SampleGroup(group_id=f"g{i}", run_id="r", samples=samples))
    return out
