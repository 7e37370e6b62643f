"""``host-pinned`` rings: POSIX shared memory page-locked in both processes.

host-pinned
    For GPUs without peer access. The ring is POSIX shared memory (as ``cpu-shm``), page-locked
    with ``cudaHostRegister`` in both processes. The packer writes into a producer-local GPU
    staging slot; ``commit`` copies the used ranges D2H into the shared slot on the packing
    stream and synchronizes that stream, so the bytes are in host memory before SlotReady is
    sent. ``copy_out`` is an H2D copy on a local stream plus a completion-event ticket.
"""

from __future__ import annotations

import logging
import time

import torch

from dflash_ipc.control.ring_descriptor import GpuIdentity, RingDescriptor, ShmSegment
from dflash_ipc.platform.devices import DeviceLike, cuda_device
from dflash_ipc.transport.cuda_common import (
    AFTER_CURRENT,
    CudaCopyTicket,
    check_dst,
    device_uuid,
    host_register,
    host_unregister,
    wait_after,
)
from dflash_ipc.transport.ring import (
    SlotRingBase,
    describe,
    layout_from_descriptor,
)
from dflash_ipc.transport.shm import create_shm_tensor, open_shm_tensor, unlink_shm
from dflash_ipc.transport.shm_names import shm_name
from dflash_ipc.transport.slots import SlotLayout, SlotViews

log = logging.getLogger(__name__)

# GPU staging slots for writers that use staging_views (the target's packer writes the pinned
# slot directly through pack_target).
HOST_PINNED_STAGING_SLOTS = 3


class HostPinnedProducerRing(SlotRingBase):
    backend = "host-pinned"

    def __init__(
        self,
        layout: SlotLayout,
        num_slots: int,
        run_id: str,
        producer_rank: int,
        device: torch.device,
        staging_slots: int = HOST_PINNED_STAGING_SLOTS,
    ):
        super().__init__(layout, num_slots)
        self.device = cuda_device(device)
        self.name = shm_name(run_id, producer_rank)
        self._run_id = str(run_id)
        self._rank = int(producer_rank)
        self._registered = False
        nbytes = self.num_slots * self.slot_bytes
        self._buffer = create_shm_tensor(self.name, nbytes)
        try:
            with torch.cuda.device(self.device):
                host_register(self._buffer)
                self._registered = True
                n_staging = max(1, min(int(staging_slots), self.num_slots))
                self._staging = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(n_staging)]
        except BaseException:
            self._unmap()
            raise
        self._staging_owner: list[int | None] = [None] * len(self._staging)

    def _staging_for(self, index: int) -> int | None:
        for k, owner in enumerate(self._staging_owner):
            if owner == index:
                return k
        return None

    def staging_views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        """Views into a GPU staging slot held for ``index`` until its commit."""
        self._check_index(index)
        if self._buffer is None:
            raise RuntimeError("host-pinned ring is closed")
        k = self._staging_for(index)
        if k is None:
            try:
                k = self._staging_owner.index(None)
            except ValueError:
                raise RuntimeError(
                    f"all {len(self._staging)} GPU staging slots are held by uncommitted slots {self._staging_owner}; "
                    "commit a slot before staging another"
                ) from None
            self._staging_owner[k] = index
        return self.layout.views(self._staging[k], n_tokens, n_seqs)

    def pack_target(self, index: int) -> torch.Tensor:
        """The pinned host slot itself: the packer gathers on the GPU and copies D2H on its side
        stream, so the copy is off the forward's critical path and complete when the pack
        handle is; ``commit`` then has nothing left to copy."""
        return self.slot(index)

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: torch.cuda.Stream | None = None) -> None:
        """D2H of the used ranges into the pinned slot on ``stream``, then synchronize it.

        If no staging slot is held for ``index`` the data was written to the host slot
        directly (``views``) and there is nothing to copy."""
        self._check_index(index)
        if self._buffer is None:
            raise RuntimeError("host-pinned ring is closed")
        self.layout.check_counts(n_tokens, n_seqs)
        k = self._staging_for(index)
        if k is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if stream.device.index != self.device.index:
            raise ValueError(f"commit on a stream of {stream.device}; the staging slot is on {self.device}")
        with torch.cuda.stream(stream):
            self.layout.copy_used(self.slot(index), self._staging[k], n_tokens, n_seqs, non_blocking=True)
        stream.synchronize()
        self._staging_owner[k] = None

    def descriptor(self) -> RingDescriptor:
        return describe(
            self,
            self._run_id,
            self._rank,
            shm=ShmSegment(name=self.name),
            gpu=GpuIdentity(index=int(self.device.index), uuid=device_uuid(self.device.index)),
        )

    def _unmap(self) -> None:
        if self._buffer is not None and self._registered:
            try:
                host_unregister(self._buffer)
            except Exception as e:  # teardown is best effort
                log.warning("cudaHostUnregister of %s failed: %s", self.name, e)
        self._registered = False
        self._buffer = None
        unlink_shm(self.name)

    def close(self, release_memory: bool = True) -> None:
        """Unregister, unmap and unlink the shared memory; free the staging slots (idempotent)."""
        if self._buffer is None:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            self._unmap()
            self._staging = []
            self._staging_owner = []
            if release_memory:
                torch.cuda.empty_cache()


class HostPinnedConsumerRing(SlotRingBase):
    backend = "host-pinned"

    def __init__(self, descriptor: RingDescriptor, local_device: torch.device):
        layout, num_slots = layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        self.local_device = cuda_device(local_device)
        self.device = self.local_device
        if descriptor.shm is None:
            raise ValueError("a host-pinned ring descriptor needs its shm part")
        self.name = descriptor.shm.name
        t0 = time.perf_counter()
        self._buffer = open_shm_tensor(self.name, self.num_slots * self.slot_bytes)
        self._registered = False
        try:
            with torch.cuda.device(self.local_device):
                host_register(self._buffer)
                self._registered = True
                self._stream = torch.cuda.Stream(self.local_device)
        except BaseException:
            self.close()
            raise
        self.open_seconds = time.perf_counter() - t0
        self.producer_pid = descriptor.producer_pid

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._stream

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor, *, after=AFTER_CURRENT) -> CudaCopyTicket:
        """H2D of the used ranges of slot ``index`` into ``dst`` on a local stream; see CudaIpcConsumerRing.copy_out."""
        if self._buffer is None:
            raise RuntimeError("host-pinned ring is closed")
        self._check_index(index)
        self.layout.check_counts(n_tokens, n_seqs)
        check_dst(dst, self.local_device, self.slot_bytes)
        wait_after(self._stream, after)
        with torch.cuda.stream(self._stream):
            self.layout.copy_used(dst, self.slot(index), n_tokens, n_seqs, non_blocking=True)
        return CudaCopyTicket.recorded_on(self._stream, index)

    def close(self) -> None:
        if self._buffer is None:
            return
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.synchronize()
        if self._registered:
            try:
                with torch.cuda.device(self.local_device):
                    host_unregister(self._buffer)
            except Exception as e:
                log.warning("cudaHostUnregister of %s failed: %s", self.name, e)
            self._registered = False
        self._buffer = None


def create_producer(
    layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int, device: DeviceLike, host: str, timeout_s: float
) -> HostPinnedProducerRing:
    """The factory's entry point (``transport/factory.py``): pinned host slots staged from ``device``'s GPU."""
    return HostPinnedProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))


def open_consumer(descriptor: RingDescriptor, device: DeviceLike, consumer_rank: int | None, timeout_s: float) -> HostPinnedConsumerRing:
    return HostPinnedConsumerRing(descriptor, cuda_device(device))
