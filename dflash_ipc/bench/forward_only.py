"""The forward-only ceiling of `bench pipeline`: targets alone, each running :class:`ForwardOnlyLoop` over its
usual core, ring and data plane (``procs/target.py --forward-only N``).

No drafter runs: a slot is released the moment its pack completed, N batches are forwarded (or all the data),
and then the target sends Done with its figures, the ceiling counters of
:class:`~dflash_ipc.bench.target_counters.TargetBenchCounters` among them, and exits::

    RUNNING ──N forwards packed, or the data ran out──▶ Done to the supervisor ─▶ exit
       └── stop requested (Shutdown, signal, supervisor gone) ─▶ exit
"""

from __future__ import annotations

import logging
from typing import Any

from dflash_ipc.control.loop_io import LoopIO
from dflash_ipc.control.protocol import Done
from dflash_ipc.target.loop import TargetLoop
from dflash_ipc.transport.dataplane import ProducerDataPlane

log = logging.getLogger(__name__)


class ForwardOnlyLoop(TargetLoop):
    def __init__(self, core: Any, ring: Any, plane: ProducerDataPlane, io: LoopIO, *, heartbeat_interval_s: float, batches: int):
        super().__init__(core, ring, plane, io, heartbeat_interval_s=heartbeat_interval_s)
        self.batches = batches  # forwards each target makes, unless its data runs out first
        self.done_sent = False

    def commit(self) -> None:
        """The finished packs' slots straight back: no drafter reads them."""
        for done in self.core.finished_packs():
            b = done.batch
            self.ring.commit(done.slot, b.n_tokens, b.batch_size, self.commit_stream)
            self.plane.table.abort_filling(done.slot)

    def more_to_forward(self) -> bool:
        return self.core.forwards < self.batches

    def maybe_end(self) -> None:
        """No EndOfData: no drafter waits for it."""

    def over(self) -> bool:
        """The N forwards (or all the data) are packed: Done goes to the supervisor, once."""
        core = self.core
        if self.done_sent:
            return True
        if self.captured is not None or core.packs_in_flight:
            return False
        if core.forwards < self.batches and core.batches_left > 0:
            return False
        stats = self.stats("done", final=True)
        self.io.send_to_supervisor(Done(role="target", rank=core.rank, target=stats))
        log.info("forward-only done: %s", stats)
        self.done_sent = True
        return True
