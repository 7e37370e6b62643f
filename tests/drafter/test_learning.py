"""drafter/training/learning.py: a run that learned nothing since its start or its last checkpoint, or whose weights
exploded, is refused before it writes a checkpoint or an export (the real runs: tests/faults/test_tamper.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_ipc.drafter.training.learning import TrainingDiverged, UpdateTally

SOUND = [("fc.weight", torch.full((4, 4), 0.5)), ("norm.weight", torch.ones(4))]
NAN = float("nan")


def applied(tally: UpdateTally, steps: range) -> None:
    for step in steps:
        tally.observe(step, skipped=False, grad_norm=1.0, loss_weight=100.0, loss=2.0, limit=20)


def skipped(tally: UpdateTally, steps: range) -> None:
    for step in steps:
        tally.observe(step, skipped=True, grad_norm=NAN, loss_weight=100.0, loss=NAN, limit=20)


def test_updates_all_skipped_since_the_last_checkpoint_refuse_the_next_write():
    tally = UpdateTally()
    applied(tally, range(1, 5))
    tally.check_before_writing(4, SOUND, "checkpoint")
    tally.mark(4)  # the checkpoint at step 4 holds what steps 1..4 learned
    skipped(tally, range(5, 7))
    with pytest.raises(TrainingDiverged, match=r"none of the 2 updates of steps 5\.\.6 .* so no export is written"):
        tally.check_before_writing(6, SOUND, "export")


def test_one_applied_update_since_the_mark_is_enough_and_a_stop_with_no_step_since_is_no_divergence():
    tally = UpdateTally()
    skipped(tally, range(1, 3))
    applied(tally, range(3, 4))
    tally.check_before_writing(3, SOUND, "checkpoint")
    tally.mark(3)
    tally.check_before_writing(3, SOUND, "checkpoint")  # stopped right after the checkpoint: nothing new to judge


@pytest.mark.parametrize("value", [2e29, 1.5e6, NAN, float("inf")])
def test_exploded_or_non_finite_weights_refuse_the_write(value):
    tally = UpdateTally()
    applied(tally, range(1, 3))
    weights = [("fc.weight", torch.tensor([[0.1, value]]))]
    with pytest.raises(TrainingDiverged, match=r"training diverged: at step 2 the weight fc\.weight holds"):
        tally.check_before_writing(2, weights, "checkpoint")


def test_weights_below_the_bound_pass():
    tally = UpdateTally()
    applied(tally, range(1, 2))
    tally.check_before_writing(1, [("fc.weight", torch.tensor([9.9e5, -9.9e5]))], "export")


def test_non_finite_skips_in_a_row_raise_at_the_limit_and_an_applied_update_resets_the_count():
    tally = UpdateTally()
    for step in range(1, 3):
        tally.observe(step, skipped=True, grad_norm=NAN, loss_weight=1.0, loss=NAN, limit=3)
    applied(tally, range(3, 4))
    for step in range(4, 6):
        tally.observe(step, skipped=True, grad_norm=NAN, loss_weight=1.0, loss=NAN, limit=3)
    with pytest.raises(TrainingDiverged, match=r"3 updates in a row skipped .* not moved since step 3"):
        tally.observe(6, skipped=True, grad_norm=NAN, loss_weight=1.0, loss=NAN, limit=3)
