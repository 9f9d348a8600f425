"""The reward hub with the test functions added beside the entry points; same flags as the real one."""

from __future__ import annotations

import sys

from reward_test_functions import TEST_FUNCTIONS

from rlfleet_reward.__main__ import main

if __name__ == "__main__":
    main(sys.argv[1:], extra_functions=TEST_FUNCTIONS)
