from __future__ import annotations

from rlfleet_reward.chunk_sizes import ChunkSizes


def test_a_function_not_seen_yet_goes_one_item_at_a_time() -> None:
    assert ChunkSizes().size("code", left=128, workers=2, timed=True) == 1


def test_a_lane_sends_one_item_until_it_has_timed_its_calls_items() -> None:
    """Earlier calls of a function say nothing of this call's items: they may be far slower."""
    sizes = ChunkSizes()
    sizes.observe("sleep", [0.00001] * 100)
    assert sizes.size("sleep", left=160, workers=2, timed=False) == 1
    assert sizes.size("sleep", left=160, workers=2, timed=True) == 40


def test_a_chunk_is_about_a_fifth_of_a_second_of_work_within_its_share_of_the_items() -> None:
    sizes = ChunkSizes()
    sizes.observe("code", [1.3, 1.2])
    sizes.observe("math", [0.005] * 10)
    sizes.observe("exact", [0.00001] * 10)
    assert sizes.size("code", left=128, workers=2, timed=True) == 1
    assert sizes.size("math", left=4096, workers=2, timed=True) == 40
    # A fast function's chunk is its share of the items left, so the batch still spreads over both workers.
    assert sizes.size("exact", left=4096, workers=2, timed=True) == 1024
    assert sizes.size("exact", left=3, workers=2, timed=True) == 1


def test_the_estimate_rises_at_once_and_falls_by_halves() -> None:
    sizes = ChunkSizes()
    sizes.observe("f", [0.001])
    sizes.observe("f", [0.1])  # slow items now: the next chunk must not be 200 of them
    assert sizes.size("f", left=1000, workers=1, timed=True) == 2
    sizes.observe("f", [0.0])
    assert sizes.size("f", left=1000, workers=1, timed=True) == 4
    sizes.observe("f", [])  # a chunk that lost its worker before any reply says nothing
    assert sizes.size("f", left=1000, workers=1, timed=True) == 4
