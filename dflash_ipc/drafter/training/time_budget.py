"""Training for a wall-clock budget (``training.max_seconds``): the cosine's length fitted to the time.

A drafter trained for "eight minutes" should end those minutes with its learning rate annealed, not
cut off half-way down the cosine. How many steps fit is the machine's answer, not the config's, so
the drafter measures its own pace and plans the schedule's length from it. Pure: fed each step's
training clock, no clock of its own; the caller hands in ``reduce`` (the smallest plan over the
data-parallel ranks, so every rank ends at the same step).

    step 1 .. MEASURE_FROM           not counted (compiles, the first batches' backlog)
    at MEASURE_FROM + FIRST_PLAN_AFTER,  pace = seconds per step since MEASURE_FROM (held-out passes and
    then every min(PLAN_EVERY,           checkpoints included, as they recur);
    an eighth of the steps left) steps   plan = step + (budget left) / pace, at most training.max_steps,
                                         never before this step: the schedule's total_steps becomes plan
    step == plan                         the loop finishes ("max_seconds")

Plans come closer together as the end nears (down to every step), so a pace that slows late (a
loaded machine, a longer hold-out pass) moves the end while the cosine can still follow it: the last
steps run on the tail of the cosine, not on a plan made when the machine was faster.

The budget counts training time only (from the first step on, not the start-up), across restarts: a
resumed run keeps the seconds it had trained and its pace (the checkpoint's ``time_budget``), plans the rest
from that pace at once (nothing, when the seconds are spent), then measures its own. A fresh run trains
MEASURE_FROM + FIRST_PLAN_AFTER steps before its first plan whatever the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: steps before the pace is measured (the first hold the compiles)
MEASURE_FROM = 4
#: counted steps before the first plan
FIRST_PLAN_AFTER = 8
#: steps between plans
PLAN_EVERY = 25

Reduce = Callable[[int], int]


def _local(plan: int) -> int:
    return plan


@dataclass(frozen=True)
class Plan:
    step: int
    total_steps: int
    seconds_per_step: float
    seconds_left: float

    def describe(self) -> str:
        return (
            f"max_seconds: {self.seconds_per_step:.3f} s per step, {self.seconds_left:.0f} s left at step {self.step}: "
            f"the schedule ends at step {self.total_steps}"
        )


class TimeBudget:
    def __init__(self, max_seconds: float, max_steps: int = 0, spent_s: float = 0.0, start_step: int = 0, pace_s: float | None = None):
        if max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0 (got {max_seconds})")
        self.max_seconds = float(max_seconds)
        self.max_steps = int(max_steps)
        self.spent_before = float(spent_s)  # trained before this process (a resumed run)
        self.start_step = int(start_step)
        self.elapsed_s = 0.0  # this process's training seconds at the last step observed
        self._mark: tuple[int, float] | None = None  # (step, elapsed) where the pace is measured from
        self._next_plan: int | None = None  # the step of the next plan point (the same on every rank)
        self.pace_s = pace_s  # seconds per step at the last plan
        # the last plan; a resumed run plans at once from the pace it had (its budget spent: it ends where it is)
        self.total_steps: int | None = None
        if self.spent_before >= self.max_seconds:
            self.total_steps = self.start_step
        elif pace_s:
            self.total_steps = self._capped(self.start_step + int((self.max_seconds - self.spent_before) / pace_s))

    @property
    def spent_s(self) -> float:
        return self.spent_before + self.elapsed_s

    def observe(self, step: int, elapsed_s: float, reduce: Reduce = _local) -> Plan | None:
        """After step ``step``, ``elapsed_s`` seconds after this process's first step began: a new plan
        at plan points (every rank reaches the same ones: steps are lockstep), else None."""
        self.elapsed_s = float(elapsed_s)
        counted = step - self.start_step
        if counted == MEASURE_FROM:
            self._mark = (step, self.elapsed_s)
            self._next_plan = step + FIRST_PLAN_AFTER
        if self._mark is None or step != self._next_plan:
            return None
        pace = (self.elapsed_s - self._mark[1]) / (step - self._mark[0])
        left = max(0.0, self.max_seconds - self.spent_s)
        plan = self._capped(step + int(left / pace) if pace > 0 else step)
        self.total_steps = int(reduce(max(step, plan)))  # every rank is at this step: the smallest is >= it
        self.pace_s = pace
        # from the reduced plan, so every rank picks the same next plan point
        self._next_plan = step + max(1, min(PLAN_EVERY, (self.total_steps - step) // 8))
        return Plan(step, self.total_steps, pace, left)

    def _capped(self, plan: int) -> int:
        return min(plan, self.max_steps) if self.max_steps else plan

    def state_dict(self) -> dict:
        return {"spent_s": self.spent_s, "total_steps": self.total_steps, "seconds_per_step": self.pace_s}
