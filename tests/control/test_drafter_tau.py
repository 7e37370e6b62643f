"""Whether a run's drafter is worth serving (dflash_ipc/control/drafter_tau.py): which τ judges it and the plain
warning under 1.1. On a real run (the figure beside the export at the end of `up` and of `export`, in `status` and
in the export's config.json): tests/drafter/test_holdout.py, on the session's shared run."""

from __future__ import annotations

from dflash_ipc.control.drafter_tau import NOT_WORTH_SERVING, DrafterTau, drafter_tau


def test_training_tau_stands_in_when_no_held_out_pass_ran_and_a_good_figure_carries_no_warning():
    assert drafter_tau({}, [], 0) is None  # nothing measured yet: nothing claimed
    pooled = drafter_tau({}, [(30.0, 10.0), (90.0, 30.0), (40.0, 10.0)], 7)  # pooled by blocks: 160 / 50
    assert pooled == DrafterTau(3.2, "training", 7) and pooled.worth_serving and "warning" not in pooled.describe()
    assert "no held-out tau measured" in pooled.describe()
    floor = drafter_tau({"tau_holdout": None}, [(10.2, 10.0)], 3)
    assert floor == DrafterTau(1.02, "training", 3) and floor.describe().endswith(f"warning: {NOT_WORTH_SERVING}")
    held_out = drafter_tau({"tau_holdout": 1.1, "holdout_step": 5}, [(40.0, 10.0)], 9)  # held-out wins over training
    assert held_out == DrafterTau(1.1, "held-out", 5) and held_out.worth_serving
