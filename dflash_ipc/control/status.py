"""The status snapshot: what ``dflash-ipc status`` shows, defined once as typed structs.

The supervisor builds a :class:`StatusSnapshot` every second; it serves it on ``sock/status``
(REP) and writes it to ``status.json``, both as the plain JSON of ``protocol.to_wire``. Readers
decode it with :func:`decode_status` (``protocol.from_wire``): every field is checked for
presence and type, recursively, and a renamed or mistyped key is rejected with its dotted path
(``status.processes[2].heartbeat_age_s missing``), never read back as ``None``.

Beyond types, ``__post_init__`` checks what a type cannot say: counts, sizes, rates and durations
are >= 0 and finite, percentages are in [0, 100] (only the two ``loss`` fields may be NaN or
infinite), enumerations hold one of their values, (role, rank) is unique, and the run did not
start after the snapshot was taken. ``X | None`` means "not known (yet)" or "not this role's".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dflash_ipc.control.drafter_tau import DrafterTau
from dflash_ipc.control.wire import Struct, from_wire

SCHEMA_VERSION = 1
# Ended runs: "finished" (max_steps, max_seconds or the data exhausted), "stopped" (a signal: SIGTERM,
# SIGINT; resumable), "failed" (a process died, hung or was refused). "lost": status.json says the run is
# live, but its supervisor process is gone (killed); set by the reader (ops.status_client), never written
# by a supervisor.
RUN_STATES = ("preparing", "starting", "running", "stopping", "finished", "stopped", "failed", "lost")
ENDED_STATES = ("finished", "stopped", "failed", "lost")
LIVE_STATES = ("preparing", "starting", "running", "stopping")
ROLES = ("target", "drafter")
SLOT_STATES = ("free", "filling", "ready", "copying")


def _require_finite_non_negative(**values: float | None) -> None:
    for name, v in values.items():
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be finite and >= 0 (got {v})")


def _require_percent(**values: float | None) -> None:
    for name, v in values.items():
        if v is not None and not (0.0 <= v <= 100.0):
            raise ValueError(f"{name} must be in [0, 100] (got {v})")


def _require_one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))} (got {value!r})")


@dataclass(frozen=True)
class SlotCounts(Struct):
    """A target's ring slots by state."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset(SLOT_STATES)
    free: int
    filling: int  # being packed, or packed and waiting for a drafter with credit
    ready: int  # handed to a drafter, not yet released
    copying: int


@dataclass(frozen=True)
class ProcessStatus(Struct):
    """One target or drafter process."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset(
        {
            "rank",
            "queue_depth",
            "step",
            "gpu_mem_allocated_bytes",
            "gpu_mem_reserved_bytes",
            "rss_bytes",
            "rejected_messages",
            "anchors_per_batch",
        }
    )
    role: str  # "target" | "drafter"
    rank: int  # index within its role; (role, rank) is unique
    pid: int | None  # None: not started (yet)
    device: str  # "cpu", "cuda:0", ...
    state: str  # free-form: "starting", "running", "done", "exited", ...
    uptime_s: float
    heartbeat_age_s: float | None  # seconds since its last heartbeat
    tokens_per_s: float
    slots: SlotCounts | None  # targets
    inflight_per_drafter: list[int] | None  # targets: slots outstanding per drafter
    queue_depth: int | None  # drafters: batches waiting to be trained on
    step: int | None  # drafters
    loss: float | None  # drafters (may be NaN)
    gpu_mem_allocated_bytes: int | None
    gpu_mem_reserved_bytes: int | None
    rss_bytes: int | None
    rejected_messages: int  # control messages refused (bad or unexpected)
    rejected_by_kind: dict[str, int]  # the same, by ProtocolError kind
    busy_pct: float | None  # share of wall time computing, 0..100
    wait_pct: float | None  # share of wall time waiting for input, 0..100
    exit_code: int | None  # None while running
    anchors_per_batch: int | None = None  # drafters: the most anchors the next batch trains on (drafter.anchor_budget); 0: no cap
    tau_holdout: float | None = None  # drafter 0: held-out tau of the last pass (training.holdout_every)

    def __post_init__(self) -> None:
        _require_one_of("role", self.role, ROLES)
        if self.pid is not None and self.pid < 1:
            raise ValueError(f"pid must be >= 1 (got {self.pid})")
        if not self.device or not self.state:
            raise ValueError("device and state must not be empty")
        _require_finite_non_negative(uptime_s=self.uptime_s, heartbeat_age_s=self.heartbeat_age_s, tokens_per_s=self.tokens_per_s)
        _require_percent(busy_pct=self.busy_pct, wait_pct=self.wait_pct)
        if self.inflight_per_drafter is not None and any(n < 0 for n in self.inflight_per_drafter):
            raise ValueError(f"inflight_per_drafter must be >= 0 (got {self.inflight_per_drafter})")

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}"


@dataclass(frozen=True)
class Totals(Struct):
    """The whole pipeline."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"step", "max_steps", "pipeline_rss_bytes"})
    tokens_per_s: float  # training throughput
    step: int  # optimizer steps done
    max_steps: int | None  # None: until the data is exhausted
    loss: float | None  # latest loss (may be NaN)
    pipeline_rss_bytes: int  # RSS of the supervisor and all its processes
    eta_s: float | None

    def __post_init__(self) -> None:
        _require_finite_non_negative(tokens_per_s=self.tokens_per_s, eta_s=self.eta_s)


