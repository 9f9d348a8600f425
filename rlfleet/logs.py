"""One logging setup for every rlfleet process: plain lines on a terminal, JSON lines elsewhere.

JSON records carry the service name plus any `run_id`, `step` and `request_id` passed through
`extra=`; set RLFLEET_LOG_FORMAT=json|text to override the automatic choice. A service's level is its
own `--log-level` setting (`LogLevel`); RLFLEET_LOG_LEVEL sets it where there is none (the trainer, the CLI).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Annotated

from pydantic import AfterValidator

LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_HELP = f"Log level: {', '.join(LEVELS)} (default info)."
"""Help of every service's --log-level flag."""


def _known_level(level: str) -> str:
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: must be one of {', '.join(LEVELS)}")
    return level.lower()


LogLevel = Annotated[str, AfterValidator(_known_level)]
"""A service's log-level setting: one of LEVELS, in any case (a typo is refused with the settings' other errors)."""

CONTEXT_FIELDS = ("run_id", "step", "request_id")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in CONTEXT_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


SERVICE_HANDLER = "rlfleet"
"""Name of the handler init_logging puts on the root logger."""


def init_logging(service: str, level: str | None = None) -> None:
    """Configures the root logger once for `service` (safe to call again: it replaces handlers)."""
    fmt = os.environ.get("RLFLEET_LOG_FORMAT") or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(SERVICE_HANDLER)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("RLFLEET_LOG_LEVEL") or "INFO").upper())
    # Access logs of every request drown the service's own lines; keep them at warning.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
