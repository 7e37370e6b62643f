"""A run that crashed before its first checkpoint, resumed: every step is logged once.

A real `dflash-ipc up` (tiny CPU config, no checkpoint before the end) loses drafter-0 to SIGKILL a few
steps in: exit 1, metrics.jsonl holds the steps it trained, no checkpoint exists. `up --resume` starts
again from step 0 (there is nothing to resume from) and drafter 0 drops those lines before it logs its
own: metrics.jsonl then holds steps 1..N once, and the summary counts N. (`--resume` on a directory that
does not exist is refused before anything starts: tests/faults/test_bad_cli.py.)
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from fault_harness import Up, report, write_config

pytestmark = pytest.mark.slow


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_run_resumed_after_a_crash_before_its_first_checkpoint_logs_each_step_once(tmp_path):
    cfg = write_config(tmp_path / "c.toml")  # training.checkpoint_every = 0: the first checkpoint would be the last step's
    run_dir = tmp_path / "run"
    crashed = Up(cfg, run_dir)
    try:
        crashed.wait_until(lambda: crashed.steps_logged() >= 3, "3 steps")
        os.kill(crashed.child_pids()["drafter-0"], signal.SIGKILL)
        assert crashed.wait() == 1, crashed.output[-3000:]
    finally:
        crashed.close()
    before = logged_steps(run_dir)
    assert before == list(range(1, len(before) + 1)) and len(before) >= 3, before
    assert not (run_dir / "checkpoints" / "latest").exists(), "the crash came before the first checkpoint"
    total = len(before) + 2  # past the crash's steps: they are all trained again, then two more
    again = Up(cfg, run_dir, "--resume", "--max-steps", str(total), name="again")
    try:
        code = again.wait()
        out = again.output
    finally:
        again.close()
    assert code == 0, out[-3000:]
    assert logged_steps(run_dir) == list(range(1, total + 1))
    summary = out[out.index("[up] finished") :]
    assert f"steps {total}, loss" in summary and f"(mean of all {total} " in summary, summary
    report(f"resume after a crash at step {len(before)} with no checkpoint: steps 1..{total} logged once")
