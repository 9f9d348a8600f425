"""Fixtures of the load tests: the security tests' launchers (tests/security/launchers.py) on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
for directory in (TESTS, TESTS.parent / "security"):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
