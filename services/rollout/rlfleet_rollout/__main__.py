"""`python -m rlfleet_rollout`: parse the configuration, then import and start the servers."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from rlfleet_rollout.config import config_from_args


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    # Heavy imports (servers, tokenizers) only after the arguments are known to be good: --help stays fast.
    import redis

    from rlfleet.errors import RlfleetError
    from rlfleet.logs import init_logging
    from rlfleet_rollout.orchestrator import serve

    init_logging("rollout", config.log_level)
    # One line per router and reward-hub request would drown the run's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        asyncio.run(serve(config))
    except (redis.ConnectionError, redis.TimeoutError, OSError, RlfleetError) as exc:
        logging.getLogger("rlfleet_rollout").error("cannot start the orchestrator: %s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
