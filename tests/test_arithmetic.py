from __future__ import annotations

import random
from collections import Counter

import pytest

from rlfleet.arithmetic import ArithmeticTask, Problem


def test_answers_are_correct_for_every_operator() -> None:
    for problem in ArithmeticTask(digits=2, ops="+-*/", seed=3).problems("train", 300):
        expression = problem.prompt.removesuffix("=").replace("/", "//")
        assert str(eval(expression)) == problem.answer, problem  # noqa: S307 - digits and one operator only


def test_a_division_has_a_quotient_of_at_least_1() -> None:
    """Before, a divisor of at least half the range had the quotient 0 alone: 70 of 100 two-digit draws were 0/b."""
    task = ArithmeticTask(digits=2, ops="/", seed=1)
    problems = task.problems("train", 100)
    assert all(int(p.answer) >= 1 for p in problems), [p for p in problems if p.answer == "0"]
    assert max(int(p.prompt.split("/")[0]) for p in problems) <= 99  # the dividend keeps the task's digits


def test_every_division_problem_is_as_likely_as_any_other() -> None:
    """Drawing the divisor and then the quotient gave every divisor above half the range the quotient 1 alone:
    95 of 200 three-digit held-out problems were "x/x=1", and "x/1=" was rare."""
    problems = ArithmeticTask(digits=3, ops="/", seed=0).problems("train", 2000)
    assert problems == ArithmeticTask(digits=3, ops="/", seed=0).problems("train", 2000)  # seeded
    ones = sum(p.answer == "1" for p in problems)
    assert ones < 400  # 1 in 7 of the problems (999 of 7053) has the quotient 1; it was 777 of these 2000
    task, rng = ArithmeticTask(digits=1, ops="/"), random.Random(0)
    drawn = Counter(task._draw(rng).prompt for _ in range(23_000))
    assert len(drawn) == 23  # every 1-digit division: 9 // 1 + 9 // 2 + ... + 9 // 9
    assert 850 < min(drawn.values()) and max(drawn.values()) < 1150, drawn  # 1000 each; "1/1=" was 303, "9/9=" 2459


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
    with pytest.raises(ValueError, match="holds 12 distinct problems, fewer than 50"):
        ArithmeticTask(digits=1, ops="+").problems("test", 50)


def counted_draws(monkeypatch: pytest.MonkeyPatch, at_most: int) -> list[int]:
    """Counts ArithmeticTask's draws (in the returned list's only element), failing past `at_most`."""
    drawn = [0]
    draw = ArithmeticTask._draw

    def counting(task: ArithmeticTask, rng: random.Random) -> Problem:
        drawn[0] += 1
        if drawn[0] > at_most:
            raise AssertionError(f"drew more than {at_most} problems")
        return draw(task, rng)

    monkeypatch.setattr(ArithmeticTask, "_draw", counting)
    return drawn


def test_a_small_space_is_counted_so_too_large_a_request_draws_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    task = ArithmeticTask(digits=2, ops="+")
    prompts = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    heldout = sum(task.is_heldout(p) for p in prompts)
    assert (task.split_size("test"), task.split_size("train")) == (heldout, len(prompts) - heldout)
    drawn = counted_draws(monkeypatch, at_most=0)
    # Before: 200 draws per problem asked for (20 million, 38 s) to find that 100000 is too many.
    with pytest.raises(ValueError, match=f"holds {heldout} distinct problems, fewer than 100000"):
        task.problems("test", 100_000)
    assert drawn == [0]


def test_every_operator_is_counted_exactly() -> None:
    task = ArithmeticTask(digits=1, ops="+-*/", seed=5)
    rng = random.Random(0)
    seen = {task._draw(rng).prompt for _ in range(50_000)}  # far more draws than the 323 problems need
    held = sum(task.is_heldout(p) for p in seen)
    assert (task.split_size("train"), task.split_size("test")) == (len(seen) - held, held)
    assert ArithmeticTask(digits=3, ops="+").split_size("test") is None  # a million problems: not counted


def test_a_pool_larger_than_the_train_split_stops_at_its_last_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    task = ArithmeticTask(digits=2, ops="+")
    smaller = task.train_pool(5000)
    # Before: 200 draws per problem asked for (4 million for 20000) since the split holds only 9001.
    drawn = counted_draws(monkeypatch, at_most=200_000)
    pool = task.train_pool(20_000)
    assert len(pool) == len({p.prompt for p in pool}) == task.split_size("train")
    assert not any(task.is_heldout(p.prompt) for p in pool)
    assert pool[:5000] == smaller  # the same draw order whatever the size asked for
    assert drawn[0] < 200_000


def test_a_stream_gives_each_problem_as_it_is_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """`rlfleet data arithmetic --count 1000000` writes its first line at once and holds no list of problems."""
    draws = 0
    draw = ArithmeticTask._draw

    def counted(task: ArithmeticTask, rng: random.Random) -> Problem:
        nonlocal draws
        draws += 1
        return draw(task, rng)

    monkeypatch.setattr(ArithmeticTask, "_draw", counted)
    task = ArithmeticTask(digits=6, ops="+")
    first = next(task.stream("train", 1_000_000))
    assert draws <= 3
    assert first == ArithmeticTask(digits=6, ops="+").problems("train", 1)[0]
