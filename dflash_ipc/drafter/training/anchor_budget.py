"""How many anchors a batch trains on, following the drafter's idle time (``drafter.anchor_budget = "follow-wait"``).

A drafter that waits for batches could train on more anchors in that time: the same target
forward buys more supervised blocks. How many fit depends on the machine and the shapes, so
instead of a fixed ``max_anchors_per_batch`` the drafter measures its wait and moves the budget
one ``anchor_chunk`` at a time. Pure: fed each step's measured seconds, no clock, no collective
(the caller hands in ``reduce``, which sums a window's figures over the data-parallel ranks).

Per step: ``observe(wait_s, step_s)``. The first ``settle_steps`` steps after a (re)start are
not counted (their wait is the pipeline filling, their lack of it the start-up backlog
draining). Every ``window`` counted steps the window's wait fraction
``f = wait / (wait + step)`` decides, and the window starts afresh::

                 f > target_wait, below the cap, next level not a fresh ceiling
        ┌──────────────────────────────────────────────────────────────────────▶ UP: anchors += chunk (at most the cap)
        │
    window ── f < target_wait / 4 (the drafter is the bound), above the start ──▶ DOWN: anchors -= chunk (at least the start);
        │                                                                          the level left becomes the ceiling
        └── otherwise (in the band, at the cap/start, or blocked by the ceiling) ─▶ HOLD

    ceiling: a level that made the drafter the bound is not tried again for RETRY_AFTER_WINDOWS
    windows (hysteresis: without it the budget would swing between that level and the one below
    every window); then it is lifted, in case the batches or the machine have changed.

The band between ``target_wait / 4`` and ``target_wait`` is the second half of the hysteresis:
one chunk's worth of wait need not land exactly on the target.

Data parallel (several drafter ranks): every rank must sample the same number of anchors at the
same step. Each rank counts its own seconds; at the end of a window ``reduce`` all-reduces the
window's ``(wait, step)`` sums once (one tiny collective per window, on the existing group) and
every rank decides from the same sums with the same state (restored from the same checkpoint),
so all make the same move without a broadcast. All-reduce rather than rank 0 deciding alone:
the group is bound by its slowest rank, so the fraction over all ranks is the one that matters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

#: windows before a level that made the drafter the bound may be tried again
RETRY_AFTER_WINDOWS = 16
#: below this share of target_wait the drafter counts as the bound (it never waits)
BOUND_SHARE = 0.25

Reduce = Callable[[float, float], tuple[float, float]]


def _local(wait_s: float, step_s: float) -> tuple[float, float]:
    return wait_s, step_s


@dataclass(frozen=True)
class BudgetChange:
    """One move of the budget, with the window that decided it."""

    old: int
    new: int
    wait_fraction: float
    steps: int
    target_wait: float

    def describe(self) -> str:
        why = f"wait {self.wait_fraction:.0%} over the last {self.steps} steps"
        if self.new > self.old:
            return f"anchors per batch {self.old} -> {self.new}: {why} (target {self.target_wait:.0%})"
        return (
            f"anchors per batch {self.old} -> {self.new}: {why}, the drafter is the bound "
            f"(below {self.target_wait * BOUND_SHARE:.0%}); {self.old} not tried again for {RETRY_AFTER_WINDOWS} windows"
        )


@dataclass
class BudgetState:
    """What a checkpoint keeps: a resumed run continues with the same budget and ceiling."""

    anchors: int
    ceiling: int = 0  # 0: none
    ceiling_windows_left: int = 0


class AnchorBudget:
    def __init__(self, start: int, chunk: int, cap: int, target_wait: float, window: int, settle_steps: int = 0):
        if not (0 < start <= cap and chunk > 0 and window >= 1 and 0 < target_wait < 1 and settle_steps >= 0):
            raise ValueError(
                f"AnchorBudget needs 0 < start <= cap, chunk > 0, window >= 1, 0 < target_wait < 1, settle_steps >= 0; "
                f"got start={start} chunk={chunk} cap={cap} window={window} target_wait={target_wait} settle_steps={settle_steps}"
            )
        self.start, self.chunk, self.cap = start, chunk, cap
        self.target_wait, self.window = target_wait, window
        self.state = BudgetState(anchors=start)
        self._settle_left = settle_steps
        self._wait_sum = 0.0
        self._step_sum = 0.0
        self._steps = 0

    @property
    def anchors(self) -> int:
        """The anchors per batch for the next step."""
        return self.state.anchors

    def observe(self, wait_s: float, step_s: float, reduce: Reduce = _local) -> BudgetChange | None:
        """One training step's seconds waiting for its batch and training on it; a change of the
        budget when this step closed a window that moved it, else None. Every data-parallel rank
        must call it at every step (``reduce`` is a collective at each window's end)."""
        if self._settle_left > 0:
            self._settle_left -= 1
            return None
        self._wait_sum += max(0.0, wait_s)
        self._step_sum += max(0.0, step_s)
        self._steps += 1
        if self._steps < self.window:
            return None
        wait_sum, step_sum = reduce(self._wait_sum, self._step_sum)
        steps = self._steps
        self._wait_sum, self._step_sum, self._steps = 0.0, 0.0, 0
        return self._decide(wait_sum / max(1e-12, wait_sum + step_sum), steps)

    def _decide(self, wait_fraction: float, steps: int) -> BudgetChange | None:
        s = self.state
        if s.ceiling:
            s.ceiling_windows_left -= 1
            if s.ceiling_windows_left <= 0:
                s.ceiling, s.ceiling_windows_left = 0, 0
        old = s.anchors
        if wait_fraction > self.target_wait:
            new = min(self.cap, old + self.chunk)
            if s.ceiling and new >= s.ceiling:
                return None
        elif wait_fraction < self.target_wait * BOUND_SHARE and old > self.start:
            new = max(self.start, old - self.chunk)
            s.ceiling, s.ceiling_windows_left = old, RETRY_AFTER_WINDOWS
        else:
            return None
        if new == old:
            return None
        s.anchors = new
        return BudgetChange(old, new, wait_fraction, steps, self.target_wait)

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's budget, kept within this run's start and cap (the config may have changed)."""
        keys = {f.name for f in fields(BudgetState)}
        if not isinstance(state, dict) or set(state) != keys or not all(type(v) is int and v >= 0 for v in state.values()):
            raise ValueError(f"the checkpoint's anchor budget must be {{{', '.join(sorted(keys))}}}, each an int >= 0; got {state!r}")
        restored = BudgetState(**state)
        restored.anchors = min(self.cap, max(self.start, restored.anchors))
        self.state = restored
