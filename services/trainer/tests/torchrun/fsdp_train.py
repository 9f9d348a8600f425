"""Run under torchrun by test_fsdp_equivalence.py: trains fixed global batches through the rank
protocol and writes, per case, each step's metrics and the final full weights (rank 0).

    torchrun --standalone --nproc_per_node=N fsdp_train.py MODEL_DIR OUT_FILE

With one rank the model stays whole (no FSDP); with more it is sharded, so the two outputs can be
compared. The critic's head is written too: it is replicated and its gradients summed. Each case
changes the algorithm so every sharded path runs: a KL loss with a sharded reference, PPO's critic
with the gradient-free pass over the KL and values, activation checkpointing, mixed precision, and
several updates per batch (mini-batches over two epochs, the pre-update log-probs TIS needs).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from google.protobuf import json_format

from rlfleet.run_spec import resolve, validate
from rlfleet.v1.runs_pb2 import RunSpec
from rlfleet.v1.samples_pb2 import Sample, SampleGroup, SampleStatus
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.rank_group import Op, RankGroup
from rlfleet_trainer.rank_ops import RANK_OPS, RankState, ShardingOptions

STEPS = 2
CASES: dict[str, tuple[dict[str, Any], ShardingOptions, dict[str, Any]]] = {
    "grpo_kl_loss": ({"name": "grpo", "kl_coef": 0.05, "entropy_coef": 0.01}, ShardingOptions(), {}),
    "ppo_kl_reward": ({"name": "ppo", "kl_coef": 0.05}, ShardingOptions(), {}),
    "dapo_recompute": ({"name": "dapo"}, ShardingOptions(activation_checkpointing=True), {}),
    # bf16 compute: only close to fp32, so the test compares it loosely.
    "grpo_bf16": ({"name": "grpo"}, ShardingOptions(mixed_precision=True), {}),
    "ppo_tis_updates": ({"name": "ppo", "tis_cap": 2.0}, ShardingOptions(), {"mini_batches": 2, "epochs": 2}),
}


def spec_for(model_dir: str, algorithm: dict[str, Any], trainer: dict[str, Any]) -> RunSpec:
    spec = json_format.ParseDict(
        {
            "model": {"path": model_dir},
            "dataset": {"arithmetic": {}},
            "rollout": {"group_size": 4, "groups_per_step": 5, "sampling": {"max_new_tokens": 48}},
            "reward": {"terms": [{"function": "arith_exact"}]},
            "algorithm": algorithm,
            "trainer": {"learning_rate": 1e-3, "micro_batch_tokens": 96, "seed": 3, **trainer},
            "schedule": {"steps": STEPS},
        },
        RunSpec(),
    )
    spec = resolve(spec)
    validate(spec)
    return spec


def global_batch(model_dir: str, step: int) -> list[SampleGroup]:
    """Five groups of four with skewed response lengths (1 to 40 tokens), a failed sample, and
    rollout log-probs near the model's own, so ratios sit both inside and outside the clip range."""
    rng = random.Random(step)
    model = load_policy(model_dir)
    groups = []
    for g in range(5):
        prompt = [rng.randrange(4, 40) for _ in range(rng.randrange(2, 9))]
        samples = []
        for j in range(4):
            response = [rng.randrange(4, 40) for _ in range(rng.choice([1, 3, 8, 20, 40]))]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0, :-1], -1)
            old = [float(logp[len(prompt) - 1 + k, t]) + rng.uniform(-0.3, 0.3) for k, t in enumerate(response)]
            status = SampleStatus.SAMPLE_STATUS_FAILED if (g, j) == (2, 3) else SampleStatus.SAMPLE_STATUS_OK
            samples.append(
                Sample(
                    sample_id=f"{g}-{j}",
                    index=j,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    rollout_logprobs=old,
                    loss_mask=[int(rng.random() > 0.1) for _ in response],
                    reward=float(rng.random() > 0.5) + 0.1 * j,
                    status=status,
                )
            )
        groups.append(SampleGroup(group_id=f"s{step}-g{g}", samples=samples, weight=1.0 if g else 0.5))
    return groups


def set_options(state: RankState, options: ShardingOptions) -> None:
    state.options = options


def critic_weights(state: RankState) -> dict[str, torch.Tensor]:
    critic = state.require_policy().step.critic
    return {} if critic is None else {k: v.clone() for k, v in critic.head.state_dict().items()}


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    ops: dict[str, Op] = {**RANK_OPS, "set_options": set_options, "critic_weights": critic_weights}
    group = RankGroup(ops, RankState(ShardingOptions()), timeout_s=120)
    if group.rank != 0:
        group.follow()
        group.close()
        return
    batches = [global_batch(model_dir, step) for step in range(STEPS)]
    results = {}
    for name, (algorithm, options, trainer) in CASES.items():
        group.call("set_options", options)
        group.call("load_run", spec_for(model_dir, algorithm, trainer))
        steps = [group.call("train_step", batch, step) for step, batch in enumerate(batches, start=1)]
        weights = group.call("full_state_dict")
        results[name] = {"steps": steps, "weights": weights, "critic": group.call("critic_weights")}
        group.call("unload_run")
    group.stop()
    group.close()
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
