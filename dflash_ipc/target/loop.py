"""The target's busy loop: the policy of when to forward, pack, route and end, over its core.

:class:`TargetLoop` drives a :class:`~dflash_ipc.target.core.TargetCore`, its producer ring and
its :class:`~dflash_ipc.transport.dataplane.ProducerDataPlane` through a :class:`LoopIO` (the
process's sockets in ``procs/target.py``; in-memory channels in the tests, which run the same
loop in one process). One iteration, in named steps::

    drain            peers' SlotFree/Load -> data plane; the supervisor's Shutdown -> stop
    commit           finished packs -> ring.commit -> data plane enqueue (forward-only: slot back at once)
    dispatch         queued slots -> the least-busy drafter with credit (SlotReady)
    forward_or_pack  no captured batch? forward the next one        (the critical path)
                     captured and a slot free? submit its pack      (off the critical path)
                     no slot free? wait on the sockets              (counted as slot wait)
    maybe_end        schedule empty and every slot routed -> EndOfData to every drafter (once)
    heartbeat        every run.heartbeat_interval_s: the latest figures for the supervisor
    idle             nothing to forward: wait on the sockets (packs, credit or Shutdown)

States::

    RUNNING ──schedule empty, packs done, nothing waiting──▶ ENDED (EndOfData sent; idle until Shutdown)
       │  (forward-only N: N forwards done, or the data ran out ─▶ Done to the supervisor ─▶ exit)
       └── stop requested (Shutdown, signal, supervisor gone) ─▶ exit
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dflash_ipc.control.loop_io import LoopIO
from dflash_ipc.control.protocol import Done, Heartbeat
from dflash_ipc.control.stats import ProducerPlaneStats, TargetStats
from dflash_ipc.transport.dataplane import ProducerDataPlane

log = logging.getLogger(__name__)


class TargetLoop:
    """``forward_only`` > 0: the benchmark ceiling. No drafters; each slot is released the moment
    its pack completed, and every batch also runs once through the bare transformers stack."""

    def __init__(
        self,
        core: Any,  # TargetCore
        ring: Any,  # ProducerRing
        plane: ProducerDataPlane,
        io: LoopIO,
        *,
        heartbeat_interval_s: float,
        forward_only: int = 0,
    ):
        self.core, self.ring, self.plane, self.io = core, ring, plane, io
        self.heartbeat_interval_s = heartbeat_interval_s
        self.forward_only = forward_only
        # The pack already completed (observed on the host): slot events go on an idle stream,
        # never on the compute stream, or the drafter's copy would wait for the next forward.
        self.commit_stream = torch.cuda.Stream(core.device) if core.device.type == "cuda" else None
        self.captured = None
        self.end_sent = False
        self.finished = False  # forward-only: Done sent
        self._next_beat = 0.0
        self._waited = False
        self.t0 = time.perf_counter()

    # -- the named steps
    def drain(self) -> None:
        for sender, msg in self.io.drain_peers():
            self.plane.handle(msg, sender)
        self.io.read_control()

    def commit(self) -> None:
        for done in self.core.finished_packs():
            b = done.batch
            self.ring.commit(done.slot, b.n_tokens, b.batch_size, self.commit_stream)
            if self.forward_only:
                self.plane.table.abort_filling(done.slot)
                continue
            route = self.core.route_of(done.wire_id, done.holdout_pass_batches)
            self.plane.enqueue(
                done.slot, done.wire_id, b.bucket, b.n_tokens, b.batch_size, {"padded_len": b.padded_len}, done.holdout_pass_batches, route
            )

    def dispatch(self) -> None:
        self.plane.dispatch()

    def forward_or_pack(self) -> None:
        core = self.core
        self._waited = False
        if self.captured is None and not self.end_sent and not (self.forward_only and core.forwards >= self.forward_only):
            self.captured = core.forward_next(bare_baseline=bool(self.forward_only))
        if self.captured is None:
            return
        slot = self.plane.acquire()
        if slot is not None:
            core.submit_pack(self.captured, slot, self.ring.pack_target(slot))
            self.captured = None
            return
        w0 = time.perf_counter()
        self.io.wait(5)
        core.slot_wait_s += time.perf_counter() - w0
        self._waited = True

    def maybe_end(self) -> None:
        core, plane = self.core, self.plane
        if self.end_sent or self.forward_only or self.captured is not None:
            return
        if core.batches_left == 0 and core.packs_in_flight == 0 and plane.waiting == 0:
            plane.end_of_data()
            self.end_sent = True
            log.info("end of data: %d batches sent", plane.batches_sent)

    def forward_only_done(self) -> bool:
        """Forward-only: the N forwards (or all the data) are packed; Done goes to the supervisor."""
        core = self.core
        if not self.forward_only or self.captured is not None or core.packs_in_flight:
            return False
        if core.forwards < self.forward_only and core.batches_left > 0:
            return False
        stats = self.stats("done", final=True)
        self.io.send_to_supervisor(Done(role="target", rank=core.rank, target=stats))
        log.info("forward-only done: %s", stats)
        self.finished = True
        return True

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self._next_beat:
            self._next_beat = now + self.heartbeat_interval_s
            stats = self.stats("done" if self.end_sent else "running")
            self.io.report(Heartbeat(role="target", rank=self.core.rank, target=stats))

    def idle(self) -> None:
        if self.captured is None and not self._waited:
            # Nothing to forward: waiting for packs, for credit to route, or for Shutdown.
            self.io.wait(100 if self.end_sent else 2)

    # -- the loop
    def step(self) -> bool:
        """One iteration; False once the loop is over (stop requested, or forward-only done)."""
        if self.io.stop.requested or self.finished:
            return False
        self.drain()
        self.commit()
        if self.forward_only_done():
            return False
        self.dispatch()
        self.forward_or_pack()
        self.maybe_end()
        self.heartbeat()
        self.io.progressed()
        self.idle()
        return True

    def run(self) -> None:
        self.heartbeat(force=True)
        while self.step():
            pass

    def stats(self, state: str, final: bool = False) -> TargetStats:
        work = self.core.stats(final=final)
        return TargetStats(self.io.vitals(state, time.perf_counter() - self.t0), work, ProducerPlaneStats.of(self.plane))
