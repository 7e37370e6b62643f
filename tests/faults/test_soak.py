"""Soak: many tiny steps through the whole pipeline; host RSS of every process sampled
while it trains, and its drift after warm-up must stay under 1 %.

CI runs a short soak (100 steps); DFLASH_IPC_SOAK_STEPS=N (with DFLASH_IPC_FAULTS_FULL=1) runs a
longer one. Drift per process (growth must stay under 1 %; a fall is reported): (median RSS of the last quarter of samples - median of the
second quarter) / median of the second quarter (the first quarter is warm-up: allocator pools,
lazily imported modules, the first checkpoint). Medians, so one sample taken mid-checkpoint does
not decide it. The figures are printed (``FAULTS:``).

The short CI soak cannot tell a leak from a drafter's allocator noise of a few MiB (seen over 150
steps: -2.7 % ... +1.2 % of ~390 MiB, moving with checkpoint writes), so there growth may also stay
under ``CI_NOISE_BYTES``: it fails on a leak of ~330 KiB a step or more (16 MiB over the ~50 steps
between the two medians: a drafter step's retained logits alone are 1 MiB); the long soak is judged
on the 1 % alone.
"""

from __future__ import annotations

import os
import statistics
import time

import psutil
import pytest
from fault_harness import FULL, Up, leftovers, report, write_config

pytestmark = pytest.mark.slow

CI_STEPS = 100
CI_NOISE_BYTES = 16 << 20


def _soak(tmp_path, steps: int) -> dict[str, tuple[float, float]]:
    # tiny batches: 64-token sequences, 4 per batch; enough samples for `steps` steps per drafter
    samples = steps * 2 * 4 * 2  # twice what the steps need: max_steps ends the run, not the data
    data = {"builtin_samples": samples, "max_seq_len": 64, "bucket_edges": [32, 64], "token_budget": 256, "max_batch_size": 4}
    cfg = write_config(tmp_path / "c.toml", data=data, training={"max_steps": steps, "checkpoint_every": max(10, steps // 10)})
    up = Up(cfg, tmp_path / "run")
    rss: dict[str, list[int]] = {}
    try:
        up.wait_until(lambda: up.steps_logged() >= 1, "the first step", poll_s=0.05)
        pids = up.child_pids()
        procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        procs["supervisor"] = psutil.Process(up.proc.pid)
        while up.proc.poll() is None:
            for name, p in procs.items():
                try:
                    rss.setdefault(name, []).append(p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.2)
        code = up.wait()
        out = up.output
    finally:
        up.close()
    assert code == 0, out[-3000:]
    drift = {}
    for name, xs in rss.items():
        n = len(xs)
        if n < 8:
            continue
        base = statistics.median(xs[n // 4 : n // 2])
        last = statistics.median(xs[3 * n // 4 :])
        drift[name] = (100.0 * (last - base) / base, last - base)  # (% growth, bytes of growth)
    report(
        f"soak {steps} steps: {min(len(x) for x in rss.values())} RSS samples per process; drift after warm-up % "
        + ", ".join(f"{k} {pct:+.2f}" for k, (pct, _) in sorted(drift.items()))
        + "; RSS MiB "
        + ", ".join(f"{k} {statistics.median(v[-5:]) / 2**20:.0f}" for k, v in sorted(rss.items()))
    )
    assert up.steps_logged() == steps
    assert leftovers(up) == []
    return drift


# the long soak runs for as long as it was asked to: the suite's 300 s safety net would cut it
@pytest.mark.timeout(6 * 3600 if FULL and os.environ.get("DFLASH_IPC_SOAK_STEPS") else 300)
def test_soak_rss_does_not_drift(tmp_path):
    steps = int(os.environ.get("DFLASH_IPC_SOAK_STEPS", "0")) if FULL else 0
    drift = _soak(tmp_path, steps or CI_STEPS)
    # growth is what a leak looks like; RSS going down after warm-up (pages handed back once the
    # first checkpoints are written) is reported but not a failure
    short = not steps
    assert drift and all(pct < 1.0 or (short and grew < CI_NOISE_BYTES) for pct, grew in drift.values()), drift