@dataclass(frozen=True)
class NodeStatus(Struct):
    """This node's place in a run of several (runtime/nodes.py)."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"node_rank", "group_step"})
    node_rank: int
    nnodes: int
    master: str  # MASTER_ADDR:MASTER_PORT of the drafters' group
    group_step: int | None  # node 0's step, read through the supervisors' store (None: not yet)

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes) (got {self.node_rank} of {self.nnodes})")


@dataclass(frozen=True)
class StatusSnapshot(Struct):
    """The run and every process in it, at one moment (schema version :data:`SCHEMA_VERSION`)."""

    schema: int
    run_dir: str
    state: str  # one of RUN_STATES
    updated_unix: float  # when this snapshot was taken (time.time())
    supervisor_pid: int
    config: str  # the config file (or name)
    started_unix: float  # when the supervisor started
    totals: Totals
    processes: list[ProcessStatus]
    node: NodeStatus | None = None  # None: a single-node run
    # messages the supervisor itself refused (bad frames, unknown or unauthenticated peers), by kind
    supervisor_rejected_by_kind: dict[str, int] = field(default_factory=dict)
    # An ended run: why ("max_steps 40", "data exhausted", "SIGINT at step 23", the failure's first line)
    end_reason: str | None = None
    # An ended run: the tau its drafter reached and whether it is worth serving (control/drafter_tau.py)
    drafter_tau: DrafterTau | None = None

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.supervisor_rejected_by_kind.values()):
            raise ValueError("supervisor_rejected_by_kind counts must be >= 0")
        if self.schema != SCHEMA_VERSION:
            raise ValueError(f"schema must be {SCHEMA_VERSION} (got {self.schema}); this dflash-ipc reads version {SCHEMA_VERSION} only")
        _require_one_of("state", self.state, RUN_STATES)
        if self.supervisor_pid < 1:
            raise ValueError(f"supervisor_pid must be >= 1 (got {self.supervisor_pid})")
        _require_finite_non_negative(updated_unix=self.updated_unix, started_unix=self.started_unix)
        if self.started_unix > self.updated_unix:
            raise ValueError("started_unix is later than updated_unix")
        seen: set[tuple[str, int]] = set()
        for i, p in enumerate(self.processes):
            if (p.role, p.rank) in seen:
                raise ValueError(f"processes[{i}]: duplicate {p.role} rank {p.rank}")
            seen.add((p.role, p.rank))

    def sorted_processes(self) -> list[ProcessStatus]:
        """Targets first, then drafters, each by rank."""
        return sorted(self.processes, key=lambda p: (ROLES.index(p.role), p.rank))


def decode_status(value: Any) -> StatusSnapshot:
    """A snapshot from its plain (JSON) form; ProtocolError naming the dotted path otherwise."""
    return from_wire(StatusSnapshot, value, "status")
