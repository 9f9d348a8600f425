from __future__ import annotations

import pytest

from rlfleet.arithmetic import ArithmeticTask


def test_answers_are_correct_for_every_operator() -> None:
    for problem in ArithmeticTask(digits=2, ops="+-*/", seed=3).problems("train", 300):
        expression = problem.prompt.removesuffix("=").replace("/", "//")
        assert str(eval(expression)) == problem.answer, problem  # noqa: S307 - digits and one operator only


def test_seeded_and_deterministic() -> None:
    a = ArithmeticTask(seed=1).problems("train", 50)
    assert a == ArithmeticTask(seed=1).problems("train", 50)
    assert a != ArithmeticTask(seed=2).problems("train", 50)
    assert a != ArithmeticTask(seed=1).problems("train", 50, epoch=1)


def test_splits_are_disjoint_and_distinct() -> None:
    task = ArithmeticTask(digits=2, ops="+-")
    train = {p.prompt for e in range(3) for p in task.problems("train", 500, epoch=e)}
    test = [p.prompt for p in task.problems("test", 300)]
    assert len(set(test)) == 300
    assert not train & set(test)


def test_operand_width_follows_digits() -> None:
    for problem in ArithmeticTask(digits=1, ops="+").problems("train", 50):
        a, b = problem.prompt.removesuffix("=").split("+")
        assert len(a) == 1 and len(b) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"digits": 0}, "digits"), ({"ops": "%"}, "ops"), ({"ops": ""}, "ops"), ({"heldout_per_mille": 0}, "heldout")],
)
def test_bad_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_asking_for_more_than_the_split_holds_fails_clearly() -> None:
    with pytest.raises(ValueError, match="fewer than 50 distinct"):
        ArithmeticTask(digits=1, ops="+").problems("test", 50)
