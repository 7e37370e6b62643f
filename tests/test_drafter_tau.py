"""Whether a run's drafter is worth serving (dflash_ipc/control/drafter_tau.py): the τ it reached, printed beside
the export at the end of `up` and of `export`, in `status` and in the export's config.json, with a plain warning
under 1.1. The real run is the session's shared one (conftest.shared_run: 12 steps of a random tiny target with
held-out passes every 3 steps), whose held-out τ stays near the untrained floor."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.control.drafter_tau import NOT_WORTH_SERVING, WORTH_SERVING_TAU, DrafterTau, drafter_tau
from dflash_ipc.drafter.export import DRAFTER_TAU_KEY


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_run_whose_held_out_tau_is_under_1_1_says_so_beside_the_export_in_status_and_in_its_metadata(shared_run, tmp_path):
    run = shared_run
    assert run.returncode == 0, run.output[-4000:]
    status = json.loads((run.run_dir / "status.json").read_text())["drafter_tau"]
    tau = DrafterTau(**status)
    assert tau.measured_on == "held-out" and tau.tau < WORTH_SERVING_TAU and not tau.worth_serving
    # the figure is the held-out pass the metrics logged for those weights (a pass after the last step is in the summary only)
    logged = {r["holdout_step"]: r["tau_holdout"] for r in _metrics(run.run_dir) if r.get("tau_holdout") is not None}
    assert logged and (tau.step not in logged or logged[tau.step] == tau.tau), (tau, logged)

    # `up`'s summary: the line right after the export's
    lines = run.output.splitlines()
    export_at = next(i for i, line in enumerate(lines) if line.strip().startswith("exported drafter:"))
    assert lines[export_at + 1].strip() == f"drafter: held-out tau {tau.tau:.2f} at step {tau.step}: warning: {NOT_WORTH_SERVING}"

    # the export `up` wrote, and `status`
    export_config = json.loads((run.run_dir / "export" / "drafter" / "config.json").read_text())
    assert export_config[DRAFTER_TAU_KEY] == tau.metadata() and export_config[DRAFTER_TAU_KEY]["worth_serving"] is False
    table = CliRunner().invoke(main, ["status", "--run-dir", str(run.run_dir)]).output
    assert f"drafter  held-out tau {tau.tau:.2f} at step {tau.step}, under 1.1\n" in table
    assert re.search(rf"^! {re.escape(NOT_WORTH_SERVING)}$", table, re.M), table

    # `export` of the final checkpoint: the same figure, printed and in the metadata
    r = CliRunner().invoke(main, ["export", "--from", str(run.run_dir), "--out", str(tmp_path / "export"), "--for", "sglang"])
    assert r.exit_code == 0, r.output
    assert f"held-out tau {tau.tau:.2f} at step {tau.step}: warning: {NOT_WORTH_SERVING}" in r.output
    assert json.loads((tmp_path / "export" / "config.json").read_text())[DRAFTER_TAU_KEY] == tau.metadata()


def test_training_tau_stands_in_when_no_held_out_pass_ran_and_a_good_figure_carries_no_warning():
    assert drafter_tau({}, [], 0) is None  # nothing measured yet: nothing claimed
    pooled = drafter_tau({}, [(30.0, 10.0), (90.0, 30.0), (40.0, 10.0)], 7)  # pooled by blocks: 160 / 50
    assert pooled == DrafterTau(3.2, "training", 7) and pooled.worth_serving and "warning" not in pooled.describe()
    assert "no held-out tau measured" in pooled.describe()
    floor = drafter_tau({"tau_holdout": None}, [(10.2, 10.0)], 3)
    assert floor == DrafterTau(1.02, "training", 3) and floor.describe().endswith(f"warning: {NOT_WORTH_SERVING}")
    held_out = drafter_tau({"tau_holdout": 1.1, "holdout_step": 5}, [(40.0, 10.0)], 9)  # held-out wins over training
    assert held_out == DrafterTau(1.1, "held-out", 5) and held_out.worth_serving
