"""The family matrix: every family of tests/families/family_zoo.py through the checks, a few training steps of
the real role loops (packed forward forced on the CPU: the per-document reference kernel) and the export;
the real ``dflash-ipc check-config`` and ``up`` commands for three families whose traits differ most.
(Captures against transformers on both paths: test_packed_paths.py; eval and gen-data: test_decoding.py.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_cpu_config, write_toml
from family_zoo import FAMILIES
from loop_harness import SMALL, InprocRun

from dflash_ipc.config import load_config
from dflash_ipc.runtime.preflight import check_machine

#: Small enough that twenty families train in seconds each: 2 steps over 24 short documents.
MATRIX = {
    "data": {**SMALL["data"], "builtin_samples": 24, "token_budget": 256},
    "drafter": {"warm_up": False, "num_anchors": 8},
    "training": {"max_steps": 2, "checkpoint_every": 0},
}


def family_run_config(checkpoint: Path, directory: Path, **sections) -> Path:
    """configs/tiny-cpu.toml made small, with the family's checkpoint (and its tokenizer) as the target."""
    raw = tiny_cpu_config(**MATRIX)
    raw["target"].pop("spec", None)
    raw["target"].update(model_path=str(checkpoint), tokenizer=str(checkpoint), num_capture_layers=2)
    raw["topology"].update(targets=["cpu"], drafters=["cpu"])
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    directory.mkdir(parents=True, exist_ok=True)
    return write_toml(directory / "config.toml", raw)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_passes_the_checks_trains_in_the_role_loops_and_exports(name, family_checkpoint, tmp_path):
    cfg = load_config(family_run_config(family_checkpoint(name), tmp_path, target={"varlen": True}))
    check_machine(cfg)  # what check-config and up's probe run before any process starts
    run = InprocRun(cfg, tmp_path / "run")
    try:
        summary = run.run()
    finally:
        run.close()
    assert summary.final.work.step == 2 and math.isfinite(summary.final.work.loss), summary
    assert all(t.core.model.varlen for t in run.targets)
    exported = json.loads((Path(summary.export) / "config.json").read_text())
    assert exported["dflash_config"]["num_target_layers"] == 4 and len(exported["dflash_config"]["target_layer_ids"]) == 2


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ipc.cli", *argv], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("gpt_oss", "gpt_oss family (GptOss); attention eager; sliding window of 8, attention sinks; 4 experts, 2 active"),
        ("qwen3_5_moe", "qwen3_5_moe_text family (Qwen3_5); attention sdpa; 4 experts, 2 active"),
        ("gemma3", "gemma3_text family (Gemma3); attention sdpa; sliding window of 8; frozen head: embeddings x 8"),
    ],
)
def test_check_config_names_the_family_and_up_trains_and_exports_it(name, says, family_checkpoint, tmp_path):
    config = family_run_config(family_checkpoint(name), tmp_path, training={"max_steps": 3})
    checked = _cli("check-config", "--config", str(config), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert says in checked.stderr and "cpu: padded (auto: padded" in checked.stderr, checked.stderr
    up = _cli("up", "--config", str(config), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert (tmp_path / "run" / "export" / "drafter" / "model.safetensors").is_file()
