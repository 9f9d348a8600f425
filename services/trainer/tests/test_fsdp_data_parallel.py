"""The single-process parts of the trainer's data parallelism: how a batch is split over ranks,
the rank protocol without a process group, and the sharding helpers on plain modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from rlfleet_trainer.batch import TrainSequence, plan_micro_batches
from rlfleet_trainer.data_parallel import Ranks, micro_batch, rank_plan, split_across_ranks
from rlfleet_trainer.policy import load_policy
from rlfleet_trainer.rank_group import RankGroup
from rlfleet_trainer.sharding import full_state_dict, transformer_blocks

LENGTHS = [40, 3, 3, 25, 7, 7, 7, 12, 1, 30, 5]


def test_split_balances_tokens_and_covers_every_sequence_once() -> None:
    shares = split_across_ranks(LENGTHS, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(LENGTHS)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(LENGTHS[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(LENGTHS) // 2, loads  # longest-first greedy: within half the longest
    assert split_across_ranks(LENGTHS, 3) == shares  # every rank computes the same split
    assert split_across_ranks(LENGTHS, 1) == [list(range(len(LENGTHS)))]


def test_rank_plans_have_equal_length_and_one_rank_plans_as_before() -> None:
    plans = [rank_plan(LENGTHS, 48, 0, Ranks(r, 4)) for r in range(4)]
    assert len({len(plan) for plan in plans}) == 1  # same number of micro-batches on every rank
    assert any(None in plan for plan in plans)  # some rank pads with idle micro-batches
    trained = [i for plan in plans for rows in plan if rows is not None for row in rows for i in row]
    assert sorted(trained) == list(range(len(LENGTHS)))
    assert rank_plan(LENGTHS, 48, 0, Ranks()) == plan_micro_batches(LENGTHS, 48)
    assert rank_plan([5], 48, 0, Ranks(1, 2)) == [None]  # a rank with no share still runs one


def test_idle_micro_batch_trains_nothing() -> None:
    sequences = [TrainSequence(tokens=(5, 6, 7), prompt_len=1, old_logp=(-1.0, -1.0), mask=(1, 1))]
    idle = micro_batch(sequences, None, pad_id=0)
    assert idle.mask.sum() == 0 and idle.seq_ids.tolist() == [0] and idle.input_ids.tolist() == [[0, 0]]
    assert micro_batch(sequences, [[0]], pad_id=0).mask.sum() == 2


def test_rank_group_without_torchrun_calls_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    log: list[str] = []

    def add(state: list[str], item: str) -> int:
        state.append(item)
        return len(state)

    def fail(state: list[str]) -> None:
        raise KeyError("no such thing")

    registry = CollectorRegistry()
    group = RankGroup({"add": add, "fail": fail}, log, registry=registry)
    assert (group.rank, group.ranks.world, group.distributed) == (0, 1, False)
    # Every op's failure count is there at 0 from the start, so a first failure shows in rate() and increase().
    assert registry.get_sample_value("rlfleet_trainer_rank_op_failures_total", {"op": "fail"}) == 0
    assert group.call("add", "a") == 1 and group.call("add", "b") == 2 and log == ["a", "b"]
    with pytest.raises(KeyError, match="no such thing"):
        group.call("fail")
    with pytest.raises(ValueError, match="unknown rank op 'nope'"):
        group.call("nope")
    group.stop()
    with pytest.raises(RuntimeError, match="after the ranks were stopped"):
        group.call("add", "c")
    group.close()
    with pytest.raises(ValueError, match="reserved"):
        RankGroup({"stop": fail}, log)


def test_blocks_and_full_weights_of_a_plain_model(small_model_dir: Path) -> None:
    model = load_policy(small_model_dir)
    blocks = transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * model.config.num_hidden_layers
    weights = full_state_dict(model)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    stack = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)]))
    assert transformer_blocks(stack) == list(stack[1].children())
    with pytest.raises(ValueError, match="cannot tell its blocks apart"):
        transformer_blocks(torch.nn.Linear(2, 2))
