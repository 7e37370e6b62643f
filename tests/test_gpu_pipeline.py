"""GPU end to end: the whole pipeline (`dflash-ipc up`) on one H200 and on two (run on the lent GPU).

Declared as data: each case is (name, target device, drafter device, transport backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")]

REPO = Path(__file__).resolve().parents[1]

CASES = [
    ("one-gpu-shared", "cuda:0", "cuda:0", "auto", 1),
    ("two-gpus-cuda-ipc", "cuda:0", "cuda:1", "cuda-ipc", 2),
    ("two-gpus-host-pinned", "cuda:0", "cuda:1", "host-pinned", 2),
]


def _gpu_config(tmp_path: Path, target: str, drafter: str, backend: str) -> Path:
    text = (REPO / "configs" / "tiny-cpu.toml").read_text()
    text = text.replace('targets = ["cpu", "cpu"]', f'targets = ["{target}"]')
    text = text.replace('drafters = ["cpu", "cpu"]', f'drafters = ["{drafter}"]')
    text = text.replace('backend = "cpu-shm"', f'backend = "{backend}"')
    text = text.replace('dtype = "float32"', 'dtype = "bfloat16"')
    text = text.replace('attention = "sdpa"', 'attention = "auto"')
    path = tmp_path / "gpu.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name,target,drafter,backend,gpus", CASES, ids=[c[0] for c in CASES])
def test_pipeline_end_to_end_on_gpu(tmp_path, name, target, drafter, backend, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    cfg = _gpu_config(tmp_path, target, drafter, backend)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(cfg), "--run-dir", str(run_dir), "--max-steps", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert all(r["loss"] == r["loss"] and r["tokens"] > 0 for r in recs)  # finite, real batches
    target_log = (run_dir / "logs" / "target-0.log").read_text()
    expected = {"auto": "cuda-ipc", "cuda-ipc": "cuda-ipc", "host-pinned": "host-pinned"}[backend]
    assert f"ring: {expected}" in target_log
    assert (run_dir / "export" / "drafter" / "model.safetensors").exists()
    assert not list(Path("/dev/shm").glob(f"dflash-ipc-{(run_dir / 'run_id').read_text().strip()}-*"))
