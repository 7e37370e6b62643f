"""The training's record per step: ``RUN_DIR/metrics.jsonl`` (one JSON line a step) and, with
``run.tensorboard``, TensorBoard events beside it. Global rank 0 writes it; every write is fenced
(:mod:`dflash_ipc.rundir.fence`), so a process of an earlier `up` never appends to a newer run's record.

A resumed run first drops the steps after its checkpoint (trained before a crash, trained again now): the
lines of metrics.jsonl by :meth:`MetricsLog.drop_after`, the events by TensorBoard's ``purge_step``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from dflash_ipc.rundir import bounded_json
from dflash_ipc.rundir.fence import Fence
from dflash_ipc.rundir.fsutil import open_append, write_text_atomic

log = logging.getLogger(__name__)

#: (metrics.jsonl key, TensorBoard tag) of the scalars written per step when run.tensorboard is on
TENSORBOARD_SCALARS = (
    ("loss", "train/loss"),
    ("acc", "train/acc"),
    ("tau", "train/tau"),
    ("tokens_per_s", "train/tokens_per_s"),
    ("lr", "train/lr"),
    ("tau_holdout", "holdout/tau"),
    ("tau_holdout_uniform", "holdout/tau_uniform"),
    ("loss_holdout", "holdout/loss"),
)


class MetricsLog:
    def __init__(self, run_dir: Path, fence: Fence):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.fence = fence
        self._tensorboard = None

    def open_tensorboard(self, purge_step: int | None) -> None:
        """Events beside metrics.jsonl from now on; ``purge_step``: a resumed run hides the events of that step
        and after (every step after its checkpoint, or all of them without one: trained again now)."""
        from torch.utils.tensorboard import SummaryWriter

        self._tensorboard = SummaryWriter(log_dir=str(self.run_dir), purge_step=purge_step, flush_secs=10)

    def drop_after(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (and a torn last line of a crashed run)."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = []
        for ln in lines:
            try:
                if bounded_json.loads(ln)["step"] <= step:
                    kept.append(ln)
            except (ValueError, KeyError, TypeError):
                pass  # a torn last line of a crashed run
        if len(kept) != len(lines):
            with self.fence.guard("metrics.jsonl (dropping the steps after the checkpoint)"):
                write_text_atomic(self.path, "".join(ln + "\n" for ln in kept))
            log.info("resume: dropped %d metrics lines after step %d", len(lines) - len(kept), step)

    def write(self, rec: dict) -> None:
        with self.fence.guard(f"metrics.jsonl (step {rec['step']})"), open_append(self.path) as f:
            f.write(json.dumps(rec) + "\n")
        if self._tensorboard is not None:
            for key, tag in TENSORBOARD_SCALARS:
                value = rec.get(key)
                if value is not None and math.isfinite(value):
                    self._tensorboard.add_scalar(tag, value, rec["step"])

    def close(self) -> None:
        """Close the TensorBoard writer (flushes its last events); metrics.jsonl is closed per line."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
