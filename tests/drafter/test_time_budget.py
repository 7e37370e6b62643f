"""training.max_seconds (drafter/training/time_budget.py): the schedule's length planned from the measured pace, so the
cosine ends as the budget does; the pure planner on made-up clocks, then a real in-process run and its resume."""

from __future__ import annotations

import json

import pytest
from loop_harness import InprocRun, small_config

from dflash_ipc.config import ConfigError, config_from_dict
from dflash_ipc.drafter.training.schedule import lr_at
from dflash_ipc.drafter.training.time_budget import FIRST_PLAN_AFTER, MEASURE_FROM, PLAN_EVERY, TimeBudget


def feed(budget: TimeBudget, clock, steps, start=1, reduce=None):
    """Observe steps ``start..steps`` with ``clock(step)`` seconds elapsed after each; the plans made."""
    plans = []
    for s in range(start, steps + 1):
        p = budget.observe(s, clock(s)) if reduce is None else budget.observe(s, clock(s), reduce)
        if p is not None:
            plans.append(p)
    return plans


def test_the_plan_fills_the_budget_at_the_measured_pace_and_ignores_the_compile():
    # step 1 compiles for 20 s, then 0.5 s per step: 100 s of budget hold 1 + (80 / 0.5) = 161 steps
    clock = lambda s: 20.0 + 0.5 * (s - 1)  # noqa: E731
    b = TimeBudget(100.0)
    plans = feed(b, clock, 200)
    first = MEASURE_FROM + FIRST_PLAN_AFTER
    assert plans[0].step == first
    # then every PLAN_EVERY steps, closer as the end nears: an eighth of the steps left, down to every step
    assert [later.step - earlier.step for earlier, later in zip(plans, plans[1:])][:8] == [18, 16, 14, 12, 11, 9, 8, 7]
    assert [p.step for p in plans if p.step <= 161][-3:] == [159, 160, 161]
    assert feed(TimeBudget(10_000.0), clock, 100)[1].step == first + PLAN_EVERY  # far from the end
    assert plans[0].seconds_per_step == pytest.approx(0.5) and plans[0].total_steps == 161
    assert {p.total_steps for p in plans if p.step <= 161} == {161}
    assert b.total_steps == max(p.step for p in plans)  # past the budget: a plan never lies behind its own step
    # a cap (training.max_steps) bounds it; the smallest plan over the ranks wins
    assert feed(TimeBudget(100.0, max_steps=120), clock, first)[0].total_steps == 120
    assert feed(TimeBudget(100.0), clock, first, reduce=lambda plan: plan - 7)[0].total_steps == 154


def test_a_slower_pace_later_moves_the_end_earlier_and_a_resume_trains_only_what_is_left():
    # 0.5 s per step until step 40, then 1.0 s: the plans follow the pace measured since step 4
    clock = lambda s: 0.5 * s if s <= 40 else 20.0 + 1.0 * (s - 40)  # noqa: E731
    plans = feed(TimeBudget(60.0), clock, 80)
    assert plans[0].total_steps == 120 and plans[-1].total_steps < plans[0].total_steps
    b = TimeBudget(60.0, spent_s=45.0, start_step=90)  # a resumed run: 15 s left
    (plan,) = feed(b, lambda s: 0.25 * (s - 90), 90 + MEASURE_FROM + FIRST_PLAN_AFTER, start=91)
    assert plan.seconds_left == pytest.approx(15.0 - 0.25 * (MEASURE_FROM + FIRST_PLAN_AFTER))
    assert plan.total_steps == plan.step + int(plan.seconds_left / 0.25)
    assert b.state_dict()["spent_s"] == pytest.approx(45.0 + 3.0)
    spent = TimeBudget(60.0, spent_s=61.0, start_step=90)
    assert spent.total_steps == 90  # nothing left: the loop finishes before a step
    assert TimeBudget(60.0, spent_s=50.0, start_step=90, pace_s=0.5).total_steps == 110  # the kept pace plans at once
    assert TimeBudget(60.0, max_steps=100, spent_s=50.0, start_step=90, pace_s=0.5).total_steps == 100
    with pytest.raises(ValueError):
        TimeBudget(0.0)


def run_planned(budget: TimeBudget, clock, training, first_total: int, last_step: int = 10_000):
    """Step as the drafter does: each step's rate from the plan in force, then observe; (end, last rate)."""
    total = first_total
    for s in range(1, last_step + 1):
        rate = lr_at(s - 1, training, total)
        plan = budget.observe(s, clock(s))
        if plan is not None:
            total = plan.total_steps
        if s == total:
            return s, rate
    raise AssertionError("the budget never ended the run")


@pytest.mark.parametrize("slowdown", [1.0, 1.5, 3.0])
def test_a_pace_that_slows_late_still_ends_on_the_tail_of_the_cosine(slowdown):
    # 0.5 s per step, then `slowdown` times slower from step 60 on; 60 s of budget
    clock = lambda s: 0.5 * s if s <= 60 else 30.0 + 0.5 * slowdown * (s - 60)  # noqa: E731
    training = config_from_dict({"training": {"max_seconds": 60, "warmup_fraction": 0.04, "min_lr_ratio": 0.0}}).training
    end, rate = run_planned(TimeBudget(60.0), clock, training, first_total=100_000)
    assert clock(end) == pytest.approx(60.0, abs=0.5 * slowdown)  # the budget is used, not cut short
    assert rate <= lr_at(int(0.9 * end), training, end)  # the last step ran on the cosine's last tenth


def test_the_config_takes_seconds_and_refuses_negative_ones():
    assert config_from_dict({"training": {"max_seconds": 420}}).training.max_seconds == 420
    with pytest.raises(ConfigError, match=r"training\.max_seconds: must be >= 0"):
        config_from_dict({"training": {"max_seconds": -1}})


def test_a_run_with_a_time_budget_ends_at_its_plan_annealed_and_a_resume_keeps_the_seconds(tmp_path):
    cfg = small_config(
        tmp_path,
        targets=1,
        data={"num_epochs": 50},
        training={"max_seconds": 4.0, "max_steps": 100_000, "warmup_fraction": 0.04, "min_lr_ratio": 0.0},
    )
    run = InprocRun(cfg, tmp_path / "run")
    try:
        summary = run.run()
        core = run.drafter_core
        end = core.end_step
        # the first plan comes at step MEASURE_FROM + FIRST_PLAN_AFTER and never ends before it: a slow
        # machine's 4 s may end right there, a fast one's later
        assert summary.reason == f"max_seconds 4 (planned step {end})" and core.step == end >= MEASURE_FROM + FIRST_PLAN_AFTER
        rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "loss" in r]
        assert steps[-1]["step"] == end
        # the schedule ends with the budget: the last step's rate is the cosine's tail, not its middle
        assert steps[-1]["lr"] <= lr_at(int(0.8 * end), cfg.training, end)
        spent = json.loads((run.run_dir / "checkpoints" / f"step-{end:06d}" / "meta.json").read_text())["extra"]["time_budget"]
        assert spent["total_steps"] == end and spent["spent_s"] > 0
    finally:
        run.close()
    again = InprocRun(cfg, tmp_path / "run", resume=True)
    try:
        budget = again.drafter_core.time_budget
        assert budget.spent_before == pytest.approx(spent["spent_s"]) and budget.pace_s == spent["seconds_per_step"] > 0
        assert again.drafter_core.end_step == budget.total_steps == again.drafter_core.trainer.total_steps
    finally:
        again.close()
