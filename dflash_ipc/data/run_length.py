"""Which limit ends a run: ``training.max_steps``, ``training.max_seconds`` or the data (samples x epochs).

A run ends at whichever comes first. Steps and data are both counts of optimizer steps: every step trains one
batch per drafter (the drafters of every node), so the planned batches of all epochs last about
batches / drafters steps. Seconds depend on the pace, unknown before the run: the statement names the pace at
which the time budget would come first (over ``max_seconds / steps`` per step).

    check-config (the data counted as `plan` counts it; --file-only: not counted) and `up` (after its probe
    planned the data) print :func:`run_length_text`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DataLength:
    """How long the planned data lasts."""

    batches: int  # every epoch's batches, all target shards
    samples: int
    epochs: int
    drafters: int  # data-parallel drafters over every node: one batch each per optimizer step

    @property
    def steps(self) -> int:
        return math.ceil(self.batches / max(1, self.drafters))

    def describe(self) -> str:
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        spread = f"{self.batches} batches over {self.drafters} drafter(s)"
        return f"the data lasts about {self.steps} steps ({self.samples} samples x {epochs}: {spread})"


def run_length_text(max_steps: int, max_seconds: float, data: DataLength | None) -> str:
    """One sentence: which limit ends the run first, and by how much the others would need to change to end it.
    ``data`` None: not counted (check-config --file-only)."""
    data_text = data.describe() if data is not None else "the data's length is not counted here (dflash-ipc plan counts it)"
    steps_end = max_steps if max_steps and (data is None or max_steps <= data.steps) else 0
    if steps_end:
        ends, at = f"training.max_steps = {max_steps} ends the run{' (or the data, if shorter)' if data is None else ''}", steps_end
    elif data is not None:
        ends, at = f"the data ends the run at about step {data.steps}", data.steps
        if max_steps:
            ends += f", before training.max_steps = {max_steps}"
    else:  # no step limit, data not counted
        ends, at = "the data ends the run", 0
    if max_seconds and at:
        # the time budget plans the schedule to fill max_seconds, but stops at the step limit or the data's end
        return (
            f"{ends} unless training.max_seconds = {max_seconds:g} runs out first, which needs steps slower than "
            f"{max_seconds / at:.3g} s each; {data_text}"
        )
    if max_seconds:
        return f"training.max_seconds = {max_seconds:g} ends the run unless the data runs out first; {data_text}"
    return f"{ends}; {data_text}"
