"""``[transport]``: how captured hidden states move from targets to drafters (the slot rings), and what each ring
backend is, declared once.

:data:`BACKENDS` is the one table of the backends' traits; the config checks, the ring descriptor, the factory
that makes rings, the data plane and the resource estimate all read it, and none compares backend names. A new
backend is its module in ``dflash_ipc/transport/`` (a ``create_producer`` and an ``open_consumer``, see
``transport/factory.py``) plus its row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_ipc.config.fields import require

__all__ = ["BACKENDS", "MAX_PREFETCH", "Backend", "TransportConfig"]

# A drafter's prefetch buffers are slot-sized each; more than a deep ring's worth buys nothing.
MAX_PREFETCH = 64


@dataclass(frozen=True)
class Backend:
    """One ring backend's traits."""

    name: str
    #: the transport module that makes its rings (``create_producer``, ``open_consumer``)
    module: str
    #: where its targets and drafters may run: the CPU only, CUDA devices only, or either
    devices: Literal["cpu", "cuda", "any"]
    #: where a ring's slots live: host shared memory (/dev/shm, counted there by the preflight) or the target's device
    ring_memory: Literal["host", "device"]
    #: the ring descriptor's backend parts it carries (``control/ring_descriptor.py``), no more, no fewer
    descriptor_parts: tuple[str, ...]
    #: ``transport.drafter_in_place = "auto"`` reads its slots in place wherever the ring can
    in_place_by_default: bool = False
    #: its consumers may be on other hosts: the only kind ``run.control = "tcp"`` runs with; "auto" never picks it
    off_host: bool = False


#: The ring backends by name, in the order ``--help`` and CONFIG.md list them.
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("cpu-shm", "dflash_ipc.transport.cpu_shm", devices="cpu", ring_memory="host", descriptor_parts=("shm",)),
        Backend("host-pinned", "dflash_ipc.transport.host_pinned", devices="cuda", ring_memory="host", descriptor_parts=("shm", "gpu")),
        Backend(
            "cuda-ipc",
            "dflash_ipc.transport.cuda_ipc",
            devices="cuda",
            ring_memory="device",
            descriptor_parts=("gpu", "cuda_ipc"),
            in_place_by_default=True,
        ),
        Backend("nccl", "dflash_ipc.transport.p2p", devices="any", ring_memory="device", descriptor_parts=("pair",), off_host=True),
    )
}
BACKEND_CHOICES = ("auto", *BACKENDS)


@dataclass
class TransportConfig:
    backend: Literal[BACKEND_CHOICES] = "auto"
    """"cpu-shm": shared-memory rings (CPU runs); "cuda-ipc": rings in GPU memory shared once; "host-pinned": rings in
    pinned host memory; "nccl": slots sent point to point over torch.distributed, for drafters on other hosts (never
    chosen by "auto"). "auto": cpu-shm on the CPU, the fastest that works on GPUs."""
    ring_slots: int = 4
    """Slots in each target-to-drafter ring (2..64): more slots let targets run further ahead of a slow drafter."""
    max_outstanding_per_drafter: int = 3
    """Credits: at most this many slots outstanding at one drafter (held or queued), from all targets."""
    drafter_prefetch: int = 1
    """Batches a drafter keeps copied out of the rings, ready to train on (1..64; each is a slot-sized buffer)."""
    drafter_in_place: bool | Literal["auto"] = "auto"
    """The drafter trains on a ring's slot where it lies instead of copying it out: "auto" for a cuda-ipc ring on the
    drafter's own GPU, true also for cpu-shm rings with a CPU drafter, false never (transport/dataplane.py)."""
    slot_tokens: int = 0
    """Extra slot capacity in tokens above ``data.token_budget`` (0: exactly the token budget)."""

    def __post_init__(self) -> None:
        require(self.ring_slots >= 2, "ring_slots", f"must be >= 2 (got {self.ring_slots}); raise it to at least 2")
        require(self.ring_slots <= 64, "ring_slots", f"must be <= 64 (got {self.ring_slots})")
        require(self.max_outstanding_per_drafter >= 1, "max_outstanding_per_drafter", "must be >= 1")
        require(
            1 <= self.drafter_prefetch <= MAX_PREFETCH,
            "drafter_prefetch",
            f"must be >= 1 and at most {MAX_PREFETCH} (got {self.drafter_prefetch}): each prefetched batch holds a slot-sized buffer",
        )
        require(self.slot_tokens >= 0, "slot_tokens", "must be >= 0")
