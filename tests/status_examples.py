"""A valid, fully populated status snapshot: what the status tests render and check against."""

from __future__ import annotations

import time
from typing import Any

from dflash_ipc.control.status import SCHEMA_VERSION, ProcessStatus, SlotCounts, StatusSnapshot, Totals


def example_status(n_targets: int = 1, n_drafters: int = 1, *, now: float | None = None) -> StatusSnapshot:
    """A snapshot of a running run with ``n_targets`` targets and ``n_drafters`` drafters, taken at ``now``."""
    now = time.time() if now is None else now
    procs: list[ProcessStatus] = []
    common: dict[str, Any] = {"state": "running", "rejected_messages": 0, "rejected_by_kind": {}, "exit_code": None}
    for r in range(n_targets):
        procs.append(
            ProcessStatus(
                role="target",
                rank=r,
                pid=20000 + r,
                device=f"cuda:{r}",
                uptime_s=3725.0,
                heartbeat_age_s=0.4,
                tokens_per_s=9100.0 + r,
                slots=SlotCounts(free=1, filling=1, ready=1, copying=1),
                inflight_per_drafter=[1] * n_drafters,
                queue_depth=None,
                step=None,
                loss=None,
                gpu_mem_allocated_bytes=30 * 2**30,
                gpu_mem_reserved_bytes=34 * 2**30,
                rss_bytes=6 * 2**30,
                busy_pct=91.0,
                wait_pct=6.5,
                **common,
            )
        )
    for r in range(n_drafters):
        procs.append(
            ProcessStatus(
                role="drafter",
                rank=r,
                pid=21000 + r,
                device=f"cuda:{n_targets + r}",
                uptime_s=3724.0,
                heartbeat_age_s=0.7,
                tokens_per_s=18200.0 / n_drafters,
                slots=None,
                inflight_per_drafter=None,
                queue_depth=1,
                step=1234,
                loss=2.3456,
                gpu_mem_allocated_bytes=41 * 2**30,
                gpu_mem_reserved_bytes=52 * 2**30,
                rss_bytes=5 * 2**30,
                busy_pct=84.0,
                wait_pct=12.0,
                anchors_per_batch=6144,
                tau_holdout=3.78 if r == 0 else None,
                **common,
            )
        )
    totals = Totals(
        tokens_per_s=18200.0,
        step=1234,
        max_steps=10000,
        loss=2.3456,
        pipeline_rss_bytes=sum(p.rss_bytes or 0 for p in procs) + 2**29,
        eta_s=11520.0,
    )
    return StatusSnapshot(
        schema=SCHEMA_VERSION,
        run_dir="/var/lib/dflash-ipc/runs/example",
        state="running",
        updated_unix=now,
        supervisor_pid=19999,
        config="/etc/dflash-ipc/example.toml",
        started_unix=now - 3730.0,
        totals=totals,
        processes=procs,
    )
