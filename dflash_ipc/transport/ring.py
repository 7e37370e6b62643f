"""Fixed rings of reusable slots, shared once between a producer (target) and consumers (drafters).

A producer allocates its ring **once**, in one large allocation, and never reallocates it.
The ring is described by a plain dict (:meth:`ProducerRing.descriptor`) that travels as
msgpack fields in the handshake; each consumer imports it **once** (:func:`open_consumer_ring`)
and keeps the mapping for its life. Backends:

* ``cpu-shm``     POSIX shared memory: a 0600 file in /dev/shm mapped MAP_SHARED into a
                  torch uint8 tensor in every process (this module).
* ``host-pinned`` the same shared memory, page-locked with cudaHostRegister in both processes:
                  D2H by the producer, H2D by the consumer (``dflash_ipc.transport.ring_cuda``).
* ``cuda-ipc``    one GPU allocation plus one interprocess CUDA event per slot, shared through
                  CUDA IPC handles (``dflash_ipc.transport.ring_cuda``).

Slot lifecycle and who owns each transition::

             producer: acquire()                producer: publish(consumer d)
      FREE ─────────────────────────▶ FILLING ──────────────────────────────▶ READY(d)
       ▲      (forward done; packing runs off the critical path)               │
       │                                                  consumer d: copy_out │
       │                                                                       ▼
       └──────────── producer: release(slot) on SlotFree from d ─────────── COPYING(d)
                     (sent by d only after its copy out of the slot completed)

The producer tracks FREE / FILLING / READY(d) in its :class:`SlotTable`; COPYING is the
consumer's private state (it reports how many slots it is copying in its Load messages).
A SlotFree for a slot that is not READY at that consumer is rejected and counted: that is
how duplicates and stray frees are caught. A slot is never handed out while READY, so a
consumer's early return is the only way data could be overwritten while being read — the
consumer returns a slot only after its copy completed (``CopyTicket.wait``).
"""

from __future__ import annotations

import enum
import glob
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dflash_ipc.transport.slots import SlotLayout, SlotViews

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dflash-ipc"


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    READY = "ready"


class SlotStateError(RuntimeError):
    pass


