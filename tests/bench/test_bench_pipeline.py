"""`dflash-ipc bench pipeline` on CPU: real process groups per variant, figures in one JSON.

Two variants run here, the pipeline and its forward-only ceiling (the ratio the bench exists
for); what the other variants change is checked against the config loader in
tests/bench/test_bench_variants.py (warmup's cut-down target, depth-N, anchors-N, anchors-auto), and the
follow-wait figures the bench reads from metrics.jsonl there too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SMALL_RUN, tiny_cpu_config, write_toml

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.own_forkserver  # the RSS of the supervisor's process tree, by role
def test_bench_pipeline_runs_variants_and_reports_ratios(tmp_path):
    cfg = write_toml(tmp_path / "bench.toml", tiny_cpu_config(data=SMALL_RUN["data"]))  # the bench sets its own training keys
    out = tmp_path / "variants.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ipc.cli",
            "bench",
            "pipeline",
            "--config",
            str(cfg),
            "--steps",
            "4",
            "--variants",
            "forward-only,cuda-ipc",
            "--out",
            str(out),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    v = result["variants"]
    assert set(v) == {"forward-only", "cuda-ipc"}
    assert all(x["exit_code"] == 0 for x in v.values())
    assert v["cuda-ipc"]["backend"] == "cpu-shm" and v["cuda-ipc"]["ring_slots"] == 4  # CPU: cpu-shm rings, the config's depth
    assert v["cuda-ipc"]["steps"] == 4 and v["cuda-ipc"]["tokens_per_s"] > 0
    ipc = v["cuda-ipc"]
    assert ipc["tokens_per_s"] == min(ipc["target_tokens_per_s"], ipc["drafter_tokens_per_s"]) and ipc["bound_by"] in ("target", "drafter")
    # the tree's RSS, split by role process (named from the supervisor's pid map: no title-less "python3" twin)
    assert set(ipc["peak_host_rss_by_process_tree"]) == {
        "supervisor",
        "dflash-ipc:target:0",
        "dflash-ipc:target:1",
        "dflash-ipc:drafter:0",
        "dflash-ipc:drafter:1",
    }
    assert all(0 <= t["pack_overlap_pct"] <= 100 for t in ipc["targets"])
    assert set(v["cuda-ipc"]["drafter_step_split_s"]) >= {"wait_s", "copy_s", "forward_s", "backward_s", "optimizer_s"}
    assert v["forward-only"]["tokens_per_s"] > 0 and v["forward-only"]["capture_vs_bare"] > 0
    # the ceiling ran every batch the pipeline forwards (its 4 steps over 2 targets, and a 4-slot ring's depth + 2),
    # each once untimed first
    assert [t["forwards"] for t in v["forward-only"]["targets"]] == [4 + 4 + 2] * 2
    assert v["forward-only"]["first_pass_forward_s"] > 0 and v["forward-only"]["first_pass_vs_timed"] > 0
    assert all(x["peak_host_rss_bytes"] > 0 for x in v.values())
    assert 0 < result["ratio_pipeline_to_forward_only"]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["variant"] for x in lines] == ["forward-only", "cuda-ipc"]
    # whole-run figure and the measured profile, with the split advice for this run's 4 processes and for 8
    assert 0 < ipc["whole_run_tokens_per_s"] and ipc["drafter_busy_tokens_per_s_per_gpu"] > 0 and ipc["target_slot_wait_s"] >= 0
    assert "steady_tokens_per_s" not in ipc  # 4 steps never get past the start-up backlog of a 4-slot ring
    prof = result["profile"]
    assert prof["target_tokens_per_s"] == v["forward-only"]["target_tokens_per_s"] / 2
    assert set(result["topology"]) == {"4", "8"} and result["topology"]["8"]["targets"] + result["topology"]["8"]["drafters"] == 8
