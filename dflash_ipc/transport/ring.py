"""Fixed rings of reusable slots, shared once between a producer (target) and consumers (drafters).

A producer allocates its ring **once**, in one large allocation, and never reallocates it.
The ring is described by a descriptor (:meth:`ProducerRing.descriptor`) that travels in the
handshake; each consumer imports it **once** (``dflash_ipc.transport.factory.open_consumer_ring``)
and keeps the mapping for its life. This module holds what every backend shares: the slot
lifecycle, the producer's slot table and the ring interfaces. Backends:

* ``cpu-shm``     POSIX shared memory: a 0600 file in /dev/shm mapped MAP_SHARED into a
                  torch uint8 tensor in every process (``transport.cpu_shm``, ``transport.shm``).
* ``host-pinned`` the same shared memory, page-locked with cudaHostRegister in both processes:
                  D2H by the producer, H2D by the consumer (``transport.host_pinned``).
* ``cuda-ipc``    one GPU allocation plus one interprocess CUDA event per slot, shared through
                  CUDA IPC handles (``transport.cuda_ipc``).
* ``nccl``        nothing shared: the producer sends each slot's used bytes to the consumer it
                  routed it to, point to point over torch.distributed (NCCL on GPU, gloo on
                  CPU; ``transport.p2p``), so consumers may live on other hosts.

Module graph (no cycles): ``shm``, ``slots`` <- ``ring`` <- ``cpu_shm``, ``cuda_common`` <-
``cuda_ipc``, ``host_pinned``, ``p2p`` <- ``factory`` (the one place that dispatches on the backend).

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

Rings that move bytes themselves (``nccl``) hear of each transition through three hooks the
data plane calls, no-ops for shared memory: ``attach_consumers`` (the consumers are known),
``hand_over`` (READY(d): send the slot to d) and ``slot_returned`` (FREE again).
"""

from __future__ import annotations

import enum
import os
from typing import Protocol

import torch

from dflash_ipc.control.ring_descriptor import DESCRIPTOR_VERSION, RingDescriptor
from dflash_ipc.transport.slots import SlotLayout, SlotViews


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
            raise SlotStateError(f"slot {slot} is {self.state[slot].value} (holder {self.holder[slot]}), not held by consumer {consumer}")
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


class DoneTicket:
    """A copy that completed before copy_out returned (host copies)."""

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

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: torch.cuda.Stream | None = None) -> None: ...

    def descriptor(self) -> RingDescriptor: ...

    def attach_consumers(self, num_consumers: int) -> None: ...

    def hand_over(self, index: int, consumer: int, n_tokens: int, n_seqs: int) -> None: ...

    def slot_returned(self, index: int) -> None: ...

    def close(self) -> None: ...


class ConsumerRing(Protocol):
    backend: str
    layout: SlotLayout
    num_slots: int

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor) -> CopyTicket: ...

    def close(self) -> None: ...


class SlotRingBase:
    """What every backend's ring shares: a layout, ``num_slots`` slots of ``slot_bytes`` in one
    flat uint8 buffer (``None`` once closed), and typed views of a slot."""

    backend = ""

    def __init__(self, layout: SlotLayout, num_slots: int):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.layout = layout
        self.num_slots = int(num_slots)
        self.slot_bytes = layout.slot_bytes
        self._buffer: torch.Tensor | None = None

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_slots:
            raise IndexError(f"slot {index} outside ring of {self.num_slots}")

    def slot(self, index: int) -> torch.Tensor:
        if self._buffer is None:
            raise RuntimeError(f"{self.backend} ring is closed")
        self._check_index(index)
        b = self.slot_bytes
        return self._buffer[index * b : (index + 1) * b]

    def views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        return self.layout.views(self.slot(index), n_tokens, n_seqs)

    # A shared ring's consumers read the slot itself: nothing to do per consumer or per slot.
    def attach_consumers(self, num_consumers: int) -> None:
        return None

    def hand_over(self, index: int, consumer: int, n_tokens: int, n_seqs: int) -> None:
        return None

    def slot_returned(self, index: int) -> None:
        return None

    @property
    def closed(self) -> bool:
        return self._buffer is None


def layout_from_descriptor(d: RingDescriptor) -> tuple[SlotLayout, int]:
    layout = SlotLayout.from_wire(d.layout)
    if layout.slot_bytes != d.slot_bytes:
        raise ValueError(f"ring descriptor slot_bytes {d.slot_bytes} disagrees with its layout ({layout.slot_bytes})")
    return layout, d.num_slots


def describe(ring: SlotRingBase, run_id: str, producer_rank: int, **parts) -> RingDescriptor:
    """The descriptor of a producer's ring: the common fields plus its backend's parts."""
    return RingDescriptor(
        backend=ring.backend,
        version=DESCRIPTOR_VERSION,
        run_id=str(run_id),
        producer_rank=int(producer_rank),
        producer_pid=os.getpid(),
        num_slots=ring.num_slots,
        slot_bytes=ring.slot_bytes,
        layout=ring.layout.to_wire(),
        **parts,
    )


class InPlaceStaging:
    """For producer rings whose packer writes straight into the slot (cpu-shm, cuda-ipc, nccl);
    host-pinned stages on the GPU instead."""

    def staging_views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        return self.views(index, n_tokens, n_seqs)  # type: ignore[attr-defined]

    def pack_target(self, index: int) -> torch.Tensor:
        """The flat buffer the packer writes for this slot: the slot itself."""
        return self.slot(index)  # type: ignore[attr-defined]
