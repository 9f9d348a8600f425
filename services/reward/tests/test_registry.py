from __future__ import annotations

from typing import Any

import pytest
from reward_test_functions import TEST_FUNCTIONS

from rlfleet.errors import InvalidInput
from rlfleet_reward.arith_exact import ARITH_EXACT, score_arith_exact
from rlfleet_reward.llm_judge import ask_judge, score_verdict
from rlfleet_reward.math_answer import MATH
from rlfleet_reward.registry import Registry
from rlfleet_reward.reward_function import RewardFunction


def test_entry_points_provide_the_builtins_and_nothing_from_tests() -> None:
    registry = Registry.from_entry_points()
    assert registry.get("arith_exact") is ARITH_EXACT
    assert registry.get("math") is MATH
    builtins = {"boxed", "exact", "numeric", "f1", "multiple_choice", "format", "code", "remote", "judge"}
    assert builtins <= set(registry)
    # Network-bound functions run on the event loop; the others in worker processes, as does the judge's
    # verdict parse (a caller's regex).
    assert {name for name, function in registry.items() if function.waits_on_io} == {"remote", "judge"}
    pooled = registry.pool_functions()
    assert set(pooled) == set(registry) - {"remote"}
    assert pooled["judge"] is score_verdict and pooled["math"] is MATH.fn
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


@pytest.mark.parametrize(("fn", "finish"), [(score_arith_exact, score_verdict), (ask_judge, ask_judge)])
def test_finish_is_a_plain_function_after_an_async_one(fn: Any, finish: Any) -> None:
    with pytest.raises(ValueError, match="finish is a plain function that follows an async def fn"):
        RewardFunction(fn=fn, inputs=frozenset({"response"}), description="ok", finish=finish)
