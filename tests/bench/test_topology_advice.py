"""Topology advice arithmetic (dflash_ipc.bench.topology) and `dflash-ipc plan --topology`, on hand-made profiles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_ipc.bench.topology import Profile, best_split, evaluate, splits

# docs/BENCHMARKS.md, Qwen3.6-27B shapes on H200: target 4.8 s per 49,152-token batch, drafter step 0.87 s
P27 = Profile.from_step_times(49152, 4.8, 0.87)


def test_rates_and_each_side_idle_time():
    assert P27.target_tokens_per_s == pytest.approx(10240.0)
    assert P27.drafter_tokens_per_s == pytest.approx(49152 / 0.87)
    s = evaluate(P27, 5, 3)  # the seed's 8-GPU topology
    assert s.tokens_per_s == pytest.approx(51200.0) and s.bound_by == "target"
    assert s.target_idle_pct == pytest.approx(0.0)
    assert s.drafter_idle_pct == pytest.approx(100 * (1 - 51200 / (3 * 49152 / 0.87)))  # 69.8%
    s = evaluate(P27, 7, 1)
    assert s.bound_by == "drafter" and s.tokens_per_s == pytest.approx(49152 / 0.87)
    assert s.target_idle_pct == pytest.approx(100 * (1 - (49152 / 0.87) / 71680)) and s.drafter_idle_pct == pytest.approx(0.0)


def test_best_split_for_8_and_2_gpus_at_27b_shapes():
    best = best_split(P27, 8)
    assert (best.targets, best.drafters) == (6, 2)  # 61,440 tok/s; 7+1 is drafter-bound at 56,497
    assert best.tokens_per_s == pytest.approx(61440.0) and best.drafter_idle_pct == pytest.approx(45.6, abs=0.05)
    assert best.tokens_per_s / evaluate(P27, 5, 3).tokens_per_s == pytest.approx(1.2)
    assert [(s.targets, s.drafters) for s in splits(P27, 8)] == [(t, 8 - t) for t in range(1, 8)]
    two = best_split(P27, 2)
    assert (two.targets, two.drafters) == (1, 1) and two.drafter_idle_pct == pytest.approx(100 * (1 - 0.87 / 4.8))


def test_balanced_profile_and_ties_prefer_less_idle():
    p = Profile(100.0, 300.0)  # one drafter keeps up with exactly three targets
    best = best_split(p, 8)
    assert (best.targets, best.drafters) == (6, 2) and best.bound_by == "balanced"
    assert best.tokens_per_s == pytest.approx(600.0) and best.target_idle_pct == best.drafter_idle_pct == pytest.approx(0.0)


def test_bad_profiles_are_refused_with_the_key():
    with pytest.raises(ValueError, match="drafter_tokens_per_s"):
        Profile(100.0, 0.0)
    with pytest.raises(ValueError, match="expected target_tokens_per_s"):
        Profile.from_dict({"target_batch_s": 4.8})
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        splits(P27, 1)
    # a saved bench pipeline result carries the profile under "profile"
    assert Profile.from_dict({"profile": {"target_tokens_per_s": 1.0, "drafter_tokens_per_s": 2.0}}).drafter_tokens_per_s == 2.0


def test_plan_topology_cli(tmp_path):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"tokens_per_batch": 49152, "target_batch_s": 4.8, "drafter_step_s": 0.87}))
    out = subprocess.run(
        [sys.executable, "-m", "dflash_ipc.cli", "plan", "--topology", "8", "--profile", str(prof), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert (res["best"]["targets"], res["best"]["drafters"]) == (6, 2) and len(res["splits"]) == 7
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_ipc.cli", "plan", "--topology", "8", "--profile", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "a profile is a JSON object" in proc.stderr
