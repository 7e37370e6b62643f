"""Typed payloads of the control messages: heartbeat stats per role, final summaries, hello info.

A :class:`~dflash_ipc.control.protocol.Heartbeat` carries :class:`TargetStats` or
:class:`DrafterStats` in the field named after its role; a ``Done`` carries the role's summary.
Every struct here is validated field by field on decode (``protocol.from_wire``), so a renamed
or mistyped key is rejected with its dotted path (``heartbeat.drafter.work.step``) rather than
read back as ``None`` by the supervisor.

::

    TargetStats  = Vitals + TargetWork (forwards, packing, throughput) + ProducerPlaneStats (slots)
    DrafterStats = Vitals + DrafterWork (step, loss, throughput) + queue / copies / wait share
    DrafterSummary (Done) = the final DrafterStats + why it stopped + checkpoint / export paths
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from dflash_ipc.control.drafter_tau import DrafterTau
from dflash_ipc.control.wire import RejectCounter, Struct, from_wire

if TYPE_CHECKING:
    import psutil
    import torch


@dataclass(frozen=True)
class GpuMemory(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"allocated_bytes", "reserved_bytes", "peak_bytes"})
    allocated_bytes: int  # held by tensors
    reserved_bytes: int  # held by the caching allocator
    peak_bytes: int  # most ever allocated by tensors

    @classmethod
    def of(cls, device: torch.device) -> GpuMemory | None:
        """The device's figures; None on the CPU."""
        if device.type != "cuda":
            return None
        import torch

        return cls(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device))


@dataclass(frozen=True)
class Vitals(Struct):
    """What every child reports about itself, whatever its role."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"uptime_s", "rss_bytes", "rejected_messages"})
    state: str  # "running"; a target that has sent all its data: "done"
    uptime_s: float  # since its main loop started
    rss_bytes: int
    rejected_messages: int  # control and data-plane messages refused (bad or unexpected)
    rejected_by_kind: dict[str, int]

    @classmethod
    def measure(cls, state: str, uptime_s: float, proc: psutil.Process, rejects: RejectCounter) -> Vitals:
        return cls(state, uptime_s, proc.memory_info().rss, rejects.total, dict(rejects.by_kind))


@dataclass(frozen=True)
class TargetWork(Struct):
    """A target's forward and packing figures (``TargetCore.stats``)."""

    forwards: int
    forward_ms: float  # mean captured forward
    pack_ms: float  # mean pack, off the critical path
    pack_submit_ms: float  # host time the forward loop spent handing each batch to the packer
    packs_measured: int
    pack_overlap_pct: float  # share of pack time that ran while a forward ran
    pack_exposed_ms: float  # pack time per pack that no forward hid
    slot_wait_ms: float  # total time waiting for a free slot
    busy_pct: float  # share of wall time in forwards
    tokens_per_s: float
    tokens: int
    batches_left: int
    planned: int
    skipped_ledgered: int  # planned batches a resumed run had already trained on
    tflops: float
    layers_run: int
    gpu: GpuMemory | None
    # A benchmark's counters (bench/target_counters.py, attached by `bench pipeline`); zero in a training run.
    steady_tokens_per_s: float = 0.0  # after the first forward (warm-up, compilation)
    steady_tflops: float = 0.0
    steady_wall_s: float = 0.0
    steady_forward_s: float = 0.0
    steady_forward_tflops: float = 0.0
    bare_forward_s: float = 0.0  # benchmark ceiling: the same batches without capture
    bare_forwards: int = 0
    first_pass_forward_s: float = 0.0  # benchmark ceiling: each batch's first, untimed, captured forward


@dataclass(frozen=True)
class PlaneSlots(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"free", "filling", "queued", "ready"})
    free: int
    filling: int  # being packed
    queued: int  # packed, waiting for a drafter with credit
    ready: int  # handed to a drafter, not yet released


@dataclass(frozen=True)
class ProducerPlaneStats(Struct):
    """A producer's data plane (``ProducerDataPlane.stats``): slots by state and routing."""

    slots: PlaneSlots
    inflight_per_drafter: list[int]
    routed_per_drafter: list[int]
    batches_sent: int

    @classmethod
    def of(cls, plane: Any) -> ProducerPlaneStats:
        # The plane reports a plain dict; checking it here makes a renamed key fail at its source.
        return from_wire(cls, plane.stats(), "ProducerDataPlane.stats()")


