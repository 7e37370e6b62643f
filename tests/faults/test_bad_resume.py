"""`up --resume` from checkpoints another config wrote: refused before any process starts, naming
the keys that differ, from the config stored in the checkpoint's meta.json.

Checkpoints are written by the real writer (``drafter.checkpoint.store.save_checkpoint``) with the
``extra`` and ``config_hash`` a drafter gives it; the refusals come from
``preflight.validate_for_up`` (the entry point of `up`) and once from the real `dflash-ipc up`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_toml
from test_bad_configs import DELETE, apply, base_config

from dflash_ipc.config import RESOLVED_CONFIG_FILE, ConfigError, config_from_dict
from dflash_ipc.drafter.checkpoint.layout import META_FILE, run_config_hash, step_dir_name
from dflash_ipc.drafter.checkpoint.store import BatchLedger, save_checkpoint
from dflash_ipc.runtime.preflight import validate_for_up
from dflash_ipc.runtime.resume_check import config_differences

CLI = [sys.executable, "-m", "dflash_ipc.cli"]


def write_checkpoint(run_dir: Path, raw: dict, step: int = 4, *, store_config: bool = True) -> Path:
    """A checkpoint as a drafter of the config ``raw`` writes it (tiny tensors: only meta.json is compared)."""
    config = config_from_dict(raw, "ckpt.toml").to_dict()
    config = json.loads(json.dumps(config))
    extra = {"reason": "test", "tokens_total": 0} | ({"config": config} if store_config else {})
    save_checkpoint(
        run_dir / "checkpoints",
        step,
        model_state={"fc.weight": torch.zeros(2, 2)},
        trainer_state={"step": step},
        rng_state=None,
        ledger=BatchLedger([[0, 0, i] for i in range(step)]),
        extra=extra,
        config_hash=run_config_hash(config),
    )
    return run_dir / "checkpoints" / step_dir_name(step)


def refusal(tmp_path: Path, ckpt_raw: dict, run_raw: dict) -> tuple[Path, str]:
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, ckpt_raw)
    path = write_toml(tmp_path / "now.toml", run_raw)
    with pytest.raises(ConfigError) as ei:
        validate_for_up(path, str(run_dir), resume=True)
    assert not (run_dir / "logs").exists()  # `up` makes logs/ before it spawns anything
    return path, str(ei.value)


THREE_LAYERS = {"drafter.num_layers": 3, "drafter.layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


@pytest.mark.parametrize(
    "name, ckpt_patch, run_patch, key, fragment",
    [
        ("drafter-layers", THREE_LAYERS, {}, "drafter.layer_types", "drafter.num_layers: 3 in the checkpoint, 2 now"),
        ("seed", {"run.seed": 1}, {}, "run.seed", "run.seed: 1 in the checkpoint, 0 now"),
        ("target-shape", {}, {"target.spec.intermediate_size": 256}, "target.spec.intermediate_size", "128 in the checkpoint, 256 now"),
        ("data", {}, {"data.builtin_samples": 900}, "data.builtin_samples", "800 in the checkpoint, 900 now"),
        ("learning-rate", {}, {"training.lr": 1e-3}, "training.lr", "0.003 in the checkpoint, 0.001 now"),
        ("target-count", {}, {"topology.targets": ["cpu"]}, "topology.targets", "2 processes in the checkpoint, 1 processes now"),
        ("drafter-dtype", {}, {"drafter.dtype": "bfloat16"}, "drafter.dtype", '"float32" in the checkpoint, "bfloat16" now'),
        ("spec-key-added", {}, {"target.spec.attention_bias": True}, "target.spec.attention_bias", "(absent) in the checkpoint, true now"),
    ],
)
def test_resume_from_another_config_names_the_keys(tmp_path, name, ckpt_patch, run_patch, key, fragment):
    path, msg = refusal(tmp_path, apply(base_config(), ckpt_patch), apply(base_config(), run_patch))
    assert msg.startswith(f"{path}: {key}: differs from the config of the checkpoint "), msg
    assert fragment in msg and "stored in its meta.json" in msg, msg


def test_operational_keys_may_change_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, base_config())
    changed = {
        "run.heartbeat_timeout_s": 90,
        "training.max_steps": 80,
        "training.checkpoint_every": 5,
        "transport.ring_slots": 6,
        "drafter.anchor_chunk": 16,
        "drafter.fp8_linears": "rowwise",  # the same weights, trained with other matmuls
        "run.name": "renamed",
    }
    validate_for_up(write_toml(tmp_path / "now.toml", apply(base_config(), changed)), str(run_dir), resume=True)


def test_edited_config_hash_is_refused(tmp_path):
    """Today's trial: meta.json's config_hash edited to match a new config. The stored config says otherwise."""
    run_dir = tmp_path / "run"
    ckpt = write_checkpoint(run_dir, apply(base_config(), THREE_LAYERS))
    now = apply(base_config(), {})
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["config_hash"] = run_config_hash(json.loads(json.dumps(config_from_dict(now).to_dict())))
    (ckpt / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as ei:
        validate_for_up(write_toml(tmp_path / "now.toml", now), str(run_dir), resume=True)
    assert str(ei.value).startswith(f"{ckpt / META_FILE}: config_hash: is "), ei.value
    assert "was edited" in str(ei.value)


def test_every_checkpoint_is_compared_not_only_the_latest(tmp_path):
    """The drafter falls back to an older complete checkpoint when the newest is damaged."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, apply(base_config(), {"run.seed": 7}), step=2)
    write_checkpoint(run_dir, base_config(), step=4)
    with pytest.raises(ConfigError, match=r": run\.seed: differs from the config of the checkpoint .*step-000002"):
        validate_for_up(write_toml(tmp_path / "now.toml", base_config()), str(run_dir), resume=True)


