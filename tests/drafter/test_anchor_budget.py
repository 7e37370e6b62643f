"""The follow-wait anchor budget (drafter/training/anchor_budget.py) on scripted step times: it grows by one
chunk per window while the drafter waits, stops at the cap, steps down when the drafter becomes the
bound without swinging back, never goes below the start, and restores from its state."""

from __future__ import annotations

import pytest

from dflash_ipc.drafter.training.anchor_budget import RETRY_AFTER_WINDOWS, AnchorBudget, BudgetChange


def budget(**kw) -> AnchorBudget:
    args = {"start": 2048, "chunk": 2048, "cap": 8192, "target_wait": 0.2, "window": 4} | kw
    return AnchorBudget(**args)


def run(b: AnchorBudget, windows: int, wait_s: float, step_s: float = 1.0) -> list[BudgetChange]:
    changes = []
    for _ in range(windows * b.window):
        change = b.observe(wait_s, step_s)
        if change is not None:
            changes.append(change)
    return changes


def test_grows_one_chunk_per_window_while_waiting_and_stops_at_the_cap():
    b = budget()
    seen = []
    for _ in range(6):
        run(b, 1, wait_s=1.0)  # 50% wait
        seen.append(b.anchors)
    assert seen == [4096, 6144, 8192, 8192, 8192, 8192]


def test_decides_only_at_window_ends():
    b = budget(window=4)
    assert [b.observe(1.0, 1.0) for _ in range(3)] == [None, None, None]
    change = b.observe(1.0, 1.0)
    assert change == BudgetChange(2048, 4096, 0.5, 4, 0.2)
    assert change.describe() == "anchors per batch 2048 -> 4096: wait 50% over the last 4 steps (target 20%)"


def test_holds_in_the_band_and_never_goes_below_the_start():
    b = budget()
    assert run(b, 3, wait_s=0.1) == []  # 9%: between target/4 and target
    assert b.anchors == 2048
    assert run(b, 3, wait_s=0.0) == []  # the bound, but already at the start
    assert b.anchors == 2048


def test_steps_down_when_bound_and_does_not_swing_back_until_the_retry():
    b = budget()
    run(b, 2, wait_s=1.0)
    assert b.anchors == 6144
    (down,) = run(b, 1, wait_s=0.0)
    assert (down.old, down.new) == (6144, 4096) and "the drafter is the bound" in down.describe()
    # waiting again at 4096: 6144 was the bound, so it is not retried before the ceiling lifts
    assert run(b, RETRY_AFTER_WINDOWS - 1, wait_s=1.0) == []
    assert b.anchors == 4096
    (up,) = run(b, 1, wait_s=1.0)
    assert (up.old, up.new) == (4096, 6144)


def test_last_move_is_clamped_to_the_cap_and_the_start():
    b = budget(start=3000, cap=8192)
    run(b, 5, wait_s=1.0)
    assert b.anchors == 8192  # 3000, 5048, 7096, 8192
    walk = []
    for _ in range(4):  # bound at every level: one chunk down per window, never below the start
        run(b, 1, wait_s=0.0)
        walk.append(b.anchors)
    assert walk == [6144, 4096, 3000, 3000]


def test_settle_steps_are_not_counted():
    b = budget(settle_steps=3)
    for _ in range(3):
        assert b.observe(100.0, 1.0) is None
    assert run(b, 1, wait_s=0.0) == [] and b.anchors == 2048
    assert len(run(b, 1, wait_s=1.0)) == 1


def test_reduce_sees_the_window_sums_and_its_answer_decides():
    b = budget(window=2)
    calls = []

    def reduce(wait_sum, step_sum):
        calls.append((wait_sum, step_sum))
        return wait_sum + 0.0, step_sum + 100.0  # another rank that never waited: 1% overall

    assert b.observe(3.0, 1.0, reduce) is None
    assert b.observe(3.0, 1.0, reduce) is None  # 75% here, 1% over the group: hold
    assert calls == [(6.0, 2.0)] and b.anchors == 2048


def test_state_round_trips_and_is_clamped_to_a_changed_config():
    b = budget()
    run(b, 2, wait_s=1.0)
    run(b, 1, wait_s=0.0)
    state = b.state_dict()
    again = budget()
    again.load_state_dict(state)
    assert again.state == b.state and again.anchors == 4096
    smaller = budget(cap=2048)
    smaller.load_state_dict(state)
    assert smaller.anchors == 2048


@pytest.mark.parametrize("kw", [{"start": 0}, {"cap": 1024}, {"chunk": 0}, {"window": 0}, {"target_wait": 1.0}])
def test_bad_arguments_are_refused(kw):
    with pytest.raises(ValueError, match="AnchorBudget needs"):
        budget(**kw)


@pytest.mark.parametrize("state", [{"anchors": 4096}, {"anchors": "4096", "ceiling": 0, "ceiling_windows_left": 0}, [4096], None])
def test_a_malformed_checkpoint_state_is_refused_with_what_it_should_be(state):
    b = budget()
    with pytest.raises(ValueError, match="anchor budget must be"):
        b.load_state_dict(state)
    assert b.anchors == 2048
