"""The seed topology of an 8-GPU host (5 targets + 3 drafters) as real processes on CPU.

Proves on tiny models what the 8-GPU run relies on: least-busy routing spreads the slots of
all five targets over all three drafters, and the three-drafter data-parallel group trains in
lockstep (every rank finishes at the same step, one metrics line per step).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_five_targets_three_drafters_route_and_train_in_step(tmp_path):
    text = (REPO / "configs" / "tiny-cpu.toml").read_text()
    text = text.replace('targets = ["cpu", "cpu"]', 'targets = ["cpu", "cpu", "cpu", "cpu", "cpu"]')
    text = text.replace('drafters = ["cpu", "cpu"]', 'drafters = ["cpu", "cpu", "cpu"]')
    text = text.replace("builtin_samples = 800", "builtin_samples = 300").replace("max_seq_len = 512", "max_seq_len = 256")
    text = text.replace("bucket_edges = [64, 128, 256, 512]", "bucket_edges = [64, 128, 256]").replace("token_budget = 2048", "token_budget = 1024")
    text = text.replace("sliding_window = 256", "sliding_window = 128")
    cfg = tmp_path / "5t3d.toml"
    cfg.write_text(text)
    run = tmp_path / "run"
    steps = 6
    proc = subprocess.run([sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(cfg), "--run-dir", str(run), "--max-steps", str(steps)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    received = []
    for d in range(3):
        log = (run / "logs" / f"drafter-{d}.log").read_text()
        m = re.search(r"finishing at step (\d+): .*batches received per target: \[([\d, ]+)\]", log)
        assert m, log[-2000:]
        assert int(m.group(1)) == steps  # lockstep: every rank ends at the same step
        received.append([int(x) for x in m.group(2).split(",")])
    # Every drafter got work, and the work came from several targets.
    assert all(sum(r) >= 1 for r in received), received
    assert sum(1 for t in range(5) if any(r[t] for r in received)) >= 3, received
    routed = []
    for t in range(5):
        log = (run / "logs" / f"target-{t}.log").read_text()
        m = re.search(r"slots routed per drafter: \[([\d, ]+)\]", log)
        assert m, log[-2000:]
        routed.append([int(x) for x in m.group(1).split(",")])
    per_drafter = [sum(r[d] for r in routed) for d in range(3)]
    assert all(n > 0 for n in per_drafter), routed
