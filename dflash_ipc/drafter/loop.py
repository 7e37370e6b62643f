"""The drafter's busy loop: the policy of when to train, wait, stop and checkpoint, over its core.

:class:`DrafterLoop` drives a :class:`~dflash_ipc.drafter.core.DrafterCore` and its
:class:`~dflash_ipc.transport.dataplane.ConsumerDataPlane` through a
:class:`~dflash_ipc.control.loop_io.LoopIO` (the process's sockets in ``procs/drafter.py``;
in-memory channels in the tests, which run the same loop in one process). One iteration::

    drain        SlotReady/EndOfData -> data plane; Shutdown -> stop (at the next step boundary);
                 pump copies out of the rings (SlotFree goes back the moment a copy completed)
    take         the next copied batch, if any
    holdout      a held-out batch (drafter 0 only): scored locally, no collective, never trained on
    wait         no batch, more can come, no stop: wait for a copy or a message (counted as wait)
    lockstep     otherwise every rank agrees (one all-reduce): any stop? any batch?
                   any stop or no batch anywhere ─▶ FINISHING
                   else one training step (a rank without a batch steps with zero weight)
    checkpoint   every training.checkpoint_every steps (collective, same step on every rank)
    heartbeat    every run.heartbeat_interval_s: the latest figures for the supervisor

States::

    TRAINING ──max_steps reached (or the step training.max_seconds planned: drafter/training/time_budget.py) ──▶ FINISHING
       ├──── no rank has a batch and none will come ──────▶ FINISHING ("data exhausted")
       └──── a rank saw a stop (agreed on every rank) ────▶ FINISHING (checkpoint at this boundary)
    FINISHING: checkpoint (training.checkpoint_on_finish, or always after a stop), export
               (rank 0), rank record, Done ─▶ exit
    (a checkpoint or the export of a run that learned nothing since its start or its last checkpoint, or
     whose weights exploded, is refused instead: TrainingDiverged, exit 1; drafter/training/learning.py)

A resumed run that already reached max_steps trains nothing more (systemd restarts it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dflash_ipc.control.loop_io import LoopIO
from dflash_ipc.control.protocol import Done, Heartbeat
from dflash_ipc.control.stats import DrafterStats, DrafterSummary
from dflash_ipc.transport.dataplane import ConsumerDataPlane

log = logging.getLogger(__name__)

#: How long a rank whose peer saw the supervisor's Shutdown first waits for its own
PEER_STOP_WAIT_S = 2.0


class DrafterLoop:
    def __init__(
        self,
        core: Any,  # DrafterCore
        plane: ConsumerDataPlane,
        io: LoopIO,
        *,
        rank: int,  # this process's rank among the node's drafters (the supervisor's name for it)
        heartbeat_interval_s: float,
        memory_text: Callable[[], str] = str,
    ):
        self.core, self.plane, self.io, self.rank = core, plane, io, rank
        t = core.cfg.training
        self.checkpoint_every = t.checkpoint_every
        self.checkpoint_on_finish = t.checkpoint_on_finish
        self.export_on_finish = t.export_on_finish
        self.heartbeat_interval_s = heartbeat_interval_s
        self.memory_text = memory_text
        self.wait_s = 0.0  # since the last step: the step's metrics record it
        self.wait_total = 0.0
        self.finish_reason = "data exhausted"
        self.stopped_on_request = False
        self._next_beat = 0.0
        self.t0 = time.perf_counter()

    @property
    def at_max_steps(self) -> bool:
        end = self.core.end_step
        return bool(end) and self.core.step >= end

    # -- the named steps
    def drain(self) -> None:
        for sender, msg in self.io.drain_peers():
            self.plane.handle(msg, sender)
        self.io.read_control()
        self.plane.pump()

    def holdout(self, batch) -> None:
        self.core.evaluate_holdout(batch.views, batch.msg.batch_id, batch.msg.holdout_pass_batches)
        self.plane.release(batch)

    def wait(self) -> None:
        w0 = time.perf_counter()
        if self.plane.copying or self.plane.returning:
            self.plane.wait_for_copy()
        else:
            self.io.wait(20)
        dt = time.perf_counter() - w0
        self.wait_s += dt
        self.wait_total += dt

    def lockstep(self, batch) -> bool:
        """Every rank agrees on going on; False: finish (the same answer on every rank)."""
        stop = self.io.stop
        any_batch, any_stop = self.core.trainer.agree(batch is not None, stop.requested)
        if not (any_stop or not any_batch):
            return True
        if batch is not None:
            self.plane.release(batch)  # not trained on: stays out of the ledger
        self.stopped_on_request = any_stop
        if any_stop and not stop.requested:  # a peer saw the supervisor's Shutdown first; ours is a moment behind
            deadline = time.monotonic() + PEER_STOP_WAIT_S
            while not stop.requested and time.monotonic() < deadline:
                self.io.read_control(wait_ms=50)
        self.finish_reason = (stop.reason or "stop requested (seen by another drafter)") if any_stop else "data exhausted"
        return False

    def train(self, batch) -> None:
        copy_s = batch.copy_s if batch is not None else 0.0
        self.core.train_step(batch.views if batch else None, batch.msg.batch_id if batch else None, self.wait_s, copy_s)
        self.wait_s = 0.0
        if batch is not None:
            self.plane.release(batch)

    def checkpoint(self) -> None:
        every = self.checkpoint_every
        if every and self.core.step % every == 0:
            self.core.checkpoint(f"every {every} steps")

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self._next_beat:
            self._next_beat = now + self.heartbeat_interval_s
            self.io.report(Heartbeat(role="drafter", rank=self.rank, drafter=self.stats()))

    # -- the loop
    def step(self) -> bool:
        """One iteration; False once training is over (then :meth:`finish`)."""
        if self.at_max_steps:
            return False
        self.drain()
        batch = self.plane.take()
        if batch is not None and batch.msg.holdout:
            self.holdout(batch)
        elif batch is None and not self.plane.all_ended() and not self.io.stop.requested:
            self.wait()
        else:
            if not self.lockstep(batch):
                return False
            self.train(batch)
            self.checkpoint()
        self.heartbeat(force=batch is not None)  # a step taken: its figures go out with the next beat
        self.io.progressed()
        return True

    def run(self) -> DrafterSummary:
        self.heartbeat(force=True)
        while self.step():
            pass
        return self.finish()

    def finish(self) -> DrafterSummary:
        core = self.core
        if self.at_max_steps:
            self.finish_reason = self.core.end_reason()
        log.info(
            "finishing at step %d: %s; batches received per target: %s; %s",
            core.step, self.finish_reason, self.plane.slots_done, self.memory_text(),
        )  # fmt: skip
        # Collective: every rank takes the same branch (stopped_on_request was agreed).
        ckpt = core.checkpoint(self.finish_reason) if (self.checkpoint_on_finish or self.stopped_on_request) else None
        export = core.export() if self.export_on_finish else None
        core.write_rank_record()
        summary = DrafterSummary(
            self.stats("done"), self.finish_reason, str(ckpt) if ckpt else None, str(export) if export else None, core.drafter_tau()
        )
        self.io.send_to_supervisor(Done(role="drafter", rank=self.rank, drafter=summary))
        return summary

    def stats(self, state: str = "running") -> DrafterStats:
        plane, elapsed = self.plane, time.perf_counter() - self.t0
        return DrafterStats(
            self.io.vitals(state, elapsed),
            self.core.stats(),
            queue_depth=len(plane.ready) + len(plane.held),
            outstanding=plane.outstanding,
            copying=len(plane.copying),
            wait_pct=100.0 * self.wait_total / max(1e-9, elapsed),
            slots_per_target=list(plane.slots_done),
        )
