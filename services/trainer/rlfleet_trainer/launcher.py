"""`python -m rlfleet_trainer.launcher ARGS`: torchrun (`torch.distributed.run`) with ARGS, stopping quietly.

torchrun answers SIGTERM by stopping its ranks (each rank's trainer checkpoints its run first, within
--shutdown-timeout) and then lets a SignalException out of its main: a traceback and exit code 1 on every clean
stop of the trainer (`docker stop`, a pod deleted, `rlfleet down`), which reads like a crash. Here such a
stop ends with one line and the signal's exit code (128 + N); anything else is torchrun's own behaviour.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


def launch(argv: list[str] | None = None) -> int:
    try:
        main(argv)
    except SignalException as exc:
        # torchrun has stopped the ranks by now (SimpleElasticAgent.run shuts them down before re-raising).
        print(f"torchrun stopped by {exc.sigval.name}: its ranks have ended", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(launch())
