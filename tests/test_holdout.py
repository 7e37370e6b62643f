"""Held-out tau during training (training.holdout_every): targets forward held-out batches, drafter 0
scores them by eval's rule and never trains on them. Real `up` runs on the tiny CPU model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_up, tiny_cpu_config, write_toml

from dflash_ipc.config import ConfigError, config_from_dict
from dflash_ipc.data.builtin_corpus import builtin_conversations
from dflash_ipc.drafter.checkpoint import LEDGER_FILE, read_latest_pointer


def _holdout_file(tmp_path: Path) -> Path:
    """Chat records the training data (the first 300 built-in conversations) does not hold."""
    path = tmp_path / "gen.holdout.jsonl"
    recs = builtin_conversations(360, 256)[300:]
    path.write_text("".join(json.dumps({"id": f"h{i}", **r}) + "\n" for i, r in enumerate(recs)))
    return path


def _config(tmp_path: Path, name: str, holdout: Path | None, targets: int, drafters: int, **run) -> Path:
    raw = tiny_cpu_config(
        data={"builtin_samples": 300, "max_seq_len": 256, "bucket_edges": [64, 128, 256], "token_budget": 1024},
        run={"teardown_grace_s": 3.0, **run},
        topology={"targets": ["cpu"] * targets, "drafters": ["cpu"] * drafters},
        training={"checkpoint_every": 0, "max_steps": 0},
    )
    if holdout is not None:
        raw["data"]["holdout_paths"] = [str(holdout)]
        raw["training"].update(holdout_every=3, holdout_batches=2)
    return write_toml(tmp_path / f"{name}.toml", raw)


def _ledger(run_dir: Path) -> set[tuple[int, ...]]:
    ckpt = run_dir / "checkpoints" / read_latest_pointer(run_dir / "checkpoints")
    return {tuple(i) for i in json.loads((ckpt / LEDGER_FILE).read_text())["ids"]}


def _ranks(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank-*.json"))]


TRAIN_KEYS = ("step", "loss", "tokens", "acc", "acc_per_pos", "tau", "tau_blocks", "grad_norm", "lr")


@pytest.mark.slow
def test_held_out_batches_are_scored_and_never_trained_on(tmp_path):
    holdout = _holdout_file(tmp_path)
    steps = 8
    plain = run_up(_config(tmp_path, "plain", None, 1, 1), tmp_path / "plain", steps, cwd=tmp_path)
    assert plain.returncode == 0, plain.stdout[-4000:]
    held = run_up(_config(tmp_path, "held", holdout, 1, 1), tmp_path / "held", steps, cwd=tmp_path)
    assert held.returncode == 0, held.stdout[-4000:]
    # The same training batches, in the same order: identical weights, ledger and per-step figures.
    (a,), (b,) = _ranks(tmp_path / "plain"), _ranks(tmp_path / "held")
    assert b["batch_ids"] == a["batch_ids"] and len(a["batch_ids"]) == steps
    assert b["weights_sha256"] == a["weights_sha256"]
    assert _ledger(tmp_path / "held") == _ledger(tmp_path / "plain") == {tuple(i) for i in a["batch_ids"]}
    ma = [json.loads(x) for x in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (tmp_path / "held" / "metrics.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in TRAIN_KEYS} for r in mb] == [{k: r[k] for k in TRAIN_KEYS} for r in ma]
    # Passes before step 1 (the untrained floor), then every 3 training batches (1 target, 1 drafter).
    logged = [r for r in mb if "tau_holdout" in r]
    assert [r["holdout_step"] for r in logged] == [0, 3, 6]
    assert [r["holdout_pass"] for r in logged] == [0, 1, 2]
    assert all(r["tau_holdout"] >= 1.0 and r["tau_holdout_blocks"] > 0 for r in logged)
    assert not any("tau_holdout" in r for r in ma)
    assert "held-out pass 0 at step 0" in (tmp_path / "held" / "logs" / "drafter-0.log").read_text()


@pytest.mark.slow
def test_held_out_passes_with_two_targets_and_two_drafters(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = run_up(_config(tmp_path, "dp", _holdout_file(tmp_path), 2, 2, tensorboard=True), run_dir, 9, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = _ranks(run_dir)
    assert len({r["weights_sha256"] for r in ranks}) == 1  # no held-out batch entered an all-reduce
    trained = [tuple(i) for r in ranks for i in r["batch_ids"]]
    assert len(trained) == len(set(trained)) and _ledger(run_dir) == set(trained)
    logged = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "tau_holdout" in r]
    # two targets: drafter 0 may take a training batch of target 1 before target 0's first held-out
    # pass arrives, so that pass measures step 0 or 1 (with one target it is step 0, test above)
    steps = [r["holdout_step"] for r in logged]
    assert logged and steps[0] <= 1 and steps == sorted(steps) and all(r["tau_holdout"] >= 1.0 for r in logged)
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    assert [s.value for s in acc.Scalars("holdout/tau")] == pytest.approx([r["tau_holdout"] for r in logged], rel=1e-5)


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