class SlotTable:
    """The producer's view of its slots: FREE -> FILLING -> READY(d) -> FREE."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.state = [SlotState.FREE] * num_slots
        self.holder: list[int | None] = [None] * num_slots
        self._free = list(range(num_slots))

    def acquire(self) -> int | None:
        if not self._free:
            return None
        i = self._free.pop(0)
        self.state[i] = SlotState.FILLING
        return i

    def publish(self, slot: int, consumer: int) -> None:
        if self.state[slot] is not SlotState.FILLING:
            raise SlotStateError(f"slot {slot} is {self.state[slot].value}, expected filling")
        self.state[slot] = SlotState.READY
        self.holder[slot] = consumer

    def release(self, slot: int, consumer: int) -> None:
        """Return a slot on SlotFree; raises SlotStateError for stray or duplicated frees."""
        if not 0 <= slot < self.num_slots:
            raise SlotStateError(f"slot {slot} outside ring of {self.num_slots}")
        if self.state[slot] is not SlotState.READY or self.holder[slot] != consumer:
            raise SlotStateError(
                f"slot {slot} is {self.state[slot].value} (holder {self.holder[slot]}), not held by consumer {consumer}"
            )
        self.state[slot] = SlotState.FREE
        self.holder[slot] = None
        self._free.append(slot)

    def abort_filling(self, slot: int) -> None:
        if self.state[slot] is SlotState.FILLING:
            self.state[slot] = SlotState.FREE
            self._free.append(slot)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in SlotState}
        for s in self.state:
            out[s.value] += 1
        return out

    def held_by(self, consumer: int) -> list[int]:
        return [i for i, h in enumerate(self.holder) if h == consumer and self.state[i] is SlotState.READY]


# --------------------------------------------------------------------------- interfaces


class CopyTicket(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None: ...


class _DoneTicket:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class ProducerRing(Protocol):
    backend: str
    layout: SlotLayout
    num_slots: int
    device: torch.device

    def slot(self, index: int) -> torch.Tensor: ...

    def views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews: ...

    def staging_views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews: ...

    def pack_target(self, index: int) -> torch.Tensor: ...

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: "torch.cuda.Stream | None" = None) -> None: ...

    def descriptor(self) -> dict: ...

    def close(self) -> None: ...


class ConsumerRing(Protocol):
    backend: str
    layout: SlotLayout
    num_slots: int

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor) -> CopyTicket: ...

    def close(self) -> None: ...


def new_run_id() -> str:
    return secrets.token_hex(4)


def shm_name(run_id: str, producer_rank: int) -> str:
    return f"{SHM_PREFIX}-{run_id}-target{producer_rank}"


def sweep_run_shm(run_id: str) -> list[str]:
    """Unlink every shared-memory segment of one run (leftovers of a killed producer)."""
    removed = []
    for path in glob.glob(str(SHM_DIR / f"{SHM_PREFIX}-{run_id}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def list_run_shm(run_id: str) -> list[str]:
    return sorted(glob.glob(str(SHM_DIR / f"{SHM_PREFIX}-{run_id}-*")))


def create_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    """Create a private (0600) shared-memory file and map it MAP_SHARED as a uint8 tensor."""
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def open_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    path = SHM_DIR / name
    actual = path.stat().st_size
    if actual != nbytes:
        raise ValueError(f"shared memory {path} has {actual} bytes, descriptor says {nbytes}")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


# --------------------------------------------------------------------------- cpu-shm


@dataclass
class _Base:
    layout: SlotLayout
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes


class CpuShmProducerRing(_Base):
    backend = "cpu-shm"

    def __init__(self, layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int):
        super().__init__(layout, num_slots)
        self.device = torch.device("cpu")
        self.name = shm_name(run_id, producer_rank)
        self._buffer: torch.Tensor | None = create_shm_tensor(self.name, num_slots * layout.slot_bytes)

    def slot(self, index: int) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError("ring is closed")
        b = self.slot_bytes
        return self._buffer[index * b : (index + 1) * b]

    def views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        return self.layout.views(self.slot(index), n_tokens, n_seqs)

    # The packer writes straight into the shared slot on CPU.
    staging_views = views

    def pack_target(self, index: int) -> torch.Tensor:
        """The flat buffer the packer writes for this slot (the slot itself here)."""
        return self.slot(index)

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream=None) -> None:
        return None

    def descriptor(self) -> dict:
        return {
            "backend": self.backend,
            "name": self.name,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "layout": self.layout.to_wire(),
            "device": "cpu",
        }

    def close(self) -> None:
        """Drop the mapping and unlink the segment (idempotent)."""
        self._buffer = None
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass


class CpuShmConsumerRing(_Base):
    backend = "cpu-shm"

    def __init__(self, descriptor: dict):
        layout = SlotLayout.from_wire(descriptor["layout"])
        super().__init__(layout, int(descriptor["num_slots"]))
        if layout.slot_bytes != int(descriptor["slot_bytes"]):
            raise ValueError("ring descriptor slot_bytes disagrees with its layout")
        self.name = descriptor["name"]
        self._buffer: torch.Tensor | None = open_shm_tensor(self.name, self.num_slots * self.slot_bytes)

    def slot(self, index: int) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError("ring is closed")
        b = self.slot_bytes
        return self._buffer[index * b : (index + 1) * b]

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor) -> CopyTicket:
        src = self.slot(index)
        for off, nbytes in self.layout.used_ranges(n_tokens, n_seqs):
            dst[off : off + nbytes].copy_(src[off : off + nbytes])
        return _DoneTicket()

    def close(self) -> None:
        self._buffer = None


# --------------------------------------------------------------------------- factories


def create_producer_ring(
    backend: str,
    layout: SlotLayout,
    num_slots: int,
    *,
    run_id: str,
    producer_rank: int,
    device: torch.device | str = "cpu",
) -> ProducerRing:
    if backend == "cpu-shm":
        return CpuShmProducerRing(layout, num_slots, run_id, producer_rank)
    if backend in ("cuda-ipc", "host-pinned"):
        from dflash_ipc.transport import ring_cuda

        return ring_cuda.create_producer_ring(backend, layout, num_slots, run_id=run_id, producer_rank=producer_rank, device=torch.device(device))
    raise ValueError(f"unknown transport backend {backend!r}")


def open_consumer_ring(descriptor: dict, local_device: torch.device | str = "cpu") -> ConsumerRing:
    """Import a producer's ring once; keep the returned object for the consumer's life."""
    backend = descriptor.get("backend")
    if backend == "cpu-shm":
        return CpuShmConsumerRing(descriptor)
    if backend in ("cuda-ipc", "host-pinned"):
        from dflash_ipc.transport import ring_cuda

        return ring_cuda.open_consumer_ring(descriptor, torch.device(local_device))
    raise ValueError(f"unknown transport backend {backend!r}")
