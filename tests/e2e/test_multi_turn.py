"""Multi-turn rollouts with the calculator environment through a real fleet: the run trains end to end,
the loss mask is 0 exactly on the calculator's tokens, and the samples on the stream hold the tokens
and logprobs the engines generated (the trainer's recomputed logprobs match them); the episodes leave
nothing in the router's trajectory cache."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from google.protobuf import json_format
from transformers import AutoModelForCausalLM

from rlfleet.char_tokenizer import EOS, SPECIAL_TOKENS, vocabulary
from rlfleet.local_fleet import LocalFleet
from rlfleet.runs_client import RunsClient
from rlfleet.sample_stream import SampleStream, connect_redis
from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.v1.runs_pb2 import RunSpec, RunState
from rlfleet.v1.samples_pb2 import Sample, SampleStatus
from rlfleet_rollout.calculator import calculator

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, GROUPS_PER_STEP, GROUP_SIZE = 2, 2, 4
# A checkpoint trims the groups it trained from the stream; these tests read them back.
FLEET_ENV = {"RLFLEET_TRAINER_KEEP_TRAINED_GROUPS": "true"}
VOCAB = vocabulary()
EOS_ID = VOCAB[EOS]
CHARS = {i: tok for tok, i in VOCAB.items()}


def _encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids if CHARS[i] not in SPECIAL_TOKENS)


def _transcript(rng: random.Random) -> tuple[list[int], list[int]]:
    """`a+b=` `[a+b]<eos>` `=sum\\n` `sum<eos>`: token ids and the mask of what the model should say."""
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    ids, mask = _encode(f"{a}+{b}="), [0] * len(f"{a}+{b}=")
    for part, trained in ((_encode(f"[{a}+{b}]") + [EOS_ID], 1), (_encode(f"={a + b}\n"), 0)):
        ids, mask = ids + part, mask + [trained] * len(part)
    answer = _encode(str(a + b)) + [EOS_ID]
    return ids + answer, mask + [1] * len(answer)


@pytest.fixture(scope="module")
def tool_model_dir(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model taught (a few seconds of supervised steps) to ask the calculator before answering."""
    out = tmp_path_factory.mktemp("tool-model")
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy 2-core machine: more threads only contend
    model = AutoModelForCausalLM.from_pretrained(str(small_model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(200):
        batch = [_transcript(rng) for _ in range(32)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([row + [0] * (width - len(row)) for row, _ in batch])  # (B, T)
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float)[:, 1:]  # (B, T-1)
        logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (small_model_dir / name).exists():
            shutil.copy2(small_model_dir / name, out / name)
    return out


def _segments(sample: Sample) -> list[tuple[int, list[int]]]:
    """The response as maximal runs of equal loss mask: [(mask, token ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, mask in zip(sample.response_token_ids, sample.loss_mask, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
        else:
            runs.append((mask, [token]))
    return runs


def test_calculator_episodes_train_on_the_generated_tokens_only(tool_model_dir: Path, fleet: LocalFleet) -> None:
    api = RunsClient(fleet.api_url, timeout_s=30)
    spec = {
        "name": "multi-turn",
        "model": {"path": str(tool_model_dir)},
        "dataset": {"arithmetic": {"digits": 2, "ops": "+"}, "eval_size": 4},
        "rollout": {
            "function": "multi_turn",
            "multi_turn": {"environment": "calculator", "max_turns": 3},
            "group_size": GROUP_SIZE,
            "groups_per_step": GROUPS_PER_STEP,
            "sampling": {"max_new_tokens": 10},  # "[37+45]<eos>" is 8 tokens; a cut turn ends the episode
        },
        "reward": {"terms": [{"function": "arith_exact"}]},
        "trainer": {"learning_rate": 1e-3},
        "schedule": {"steps": STEPS},
    }
    run = api.wait_final(api.submit(json_format.ParseDict(spec, RunSpec())).id, timeout_s=180)
    assert run.state == RunState.RUN_STATE_SUCCEEDED, run.error
    assert run.progress.weight_version == STEPS
    # Evaluation runs whole episodes too: the taught model answers from the calculator's reply.
    assert [e.step for e in run.evals] == [0, STEPS] and max(e.accuracy for e in run.evals) > 0, list(run.evals)

    client = connect_redis(fleet.config.resolved_redis_url())
    stream = SampleStream(client, run.id, prefix=fleet.config.redis_prefix)
    groups = [entry.group for entry in stream.entries()]
    client.close()
    assert len(groups) == STEPS * GROUPS_PER_STEP
    samples = [s for g in groups for s in g.samples]
    assert all(s.status in (SampleStatus.SAMPLE_STATUS_OK, SampleStatus.SAMPLE_STATUS_TRUNCATED) for s in samples)

    tool_turns = 0
    for sample in samples:
        assert len(sample.loss_mask) == len(sample.response_token_ids) == len(sample.rollout_logprobs)
        segments = _segments(sample)
        assert segments[0][0] == 1 and segments[-1][0] == 1  # the model speaks first and last
        for k, (mask, ids) in enumerate(segments):
            if mask == 0:  # exactly the calculator's reply to the model turn before it
                said = _decode(segments[k - 1][1])
                assert _decode(ids) == calculator.reply(None, [said]), (said, _decode(ids))  # type: ignore[arg-type]
                assert ids == _encode(_decode(ids))  # nothing but the reply's own characters
                tool_turns += 1
            elif k < len(segments) - 1:  # a model turn followed by more asked the calculator
                assert calculator.reply(None, [_decode(ids)]) is not None, _decode(ids)  # type: ignore[arg-type]
        offsets = [i for i, m in enumerate(sample.loss_mask) if m == 0]
        assert all(sample.rollout_logprobs[i] == 0.0 for i in offsets)
        assert int(sample.metadata["turns"]) == 1 + sum(1 for m, _ in segments if m == 0)
    assert tool_turns >= len(samples) // 2, [s.response_text for s in samples]  # the model was taught to call it

    # Each episode deleted its trajectory at the router once it had read it: the cache holds none of them.
    for sample in samples:
        answer = httpx.get(f"{fleet.router_url}/trajectories/{sample.metadata['trajectory_id']}", timeout=10)
        assert answer.status_code == 404, answer.text
    cached = httpx.get(f"{fleet.router_url}/metrics", timeout=10).text
    assert "\nrlfleet_router_trajectories 0.0\n" in cached, [m for m in cached.splitlines() if "trajector" in m]

    # The trainer scored the trained (mask 1) tokens itself: its logprobs match the engines' on them.
    with grpc.insecure_channel(f"127.0.0.1:{fleet.config.ports.trainer_grpc}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        reports = list(stub.WatchSteps(trainer_pb2.WatchStepsRequest(run_id=run.id, from_step=1), timeout=30))
    assert [r.step for r in reports] == list(range(1, STEPS + 1))
    assert all(r.metrics["logprob_diff"] < 1e-3 for r in reports), [r.metrics["logprob_diff"] for r in reports]
