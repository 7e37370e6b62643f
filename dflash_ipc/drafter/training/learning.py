"""Whether a run learned anything, asked before its weights are written (a checkpoint, the export).

A run that learned nothing never exits 0, whatever its length. Per drafter (every rank decides alike:
the step's figures are all-reduced and data-parallel ranks hold the same weights, so no rank is left
waiting in a collective)::

    start, or a checkpoint written ─▶ MARK: applied = 0 since this step
    each training step ─▶ its update applied ─▶ applied += 1, skipped_in_a_row = 0
                                      skipped for a non-finite loss or gradient ─▶ skipped_in_a_row += 1
        skipped_in_a_row reaches training.max_consecutive_skipped_updates (0: never) ─────────▶ DIVERGED
    before a checkpoint or the export:
        a step since the mark but applied == 0: not one update since the start or the last checkpoint ─▶ DIVERGED
        a trainable weight non-finite or past checkpoint.values.WEIGHT_ABS_BOUND (exploded) ──────▶ DIVERGED
    DIVERGED: TrainingDiverged: nothing more is written; the drafter reports Dead and exits 1, `up` FAILED

A stop before any step of this start (or since the last checkpoint) is no divergence: nothing was
trained, and the checkpoint already written holds what was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dflash_ipc.drafter.checkpoint.values import WEIGHT_ABS_BOUND, value_problem

ADVICE = "Lower training.lr, check training.loss_gamma and drafter.noise_std, or resume from an earlier checkpoint"


class TrainingDiverged(RuntimeError):
    """The run learned nothing (no applied update) or its weights exploded: it ends without an export."""


@dataclass
class UpdateTally:
    """The updates since the process started or since its last checkpoint (the module's MARK)."""

    since_step: int = 0  # the step of the start or of the last checkpoint
    applied: int = 0
    skipped_in_a_row: int = 0  # updates skipped for a non-finite loss or gradient since the last applied one

    def mark(self, step: int) -> None:
        self.since_step, self.applied = step, 0

    def observe(self, step: int, skipped: bool, grad_norm: float, loss_weight: float, loss: float, limit: int) -> None:
        """One training step's global figures; raises :class:`TrainingDiverged` at ``limit`` non-finite skips in a row."""
        self.applied += not skipped
        non_finite = skipped and not (math.isfinite(grad_norm) and math.isfinite(loss_weight))
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if non_finite else 0
        if limit and self.skipped_in_a_row >= limit:
            raise TrainingDiverged(
                f"training diverged: {self.skipped_in_a_row} updates in a row skipped for a non-finite loss or gradient "
                f"(step {step}: loss {loss}, gradient norm {grad_norm}, loss weight {loss_weight}); "
                f"the weights have not moved since step {step - self.skipped_in_a_row}, so nothing is exported. "
                f"{ADVICE} (training.max_consecutive_skipped_updates = {limit}; 0 never stops)"
            )

    def check_before_writing(self, step: int, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
        """Raise :class:`TrainingDiverged` rather than write ``what`` of a run that learned nothing since the mark,
        or whose trainable ``weights`` are non-finite or exploded."""
        steps = step - self.since_step
        if steps and not self.applied:
            raise TrainingDiverged(
                f"training learned nothing: none of the {steps} updates of steps {self.since_step + 1}..{step} (since this "
                f"start or the last checkpoint) was applied (each skipped for a non-finite loss or gradient, or no loss to weigh), "
                f"so no {what} is written. {ADVICE}"
            )
        problem = value_problem(dict(weights), WEIGHT_ABS_BOUND)
        if problem:
            raise TrainingDiverged(f"training diverged: at step {step} the weight {problem}, so no {what} is written. {ADVICE}")