@dataclass(frozen=True)
class TargetStats(Struct):
    vitals: Vitals
    work: TargetWork
    plane: ProducerPlaneStats


@dataclass(frozen=True)
class DrafterWork(Struct):
    """A drafter's training figures (``DrafterCore.stats``)."""

    step: int
    loss: float | None  # latest step's global loss (NaN when no token had weight); None before the first
    acc: float | None
    tau: float | None  # expected acceptance length
    tokens_per_s: float
    tokens: int
    params: int
    train_elapsed_s: float | None  # training wall time up to the latest step
    gpu: GpuMemory | None
    warmup_s: float | None = None  # the handshake warm-up (first-step compile) on a dummy batch; None: not run
    # over the last steps only (drafter/core.py RecentRate): the start-up and the first step's compile
    # would otherwise dominate the rate and the ETA for the first hundreds of steps
    recent_step_s: float | None = None
    recent_tokens_per_s: float | None = None
    # the last held-out pass (training.holdout_every), drafter 0: tau by eval's decode replayed on the held-out answers
    tau_holdout: float | None = None
    tau_holdout_blocks: int = 0  # blocks scored (one per valid anchor)
    tau_holdout_steps: int = 0  # simulated verification steps behind tau_holdout
    tau_holdout_uniform: float | None = None  # the earlier estimate: blocks at uniformly drawn anchors (overstates eval's tau)
    holdout_step: int | None = None  # the step whose weights that pass measured
    anchors: int = 0  # the most anchors per batch the next step trains on (drafter.anchor_budget); 0: no cap
    end_step: int = 0  # the step training ends at: training.max_steps or training.max_seconds' plan; 0: the data's end


@dataclass(frozen=True)
class DrafterStats(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"queue_depth", "outstanding", "copying", "wait_pct"})
    vitals: Vitals
    work: DrafterWork
    queue_depth: int  # copied-out or held batches waiting to be trained on
    outstanding: int
    copying: int  # copies out of the rings in flight
    wait_pct: float  # share of wall time waiting for input
    slots_per_target: list[int]  # batches received from each target


@dataclass(frozen=True)
class DrafterSummary(Struct):
    final: DrafterStats  # the figures at the end: the last heartbeat may predate the last step
    reason: str  # why training ended
    checkpoint: str | None
    export: str | None
    drafter_tau: DrafterTau | None = None  # whether the drafter is worth serving (control/drafter_tau.py)


@dataclass(frozen=True)
class RoutedSlot(Struct):
    """One routing decision: the consumer chosen and the producer's view of every consumer's
    outstanding work at that moment."""

    consumer: int
    loads: list[int]


@dataclass(frozen=True)
class RoutingLog(Struct):
    """The producer's last routing decisions (bounded), with the credit limit they obeyed."""

    max_outstanding: int
    decisions: list[RoutedSlot]


@dataclass(frozen=True)
class ProducerSummary(Struct):
    """Transport benchmark: one producer's final report."""

    batches: int
    rejected: int
    plane: ProducerPlaneStats
    routing: RoutingLog


@dataclass(frozen=True)
class ConsumerSummary(Struct):
    """Transport benchmark: one consumer's final report."""

    slots: int
    bytes: int
    verified: bool  # every slot's pattern checked out
    active_s: float
    copy_s: float
    handoff_ns: list[int]  # SlotReady send to receive, per slot (the first 20000)
    rejected: int
    per_producer: list[int]


@dataclass(frozen=True)
class ResumePoint(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"step"})
    checkpoint: str  # the checkpoint directory
    step: int
    notes: list[str] = field(default_factory=list)  # why not the one `latest` names, damaged ones skipped, ...


@dataclass(frozen=True)
class FastPath(Struct):
    fla: bool  # flash-linear-attention kernels for GatedDeltaNet
    causal_conv1d: bool


@dataclass(frozen=True)
class ChildInfo(Struct):
    """What a child tells the supervisor in its Hello beyond its address."""

    resume: ResumePoint | None = None  # drafters: the checkpoint they loaded
    fast_path: FastPath | None = None  # targets: which kernels are active
