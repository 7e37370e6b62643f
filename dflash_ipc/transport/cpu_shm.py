"""``cpu-shm`` rings: the ring is one POSIX shared-memory segment (:mod:`dflash_ipc.transport.shm`).

The producer's packer writes straight into the shared slot; a consumer's ``copy_out`` is a
host copy of the used ranges, complete when it returns. A CPU consumer may instead read the slot in
place (``read_in_place``; its reads are done when the step returns).
"""

from __future__ import annotations

import torch

from dflash_ipc.control.ring_descriptor import RingDescriptor, ShmSegment
from dflash_ipc.platform.devices import DeviceLike
from dflash_ipc.transport.ring import (
    CopyTicket,
    DoneTicket,
    InPlaceStaging,
    SlotRingBase,
    describe,
    layout_from_descriptor,
)
from dflash_ipc.transport.shm import create_shm_tensor, open_shm_tensor, unlink_shm
from dflash_ipc.transport.shm_names import shm_name
from dflash_ipc.transport.slots import SlotLayout, SlotViews


class CpuShmProducerRing(InPlaceStaging, SlotRingBase):
    backend = "cpu-shm"

    def __init__(self, layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int):
        super().__init__(layout, num_slots)
        self.device = torch.device("cpu")
        self.name = shm_name(run_id, producer_rank)
        self._run_id = run_id
        self._rank = producer_rank
        self._buffer = create_shm_tensor(self.name, self.num_slots * self.slot_bytes)

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream=None) -> None:
        return None

    def descriptor(self) -> RingDescriptor:
        return describe(self, self._run_id, self._rank, shm=ShmSegment(name=self.name))

    def close(self) -> None:
        """Drop the mapping and unlink the segment (idempotent)."""
        self._buffer = None
        unlink_shm(self.name)


class CpuShmConsumerRing(SlotRingBase):
    backend = "cpu-shm"

    def __init__(self, descriptor: RingDescriptor):
        layout, num_slots = layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        if descriptor.shm is None:
            raise ValueError("a cpu-shm ring descriptor needs its shm part")
        self.device = torch.device("cpu")
        self.name = descriptor.shm.name
        self._buffer = open_shm_tensor(self.name, self.num_slots * self.slot_bytes)

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor) -> CopyTicket:
        self.layout.copy_used(dst, self.slot(index), n_tokens, n_seqs)
        return DoneTicket()

    can_read_in_place = True

    def read_in_place(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        """Views of the slot itself (the producer wrote it before its SlotReady)."""
        self.layout.check_counts(n_tokens, n_seqs)
        return self.views(index, n_tokens, n_seqs)

    def reads_done(self, index: int) -> CopyTicket:
        """Host reads are over when the step returns."""
        self._check_index(index)
        return DoneTicket()

    def close(self) -> None:
        self._buffer = None


def create_producer(
    layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int, device: DeviceLike, host: str, timeout_s: float
) -> CpuShmProducerRing:
    """The factory's entry point (``transport/factory.py``): a segment in /dev/shm needs no device, host or timeout."""
    return CpuShmProducerRing(layout, num_slots, run_id, producer_rank)


def open_consumer(descriptor: RingDescriptor, device: DeviceLike, consumer_rank: int | None, timeout_s: float) -> CpuShmConsumerRing:
    return CpuShmConsumerRing(descriptor)
