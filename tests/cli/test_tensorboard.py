"""run.tensorboard: TensorBoard event files beside metrics.jsonl, and the config's refusal
without the optional package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_RUN_STEPS, tensorboard_config

REPO = Path(__file__).resolve().parents[2]


def _config_with_tensorboard(tmp_path: Path) -> Path:
    return tensorboard_config(tmp_path / "tb.toml")


def test_config_refuses_tensorboard_without_the_package(tmp_path):
    config = _config_with_tensorboard(tmp_path)
    # The package made unimportable for this interpreter only, as on an install without the extra.
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from dflash_ipc.cli import main\n"
        f"main(['check-config', '--config', {str(config)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{config}: run.tensorboard:" in proc.stderr
    assert 'pip install "dflash-ipc[tensorboard]"' in proc.stderr


def test_config_accepts_tensorboard_with_the_package(tmp_path):
    pytest.importorskip("tensorboard")
    from dflash_ipc.config import load_config

    assert load_config(_config_with_tensorboard(tmp_path)).run.tensorboard is True
    assert load_config(REPO / "configs" / "tiny-cpu.toml").run.tensorboard is False


@pytest.mark.slow
def test_tiny_run_writes_tensorboard_scalars_that_read_back(shared_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, steps = shared_run.run_dir, SHARED_RUN_STEPS  # conftest: run.tensorboard = true (test_up, test_progress read it too)
    assert shared_run.returncode == 0, shared_run.output[-4000:]
    events = sorted(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # rank 0 only
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    for key in ("loss", "tau", "tokens_per_s", "lr"):
        scalars = acc.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == list(range(1, steps + 1)), key
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in metrics], rel=1e-5), key
    expected_acc = [(m["step"], m["acc"]) for m in metrics if m["acc"] is not None]
    if expected_acc:
        assert [(s.step, pytest.approx(s.value, rel=1e-5)) for s in acc.Scalars("train/acc")] == expected_acc
