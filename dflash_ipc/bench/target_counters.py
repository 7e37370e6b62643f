"""What `bench pipeline` counts on a target, beyond a training target's own figures: an observer it attaches to
the target's core (``TargetCore.observers``), never a branch of the core.

* **Steady state**: the forwards after the first (which pays warm-up and compilation): tokens, FLOPs and
  forward seconds, over the wall time since the first forward ended.
* **Ceiling** (the forward-only variants, ``ceiling=True``): each batch first runs once through the captured
  forward untimed (its first pass: compilation, autotuning and the first calls of a new batch shape land there),
  then through the decoder stack alone, then captured as the target runs it, so the ceiling is a warm forward's
  and the first pass says what a new shape costs. Both extra forwards are left out of the steady rate.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from dflash_ipc.control.stats import TargetWork


class TargetBenchCounters:
    def __init__(self, ceiling: bool = False):
        self.ceiling = ceiling
        self.t_first_done: float | None = None
        self.steady_tokens = 0
        self.steady_flops = 0.0
        self.steady_forward_s = 0.0
        self.uncaptured_s = 0.0  # the ceiling's forwards through the stack alone, after the first batch
        self.uncaptured_forwards = 0
        self.first_pass_s = 0.0  # every batch's first pass
        self.steady_first_pass_s = 0.0  # ... after the first batch
        self._batch_extra = (0.0, 0.0)  # the batch in flight: its (first pass, uncaptured) seconds

    def before_forward(self, timed_capture: Callable[[], float], timed_uncaptured: Callable[[], float]) -> None:
        if not self.ceiling:
            return
        first_pass = timed_capture()
        self.first_pass_s += first_pass
        self._batch_extra = (first_pass, timed_uncaptured())

    def after_forward(self, n_tokens: int, flops: float, seconds: float) -> None:
        first_pass, uncaptured = self._batch_extra
        self._batch_extra = (0.0, 0.0)
        if self.t_first_done is None:
            self.t_first_done = time.perf_counter()  # after this batch's extra forwards too
            return
        self.steady_tokens += n_tokens
        self.steady_flops += flops
        self.steady_forward_s += seconds
        if self.ceiling:
            self.uncaptured_s += uncaptured
            self.uncaptured_forwards += 1
            self.steady_first_pass_s += first_pass

    def figures(self, work: TargetWork) -> TargetWork:
        extra_s = self.uncaptured_s + self.steady_first_pass_s  # the benchmark's own forwards, not the target's work
        wall = max(1e-9, time.perf_counter() - self.t_first_done - extra_s) if self.t_first_done else 0.0
        return dataclasses.replace(
            work,
            steady_tokens_per_s=self.steady_tokens / wall if wall else 0.0,
            steady_tflops=self.steady_flops / wall / 1e12 if wall else 0.0,
            steady_wall_s=wall,
            steady_forward_s=self.steady_forward_s,
            steady_forward_tflops=self.steady_flops / max(1e-9, self.steady_forward_s) / 1e12,
            bare_forward_s=self.uncaptured_s,
            bare_forwards=self.uncaptured_forwards,
            first_pass_forward_s=self.first_pass_s,
        )
