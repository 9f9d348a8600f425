from __future__ import annotations

import pytest
from reward_test_functions import TEST_FUNCTIONS

from rlfleet.errors import InvalidInput
from rlfleet_reward.arith_exact import ARITH_EXACT, score_arith_exact
from rlfleet_reward.math_answer import MATH
from rlfleet_reward.registry import Registry
from rlfleet_reward.reward_function import RewardFunction


def test_entry_points_provide_the_builtins_and_nothing_from_tests() -> None:
    registry = Registry.from_entry_points()
    assert registry.get("arith_exact") is ARITH_EXACT
    assert registry.get("math") is MATH
    builtins = {"boxed", "exact", "numeric", "f1", "multiple_choice", "format", "code", "remote", "judge"}
    assert builtins <= set(registry)
    # Network-bound functions run on the event loop; the others in worker processes.
    assert {name for name, function in registry.items() if function.waits_on_io} == {"remote", "judge"}
    assert set(registry.pool_functions()) == set(registry) - {"remote", "judge"}
    assert not set(TEST_FUNCTIONS) & set(registry)


def test_extra_functions_join_without_shadowing() -> None:
    registry = Registry.from_entry_points(extra=TEST_FUNCTIONS)
    assert set(registry) >= {"arith_exact", "math", "hang"}
    with pytest.raises(ValueError, match="already registered"):
        Registry.from_entry_points(extra={"math": ARITH_EXACT})


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(InvalidInput, match="unknown reward function 'nope'; known: arith_exact, boxed, code, "):
        Registry.from_entry_points().get("nope")


def test_registry_accepts_only_declared_functions() -> None:
    with pytest.raises(TypeError, match="not a RewardFunction"):
        Registry({"bare": score_arith_exact})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("inputs", "description", "message"),
    [
        ({"response", "answer"}, "ok", "'answer'"),
        (set(), "ok", "at least one input"),
        ({"response"}, " ", "description"),
    ],
)
def test_declarations_are_checked(inputs: set[str], description: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardFunction(fn=score_arith_exact, inputs=frozenset(inputs), description=description)
