"""The target's busy loop: the policy of when to forward, pack, route and end, over its core.

:class:`TargetLoop` drives a :class:`~dflash_ipc.target.core.TargetCore`, its producer ring and
its :class:`~dflash_ipc.transport.dataplane.ProducerDataPlane` through a :class:`LoopIO` (the
process's sockets in ``procs/target.py``; in-memory channels in the tests, which run the same
loop in one process). One iteration, in named steps::

    drain            peers' SlotFree/Load -> data plane; the supervisor's Shutdown -> stop
    commit           finished packs -> ring.commit -> data plane enqueue
    dispatch         queued slots -> the least-busy drafter with credit (SlotReady)
    forward_or_pack  no captured batch? forward the next one        (the critical path)
                     captured and a slot free? submit its pack      (off the critical path)
                     no slot free? wait on the sockets              (counted as slot wait)
    maybe_end        schedule empty and every slot routed -> EndOfData to every drafter (once)
    heartbeat        every run.heartbeat_interval_s: the latest figures for the supervisor
    idle             nothing to forward: wait on the sockets (packs, credit or Shutdown)

States::

    RUNNING ──schedule empty, packs done, nothing waiting──▶ ENDED (EndOfData sent; idle until Shutdown)
       └── stop requested (Shutdown, signal, supervisor gone) ─▶ exit

A benchmark runs the same loop with other answers to two questions (``bench/forward_only.py``): whether
there is more to forward (:meth:`TargetLoop.more_to_forward`) and whether the loop is over on its own
(:meth:`TargetLoop.over`); a training target forwards until its data ends and runs until Shutdown.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from dflash_ipc.control.loop_io import LoopIO
from dflash_ipc.control.protocol import Heartbeat
from dflash_ipc.control.stats import ProducerPlaneStats, TargetStats
from dflash_ipc.transport.dataplane import ProducerDataPlane

log = logging.getLogger(__name__)


class TargetLoop:
    def __init__(
        self,
        core: Any,  # TargetCore
        ring: Any,  # ProducerRing
        plane: ProducerDataPlane,
        io: LoopIO,
        *,
        heartbeat_interval_s: float,
    ):
        self.core, self.ring, self.plane, self.io = core, ring, plane, io
        self.heartbeat_interval_s = heartbeat_interval_s
        # The pack already completed (observed on the host): slot events go on an idle stream,
        # never on the compute stream, or the drafter's copy would wait for the next forward.
        self.commit_stream = torch.cuda.Stream(core.device) if core.device.type == "cuda" else None
        self.captured = None
        self.end_sent = False
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
            route = self.core.route_of(done.wire_id, done.holdout_pass_batches)
            self.plane.enqueue(
                done.slot, done.wire_id, b.bucket, b.n_tokens, b.batch_size, {"padded_len": b.padded_len}, done.holdout_pass_batches, route
            )

    def dispatch(self) -> None:
        self.plane.dispatch()

    def forward_or_pack(self) -> None:
        core = self.core
        self._waited = False
        if self.captured is None and self.more_to_forward():
            self.captured = core.forward_next()
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
        if self.end_sent or self.captured is not None:
            return
        if core.batches_left == 0 and core.packs_in_flight == 0 and plane.waiting == 0:
            plane.end_of_data()
            self.end_sent = True
            log.info("end of data: %d batches sent", plane.batches_sent)

    def more_to_forward(self) -> bool:
        """Whether to forward another batch when one is due: until the end of data was sent."""
        return not self.end_sent

    def over(self) -> bool:
        """Whether the loop ended on its own: a training target never does (it runs until Shutdown)."""
        return False

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
        """One iteration; False once the loop is over (stop requested, or :meth:`over`)."""
        if self.io.stop.requested:
            return False
        self.drain()
        self.commit()
        if self.over():
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