def test_older_checkpoint_compared_through_the_run_dirs_frozen_config(tmp_path):
    """A checkpoint without a stored config: RUN_DIR/config.json, when its hash is the checkpoint's, names the keys."""
    run_dir = tmp_path / "run"
    old = apply(base_config(), THREE_LAYERS)
    write_checkpoint(run_dir, old, store_config=False)
    frozen = json.loads(json.dumps(config_from_dict(old).to_dict()))
    (run_dir / RESOLVED_CONFIG_FILE).write_text(json.dumps({"source": "old.toml", "config": frozen}))
    path = write_toml(tmp_path / "now.toml", base_config())
    with pytest.raises(ConfigError, match=r"drafter\.num_layers: 3 in the checkpoint, 2 now") as ei:
        validate_for_up(path, str(run_dir), resume=True)
    assert f"{run_dir / RESOLVED_CONFIG_FILE}, whose hash it records" in str(ei.value)
    # without that file only the hash is left: still refused, naming --resume
    (run_dir / RESOLVED_CONFIG_FILE).unlink()
    with pytest.raises(ConfigError, match=r": --resume: .* was written by another config \(hash "):
        validate_for_up(path, str(run_dir), resume=True)


def test_config_differences_ignores_only_the_operational_keys():
    a = json.loads(json.dumps(config_from_dict(base_config()).to_dict()))
    b = json.loads(json.dumps(config_from_dict(apply(base_config(), {"run.seed": 3, "run.log_level": "debug"})).to_dict()))
    assert config_differences(a, b) == [("run.seed", 0, 3)]
    c = json.loads(
        json.dumps(config_from_dict(apply(base_config(), {"topology.targets": ["cpu", "cpu"], "target.spec.head_dim": DELETE})).to_dict())
    )
    assert config_differences(a, c) == [("target.spec.head_dim", 16, "(absent)")]
    retired = json.loads(json.dumps(a))
    retired["drafter"]["flex_tile"] = 128  # a key the config no longer has
    assert config_differences(retired, a) == []


def test_a_key_added_after_the_checkpoint_is_kept_at_its_default(tmp_path):
    """A checkpoint written before ``drafter.draft_vocab_size`` existed resumes while the run leaves it at
    its default (the whole head, as then); set to anything else, the difference is named."""
    run_dir = tmp_path / "run"
    step_dir = write_checkpoint(run_dir, base_config())
    meta = json.loads((step_dir / META_FILE).read_text())
    stored = meta["extra"]["config"]
    del stored["drafter"]["draft_vocab_size"], stored["training"]["max_seconds"]  # as an older version wrote it
    del meta["meta_sha256"], meta["sha256"]  # which wrote no digests either
    meta["config_hash"] = run_config_hash(stored)
    (step_dir / META_FILE).write_text(json.dumps(meta))
    validate_for_up(write_toml(tmp_path / "same.toml", base_config()), str(run_dir), resume=True)
    path = write_toml(tmp_path / "vocab.toml", apply(base_config(), {"drafter.draft_vocab_size": 64}))
    with pytest.raises(ConfigError) as ei:
        validate_for_up(path, str(run_dir), resume=True)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: drafter.draft_vocab_size: differs from the config of the checkpoint "), msg
    assert "drafter.draft_vocab_size: (absent) in the checkpoint, 64 now" in msg, msg


@pytest.mark.slow
def test_cli_up_resume_from_another_config_starts_nothing(tmp_path):
    """The real `dflash-ipc up --resume`: exit 2, the key named, nothing spawned, the run dir as it was."""
    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, apply(base_config(), THREE_LAYERS))
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    path = write_toml(tmp_path / "now.toml", base_config())
    proc = subprocess.run(
        [*CLI, "up", "--config", str(path), "--run-dir", str(run_dir), "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {path}: drafter.layer_types: differs from the config of the checkpoint"), proc.stderr
    assert "drafter.num_layers: 3 in the checkpoint, 2 now" in proc.stderr and "Traceback" not in proc.stderr
    assert "[up] started" not in proc.stdout and "[up] data:" not in proc.stdout
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
