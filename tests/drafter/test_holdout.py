"""Held-out tau during training (training.holdout_every): targets forward held-out batches, drafter 0
scores them by eval's rule and never trains on them: the role loops in-process on the tiny CPU model
(tests/loop_harness.py), and the session's shared `up` run (two targets, two drafters)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import holdout_file, tiny_cpu_config
from loop_harness import InprocRun, small_config

from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, config_from_dict
from dflash_ipc.control.drafter_tau import NOT_WORTH_SERVING, WORTH_SERVING_TAU, DrafterTau
from dflash_ipc.drafter.checkpoint.store import LEDGER_FILE, read_latest_pointer
from dflash_ipc.drafter.export.layout import DRAFTER_TAU_KEY


def _ledger(run_dir: Path) -> set[tuple[int, ...]]:
    ckpt = run_dir / "checkpoints" / read_latest_pointer(run_dir / "checkpoints")
    return {tuple(i) for i in json.loads((ckpt / LEDGER_FILE).read_text())["ids"]}


def _ranks(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank-*.json"))]


TRAIN_KEYS = ("step", "loss", "tokens", "acc", "acc_per_pos", "tau", "tau_blocks", "grad_norm", "lr")


def _inproc_run(tmp_path: Path, name: str, holdout: Path | None, steps: int) -> tuple[InprocRun, list[dict]]:
    """One target and one drafter of the run's loops in this process (tests/loop_harness.py)."""
    sections = {"data": {"builtin_samples": 300}, "training": {"max_steps": steps}}
    if holdout is not None:
        sections["data"]["holdout_paths"] = [str(holdout)]
        sections["training"].update(holdout_every=3, holdout_batches=2)
    (tmp_path / name).mkdir()
    torch.manual_seed(0)  # both runs start from the same global RNG state, as two fresh processes would
    run = InprocRun(small_config(tmp_path / name, targets=1, **sections), tmp_path / name / "run")
    try:
        run.run()
        recs = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        run.close()
    return run, recs


def test_held_out_batches_are_scored_and_never_trained_on(tmp_path):
    """The same run with and without held-out passes (the role loops in-process): the same training
    batches in the same order, identical weights, ledger and per-step figures."""
    holdout = holdout_file(tmp_path, 300)
    steps = 8
    plain, ma = _inproc_run(tmp_path, "plain", None, steps)
    held, mb = _inproc_run(tmp_path, "held", holdout, steps)
    a, b = plain.drafter_core, held.drafter_core
    assert b.trained_ids == a.trained_ids and len(a.trained_ids) == steps
    assert b.weights_digest() == a.weights_digest()
    assert _ledger(held.run_dir) == _ledger(plain.run_dir) == set(a.trained_ids)
    assert [{k: r[k] for k in TRAIN_KEYS} for r in mb] == [{k: r[k] for k in TRAIN_KEYS} for r in ma]
    # Passes before step 1 (the untrained floor), then every 3 training batches (1 target, 1 drafter).
    logged = [r for r in mb if "tau_holdout" in r]
    assert [r["holdout_step"] for r in logged] == [0, 3, 6]
    assert [r["holdout_pass"] for r in logged] == [0, 1, 2]
    assert all(r["tau_holdout"] >= 1.0 and r["tau_holdout_blocks"] > 0 for r in logged)
    assert not any("tau_holdout" in r for r in ma)


@pytest.mark.slow
def test_held_out_passes_with_two_targets_and_two_drafters(shared_run):
    """The session's shared run (conftest.shared_run: 2 targets, 2 drafters, held-out passes on)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = shared_run.run_dir
    assert shared_run.returncode == 0, shared_run.output[-4000:]
    ranks = _ranks(run_dir)
    assert len(ranks) == 2 and len({r["weights_sha256"] for r in ranks}) == 1  # no held-out batch entered an all-reduce
    trained = [tuple(i) for r in ranks for i in r["batch_ids"]]
    assert len(trained) == len(set(trained)) and _ledger(run_dir) == set(trained)
    logged = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "tau_holdout" in r]
    # two targets: drafter 0 may take a training batch of target 1 before target 0's first held-out
    # pass arrives, so that pass measures step 0 or 1 (with one target it is step 0, test above)
    steps = [r["holdout_step"] for r in logged]
    assert logged and steps[0] <= 1 and steps == sorted(steps) and all(r["tau_holdout"] >= 1.0 for r in logged)
    assert "held-out pass 0 at step" in (run_dir / "logs" / "drafter-0.log").read_text()
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [s.value for s in acc.Scalars("holdout/tau")] == pytest.approx([r["tau_holdout"] for r in logged], rel=1e-5)


@pytest.mark.slow
def test_a_run_whose_held_out_tau_is_under_1_1_says_so_beside_the_export_in_status_and_in_its_metadata(shared_run, tmp_path):
    """The shared run's held-out τ stays near the untrained floor (12 steps of a random tiny target): `up`'s summary,
    status.json, `status`, the export `up` wrote and a fresh `export` carry the figure and the warning."""
    run = shared_run
    assert run.returncode == 0, run.output[-4000:]
    status = json.loads((run.run_dir / "status.json").read_text())["drafter_tau"]
    tau = DrafterTau(**status)
    assert tau.measured_on == "held-out" and tau.tau < WORTH_SERVING_TAU and not tau.worth_serving
    # the figure is the held-out pass the metrics logged for those weights (a pass after the last step is in the summary only)
    logged = {
        r["holdout_step"]: r["tau_holdout"]
        for r in map(json.loads, (run.run_dir / "metrics.jsonl").read_text().splitlines())
        if r.get("tau_holdout") is not None
    }
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


def test_config_errors_name_the_holdout_keys(tmp_path):
    raw = tiny_cpu_config(training={"holdout_every": 5})
    with pytest.raises(ConfigError, match=r"training\.holdout_every: needs data\.holdout_paths"):
        config_from_dict(raw, "t.toml")
    raw = tiny_cpu_config(training={"holdout_batches": -1})
    with pytest.raises(ConfigError, match=r"training\.holdout_batches: must be >= 0"):
        config_from_dict(raw, "t.toml")
    raw = tiny_cpu_config(data={"paths": ["a.jsonl"], "holdout_paths": ["a.jsonl"]})
    with pytest.raises(ConfigError, match=r"data\.holdout_paths: .*also in data\.paths"):
        config_from_dict(raw, "t.toml")
    raw = tiny_cpu_config(data={"holdout_paths": ["h.jsonl"]}, training={"holdout_every": 5, "holdout_batches": 0})
    cfg = config_from_dict(raw, "t.toml")
    assert (cfg.training.holdout_every, cfg.training.holdout_batches) == (5, 0)
