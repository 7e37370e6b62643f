"""The role loops of a run, in one process: real cores, real cpu-shm rings, in-memory channels.

vLLM's in-process engine client is the model: :class:`InprocRun` builds what ``dflash-ipc up``
builds for each target and drafter (a :class:`TargetCore` with its tiny random model and data
shard, a producer ring, a :class:`ProducerDataPlane`; a :class:`DrafterCore`, the consumer rings,
a :class:`ConsumerDataPlane`) and runs the very :class:`TargetLoop` / :class:`DrafterLoop` that
``procs/`` runs, stepping them in turn. Only the process shell is left out: every peer message
goes through ``protocol.encode`` / ``protocol.decode`` into the receiver's inbox (as over a
socket), Shutdown is put where the supervisor's DEALER would deliver it, and the supervisor's
side (Done, heartbeats) is recorded. One drafter: the lockstep agreement is then this rank's own.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.config import DFlashConfig, load_config
from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import Heartbeat, Message, RejectCounter, Shutdown
from dflash_ipc.control.stats import Vitals
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.loop import DrafterLoop
from dflash_ipc.drafter.training.distributed import DistInfo
from dflash_ipc.rundir.ledger import BatchLedger, read_ledger
from dflash_ipc.runtime.child import StopFlag
from dflash_ipc.target.core import TargetCore
from dflash_ipc.target.loop import TargetLoop
from dflash_ipc.transport.dataplane import ConsumerDataPlane, ProducerDataPlane
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm

# configs/tiny-cpu.toml made small: 120 samples of <= 128 tokens, 512-token batches
SMALL = {
    "data": {"builtin_samples": 120, "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512},
    "training": {"checkpoint_every": 0, "max_steps": 0},
    "drafter": {"warm_up": False},
}


def small_config(tmp_path: Path, targets: int = 2, **sections: dict[str, Any]) -> DFlashConfig:
    raw = tiny_cpu_config(**SMALL)
    raw["topology"].update(targets=["cpu"] * targets, drafters=["cpu"])
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return load_config(write_toml(tmp_path / "config.toml", raw))


@dataclasses.dataclass
class InprocIO:
    """A :class:`~dflash_ipc.control.loop_io.LoopIO` over in-memory queues."""

    name: str
    wait_s: float = 0.0  # how long each wait() sleeps, whatever its timeout (a test's pacing; 0: the loops take turns)
    stop: StopFlag = dataclasses.field(default_factory=StopFlag)
    inbox: collections.deque = dataclasses.field(default_factory=collections.deque)
    control: collections.deque = dataclasses.field(default_factory=collections.deque)
    received: list = dataclasses.field(default_factory=list)  # every peer message, in order
    to_supervisor: list = dataclasses.field(default_factory=list)
    beats: list = dataclasses.field(default_factory=list)
    iterations: int = 0
    rejects: RejectCounter = dataclasses.field(default_factory=lambda: RejectCounter("inproc"))

    def drain_peers(self) -> list[tuple[int | None, Message]]:
        out = list(self.inbox)
        self.inbox.clear()
        self.received.extend(msg for _, msg in out)
        return out

    def read_control(self, wait_ms: int = 0) -> None:
        if wait_ms and not self.control:
            time.sleep(wait_ms / 1000)
        while self.control:
            msg = self.control.popleft()
            if isinstance(msg, Shutdown):
                self.stop.set(f"shutdown: {msg.reason}")

    def wait(self, timeout_ms: int) -> None:
        if self.wait_s:
            time.sleep(self.wait_s)

    def send_to_supervisor(self, msg: Message) -> None:
        self.to_supervisor.append(msg)

    def report(self, beat: Heartbeat) -> None:
        self.beats.append(beat)

    def progressed(self) -> None:
        self.iterations += 1

    def vitals(self, state: str, uptime_s: float) -> Vitals:
        return Vitals(state, uptime_s, 0, self.rejects.total, dict(self.rejects.by_kind))


def _wire(msg: Message) -> Message:
    return protocol.decode(protocol.encode(msg))


class InprocRun:
    """Targets and one drafter of ``cfg`` in this process, wired as `up` wires them."""

    def __init__(self, cfg: DFlashConfig, run_dir: Path, *, resume: bool = False, drafter_io: InprocIO | None = None):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.cfg, self.run_dir = cfg, run_dir
        self.run_id = new_run_id()
        cpu = torch.device("cpu")
        n_targets = len(cfg.topology.targets)
        self.target_io = [InprocIO(f"target-{r}") for r in range(n_targets)]
        self.drafter_io = drafter_io or InprocIO("drafter-0")
        self.targets, self.rings = [], []
        self.planned: set[tuple[int, ...]] = set()  # the training batches of every target's schedule
        beat = cfg.run.heartbeat_interval_s
        drafter_core, ledger = None, BatchLedger()
        if resume:  # as `up` does: drafter 0 names the checkpoint it resumes from, the targets skip its ledger
            assert cfg.training.max_steps, "a resumed in-process run needs training.max_steps (its LR schedule's length)"
            drafter_core = DrafterCore(cfg, run_dir, DistInfo.single("cpu"), cpu, cfg.training.max_steps, resume=True)
            ledger = read_ledger(drafter_core.resumed_from.checkpoint if drafter_core.resumed_from else None)
        for r in range(n_targets):
            core = TargetCore(cfg, r, run_dir, cpu)
            ring = create_producer_ring("cpu-shm", core.layout, cfg.transport.ring_slots, run_id=self.run_id, producer_rank=r)
            self.rings.append(ring)
            core.start(ledger)
            self.planned.update(tuple(i) for i in core.scheduled_ids())
            plane = ProducerDataPlane(r, ring, 1, cfg.transport.max_outstanding_per_drafter, self._to_drafter(r), self.target_io[r].rejects)
            self.targets.append(TargetLoop(core, ring, plane, self.target_io[r], heartbeat_interval_s=beat))
        total = cfg.training.max_steps or sum(t.core.batches_left for t in self.targets)
        self.drafter_core = drafter_core or DrafterCore(cfg, run_dir, DistInfo.single("cpu"), cpu, total, resume=False)
        self.consumer_rings = [open_consumer_ring(ring.descriptor(), cpu, consumer_rank=0) for ring in self.rings]
        slot_bytes = max(r.layout.slot_bytes for r in self.consumer_rings)
        buffers = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(cfg.transport.drafter_prefetch + 1)]
        plane = ConsumerDataPlane(0, self.consumer_rings, buffers, self._to_target, self.drafter_io.rejects)
        self.drafter = DrafterLoop(self.drafter_core, plane, self.drafter_io, rank=0, heartbeat_interval_s=beat)
        self.summary = None

    def _to_drafter(self, producer: int):
        def send(consumer: int, msg: Message) -> None:
            assert consumer == 0
            self.drafter_io.inbox.append((producer, _wire(msg)))

        return send

    def _to_target(self, producer: int, msg: Message) -> None:
        self.target_io[producer].inbox.append((0, _wire(msg)))

    def run(self, *, target_every: int = 1, on_step=None, max_rounds: int = 100_000) -> Any:
        """Step every loop in turn until the drafter finished (each target every ``target_every``
        rounds), then stop the targets as the supervisor does; ``on_step(run)`` after each round."""
        self.drafter.heartbeat(force=True)
        for t in self.targets:
            t.heartbeat(force=True)
        for rounds in range(max_rounds):
            if rounds % target_every == 0:
                for t in self.targets:
                    t.step()
            if not self.drafter.step():
                self.summary = self.drafter.finish()
                break
            if on_step is not None:
                on_step(self)
        else:
            raise AssertionError(f"the drafter did not finish in {max_rounds} rounds")
        for io in self.target_io:
            io.control.append(Shutdown(reason="training finished"))
        for t in self.targets:  # the iteration that reads the Shutdown is the last
            assert [t.step(), t.step()] == [True, False], "a target went on after Shutdown"
        return self.summary

    def close(self) -> None:
        self.drafter_core.close()
        for r in self.consumer_rings:
            r.close()
        for t in self.targets:
            t.core.close()
        for r in self.rings:
            r.close()
        sweep_run_shm(self.run_id)
