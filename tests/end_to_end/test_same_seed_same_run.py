"""A seed repeats a run: the embedded default (configs/tiny-cpu.toml: 2 targets, 2 drafters) with
``run.deterministic = true``, real `dflash-ipc up`, gives the same per-step losses for the same seed
and different ones for another seed.

Without run.deterministic the batches go to whichever drafter is least busy, so which rank trains
which batch (and with which rank's anchor sampling) follows the timing. The three runs go at once:
the same seed must repeat its losses under whatever load the other runs make.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import tiny_cpu_config, up_argv, write_toml

pytestmark = pytest.mark.slow

STEPS = 10
OTHER_STEPS = 2  # another seed differs from its first step on


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def test_same_seed_gives_the_same_losses_and_another_seed_does_not(tmp_path):
    runs = {}
    for name, seed, steps in (("a", 0, STEPS), ("b", 0, STEPS), ("other", 1, OTHER_STEPS)):
        config = write_toml(tmp_path / f"{name}.toml", tiny_cpu_config(run={"seed": seed, "deterministic": True}))
        run_dir = tmp_path / name
        out = (tmp_path / f"{name}.out").open("w")
        proc = subprocess.Popen(up_argv(config, run_dir, steps), stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        runs[name] = (proc, run_dir, out)
    try:
        for name, (proc, _, out) in runs.items():
            assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]
            out.close()
    finally:
        for proc, _, out in runs.values():
            if proc.poll() is None:  # a failed wait: SIGTERM lets `up` tear its processes down
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            out.close()
    output = (tmp_path / "a.out").read_text()
    assert len(re.findall(r"data: \d+ samples", output)) == 1, output  # the data summary, said once (not also as a log line)
    a, b, other = (losses(runs[n][1]) for n in ("a", "b", "other"))
    assert len(a) == len(b) == STEPS and len(other) == OTHER_STEPS
    assert a == b  # bit for bit
    assert other[0] != a[0] and other[1] != a[1]  # another seed: another initialisation from step 1
