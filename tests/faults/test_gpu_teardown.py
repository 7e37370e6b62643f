"""On GPUs: a drafter SIGKILLed while it holds the target's CUDA IPC mappings ends
the group, and every GPU's free memory returns to what it was before the run started.

A real `dflash-ipc up` (tiny bf16 model, target on cuda:0, drafter on cuda:1, cuda-ipc ring),
killed at a random training step. Free memory is read with ``torch.cuda.mem_get_info`` in this
test process, whose own CUDA context is created before the baseline and so stays constant.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from fault_harness import Up, leftovers, report, wait_gone, write_config

pytestmark = [pytest.mark.gpu(2), pytest.mark.slow]

MIB = 1 << 20
# What another process may still hold on a GPU for a moment after its group is gone (the CUDA
# driver frees a dead process's memory asynchronously); the ring alone is far larger.
SLACK_BYTES = 64 * MIB


def _free_bytes(devices: list[int]) -> dict[int, int]:
    import torch

    return {d: torch.cuda.mem_get_info(d)[0] for d in devices}


def test_sigkilled_drafter_holding_ipc_mappings_frees_every_gpu(tmp_path):
    import torch

    devices = [0, 1]
    for d in devices:
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{d}")  # this process's context exists before the baseline
    baseline = _free_bytes(devices)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cfg = write_config(
        tmp_path / "gpu.toml",
        topology={"targets": ["cuda:0"], "drafters": ["cuda:1"]},
        transport={"backend": "cuda-ipc", "ring_slots": 4},
        target={"dtype": "bfloat16"},
        drafter={"dtype": "bfloat16", "attention": "auto"},
        data={"num_epochs": 50},
    )
    up = Up(cfg, tmp_path / "run")
    try:
        k = rng.randint(2, 6)
        up.wait_until(lambda: up.steps_logged() >= k, f"{k} training steps", timeout=240)
        during = _free_bytes(devices)
        pids = up.child_pids()
        t_kill = time.monotonic()
        os.kill(pids["drafter-0"], signal.SIGKILL)
        rc = up.wait(timeout=120)
        gone_s = wait_gone(up, pids, timeout=30)
        after = baseline
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = _free_bytes(devices)
            if all(after[d] >= baseline[d] - SLACK_BYTES for d in devices):
                break
            time.sleep(0.25)
        detect_s = time.monotonic() - t_kill
        report(
            f"gpu teardown seed={seed} kill at step>={k}: rc={rc} gone={gone_s} s; free MiB before/during/after "
            + ", ".join(f"cuda:{d} {baseline[d] // MIB}/{during[d] // MIB}/{after[d] // MIB}" for d in devices)
            + f"; back to baseline within {detect_s:.1f} s of the kill"
        )
        assert rc == 1, up.output[-3000:]
        assert "drafter-0" in up.output
        assert gone_s is not None, leftovers(up, pids)
        assert not leftovers(up, pids)
        assert during[0] < baseline[0] - 4 * MIB, "the run held no memory on cuda:0: the check would prove nothing"
        for d in devices:
            assert after[d] >= baseline[d] - SLACK_BYTES, f"cuda:{d}: {(baseline[d] - after[d]) // MIB} MiB still held after teardown"
    finally:
        up.close()
