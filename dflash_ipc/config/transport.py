"""``[transport]``: how captured hidden states move from targets to drafters (the slot rings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_ipc.config.fields import require

__all__ = ["MAX_PREFETCH", "TransportConfig"]

# A drafter's prefetch buffers are slot-sized each; more than a deep ring's worth buys nothing.
MAX_PREFETCH = 64


@dataclass
class TransportConfig:
    backend: Literal["auto", "cpu-shm", "host-pinned", "cuda-ipc", "nccl"] = "auto"
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
