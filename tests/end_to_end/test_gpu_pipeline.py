"""GPU end to end: the whole pipeline (`dflash-ipc up`) on one H200 and on two.

Declared as data: each case is (target device, drafter device, transport backend, drafter speed options);
the two-GPU cases are marked ``gpu(2)`` (skipped by tests/conftest.py on a one-GPU machine). Every case's
target runs its elementwise work fused (``target.fuse_elementwise = "auto"`` on CUDA); the ``compiled``
case also trains with the drafter's speed options (``drafter.compile``, ``training.ce_compile``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_cpu_config, write_toml

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

CASES = [
    pytest.param("cuda:0", "cuda:0", "auto", False, "auto", id="one-gpu-shared"),
    pytest.param("cuda:0", "cuda:0", "auto", True, "auto", id="one-gpu-shared-compiled"),
    # run.launcher "auto" execs on CUDA; this case validates the children forked from the server there
    pytest.param("cuda:0", "cuda:0", "auto", False, "forkserver", id="one-gpu-shared-forkserver"),
    pytest.param("cuda:0", "cuda:1", "cuda-ipc", False, "auto", id="two-gpus-cuda-ipc", marks=pytest.mark.gpu(2)),
    pytest.param("cuda:0", "cuda:1", "host-pinned", False, "auto", id="two-gpus-host-pinned", marks=pytest.mark.gpu(2)),
]


def _gpu_config(tmp_path: Path, target: str, drafter: str, backend: str, compiled: bool, launcher: str = "auto") -> Path:
    raw = tiny_cpu_config(
        run={"launcher": launcher},
        topology={"targets": [target], "drafters": [drafter]},
        transport={"backend": backend},
        target={"dtype": "bfloat16"},
        drafter={"dtype": "bfloat16", "attention": "auto", "compile": compiled},
        training={"ce_compile": compiled, "ce_chunk_tokens": 8192 if compiled else 2048},
    )
    return write_toml(tmp_path / "gpu.toml", raw)


@pytest.mark.parametrize("target,drafter,backend,compiled,launcher", CASES)
def test_pipeline_end_to_end_on_gpu(tmp_path, target, drafter, backend, compiled, launcher):
    cfg = _gpu_config(tmp_path, target, drafter, backend, compiled, launcher)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(cfg), "--run-dir", str(run_dir), "--max-steps", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert all(r["loss"] == r["loss"] and r["tokens"] > 0 for r in recs)  # finite, real batches
    target_log = (run_dir / "logs" / "target-0.log").read_text()
    expected = {"auto": "cuda-ipc", "cuda-ipc": "cuda-ipc", "host-pinned": "host-pinned"}[backend]
    assert f"ring: {expected}" in target_log
    assert "elementwise fused by torch.compile" in target_log
    assert (run_dir / "export" / "drafter" / "model.safetensors").exists()
    assert not list(Path("/dev/shm").glob(f"dflash-ipc-{(run_dir / 'run_id').read_text().strip()}-*"))
