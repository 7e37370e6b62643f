"""Ring descriptors: what a producer tells its consumers about its ring, typed for the wire.

A producer builds one :class:`RingDescriptor` when it creates its ring; it travels in its Hello
and in every consumer's Start, and each consumer imports the ring from it exactly once
(``dflash_ipc.transport.factory.open_consumer_ring``). The common fields say which ring and what
shape; one nested part per backend carries what only that backend needs::

    backend       shm           gpu                          cuda_ipc
    cpu-shm       segment name  -                            -
    host-pinned   segment name  producer's GPU (staging)     -
    cuda-ipc      -             the ring's GPU               memory handle, offset, size, event handles

    backend       pair
    nccl          the producer's TCPStore (host, port) and the device type: each consumer joins
                  its own two-rank group there (rank 0 producer, rank 1 consumer)

:meth:`RingDescriptor.__post_init__` refuses a descriptor whose parts do not match its backend, so
a decoded descriptor is complete for its backend. ``version`` is :data:`DESCRIPTOR_VERSION` of the
build that made it; a consumer refuses any other. Which parts a backend carries is its row of
:data:`~dflash_ipc.config.transport.BACKENDS`. This module imports only ``control.wire`` and that table (the
transport imports it, never the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.control.wire import Struct

# Bumped whenever a descriptor field changes meaning; consumers refuse any other version.
DESCRIPTOR_VERSION = 3
#: the optional parts of a descriptor, each carried by the backends whose row names it
PARTS = ("shm", "gpu", "cuda_ipc", "pair")


@dataclass(frozen=True)
class SlotLayoutWire(Struct):
    """A slot layout's wire form (``dflash_ipc.transport.slots.SlotLayout.to_wire``)."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"num_planes", "hidden_size", "max_tokens", "max_seqs"})
    num_planes: int
    hidden_size: int
    max_tokens: int
    max_seqs: int
    plane_dtype: str


@dataclass(frozen=True)
class ShmSegment(Struct):
    """A POSIX shared-memory segment in /dev/shm (cpu-shm and host-pinned rings)."""

    name: str

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"shared-memory segment name {self.name!r} must be a non-empty file name")


@dataclass(frozen=True)
class GpuIdentity(Struct):
    """A GPU as the producer sees it: its index and its UUID, checked by every consumer (all
    processes of a run share one CUDA_VISIBLE_DEVICES)."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"index"})
    index: int
    uuid: str


@dataclass(frozen=True)
class CudaIpcMemory(Struct):
    """The ring's GPU allocation and one interprocess event per slot, as CUDA IPC handles."""

    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"offset", "nbytes"})
    mem_handle: bytes
    offset: int
    nbytes: int
    event_handles: list[bytes]


@dataclass(frozen=True)
class PairRendezvous(Struct):
    """Where a ``nccl`` ring's consumers meet its producer: the producer's TCPStore, and whether the
    slots live on a GPU (NCCL) or in host memory (gloo)."""

    host: str
    port: int
    device_type: str

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("pair rendezvous host is empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"pair rendezvous port {self.port} outside 1..65535")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"pair rendezvous device_type {self.device_type!r}; expected 'cpu' or 'cuda'")


@dataclass(frozen=True)
class RingDescriptor(Struct):
    NON_NEGATIVE: ClassVar[frozenset[str]] = frozenset({"producer_rank", "producer_pid", "num_slots", "slot_bytes"})
    backend: str
    version: int
    run_id: str
    producer_rank: int
    producer_pid: int
    num_slots: int
    slot_bytes: int
    layout: SlotLayoutWire
    shm: ShmSegment | None = None
    gpu: GpuIdentity | None = None
    cuda_ipc: CudaIpcMemory | None = None
    pair: PairRendezvous | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown transport backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        if self.num_slots < 1:
            raise ValueError(f"ring descriptor num_slots is {self.num_slots}; a ring has at least one slot")
        needs = BACKENDS[self.backend].descriptor_parts
        for part in PARTS:
            present = getattr(self, part) is not None
            if present != (part in needs):
                raise ValueError(f"a {self.backend} ring descriptor {'needs' if part in needs else 'carries no'} `{part}` part")
        if self.cuda_ipc is not None:
            if len(self.cuda_ipc.event_handles) != self.num_slots:
                raise ValueError(f"ring descriptor has {len(self.cuda_ipc.event_handles)} event handles for {self.num_slots} slots")
            if self.cuda_ipc.nbytes < self.num_slots * self.slot_bytes:
                raise ValueError(f"ring descriptor shares {self.cuda_ipc.nbytes} bytes, the ring needs {self.num_slots * self.slot_bytes}")
