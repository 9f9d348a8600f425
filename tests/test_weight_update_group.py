"""The weight update group meets an engine that joins as SGLang's do, and opens again under its name.

SGLang's engine (sglang/srt/utils/common.py, `init_custom_process_group`, called by its weight updater) reaches
the trainer's store through torch's tcp:// rendezvous, puts it under a prefix of the group's name and builds the
group with torch's own constructor; `broadcast` then receives through it. A trainer whose group is built any
other way waits on keys that engine never writes, and every push falls back to disk after the group's timeout.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlfleet.weight_update_group import join_group, rendezvous, send

TIMEOUT_S = 20.0

# The engine's side, as SGLang joins: rank 1 of 2 over gloo, then one broadcast of 4 floats from rank 0.
SGLANG_ENGINE = """
import datetime, os, sys
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

port, name, timeout = int(sys.argv[1]), sys.argv[2], datetime.timedelta(seconds=float(sys.argv[3]))
store, rank, world_size = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
group, _ = _new_process_group_helper(
    world_size, rank, [], Backend("gloo"), dist.PrefixStore(name, store), group_name=name, timeout=timeout
)
_world.pg_group_ranks[group] = {r: r for r in range(world_size)}
received = torch.empty(4)
dist.broadcast(received, src=0, group=group)
print(received.tolist(), flush=True)
# Out at once, the group kept as SGLang keeps it until told: gloo can abort a process that destroys its group while
# the peer is still in the collective ("terminate called without an active exception").
os._exit(0)
"""


def sglang_engine(port: int, name: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", SGLANG_ENGINE, str(port), name, str(TIMEOUT_S)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_push_reaches_an_engine_that_joins_as_sglang_does() -> None:
    store = rendezvous("127.0.0.1", 0, host=True, timeout_s=TIMEOUT_S)
    engine = sglang_engine(store.port, "rlfleet-trainer")
    group = None
    try:
        group = join_group(store, 0, 2, "rlfleet-trainer", "gloo", TIMEOUT_S)
        send(group, [torch.tensor([1.0, 2.0, 3.0, 4.0])], flattened=False)
        out, err = engine.communicate(timeout=TIMEOUT_S + 10)
        assert engine.returncode == 0, err[-2000:]
        assert out.strip() == "[1.0, 2.0, 3.0, 4.0]"
    finally:
        engine.kill()
        engine.wait(10)
        if group is not None:  # a group left open in this process would refuse later tests' groups of its name
            group.abort()


@pytest.mark.parametrize("ending", ["close", "abort"])
def test_a_group_opens_again_under_its_name_once_closed_or_aborted(ending: str) -> None:
    """A trainer reopens its group under the same name every time the engines change, and after a failed push;
    torch registers a group by name, so one still registered refused the next."""
    for _ in range(2):
        store = rendezvous("127.0.0.1", 0, host=True, timeout_s=TIMEOUT_S)
        group = join_group(store, 0, 1, "reopened", "gloo", TIMEOUT_S)
        group.abort() if ending == "abort" else group.close()
    store = rendezvous("127.0.0.1", 0, host=True, timeout_s=TIMEOUT_S)
    open_group = join_group(store, 0, 1, "open", "gloo", TIMEOUT_S)
    with pytest.raises(ValueError, match="'open' is open in this process already"):
        join_group(store, 0, 1, "open", "gloo", TIMEOUT_S)
    open_group.close()
