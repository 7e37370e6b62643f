"""``cuda-ipc`` rings: GPU memory shared through CUDA IPC.

cuda-ipc
    The producer allocates its whole ring once, as one ``torch.empty(num_slots * slot_bytes,
    uint8)`` on its GPU, plus one interprocess CUDA event per slot. The ring's descriptor
    (:class:`~dflash_ipc.control.ring_descriptor.RingDescriptor`) carries the GPU's index and
    UUID and a ``CudaIpcMemory`` part: the IPC memory handle of the allocation (from the
    storage's ``_share_cuda_``), the offset of the ring inside it, its size, and one event IPC
    handle per slot. A consumer imports the
    memory handle and the event handles exactly once (``_new_shared_cuda`` /
    ``Event.from_ipc_handle``) and keeps them for its life.

    The packer writes straight into the GPU slot (``staging_views``) on its side stream;
    ``commit`` records the slot's event on that stream. A consumer on another GPU maps the ring
    into its own GPU's context (peer mapping, "pull"; ``DFLASH_IPC_CUDA_COPY=push`` or a failed
    mapping copies on the ring's GPU instead). ``copy_out``: if the slot's event has completed
    (host query) the copy of the used ranges is issued on the consumer's own copy stream;
    otherwise a stream **of the ring's device** waits on the event (waiting on an interprocess
    event from a stream of another device segfaults the consumer: docs/GPU_TRANSPORT.md) and an ordinary
    event carries the dependency to the copy stream. A completion event is the ticket. Several
    tickets may be in flight; nothing waits on the host.

    Reference counting: torch's own CUDA IPC reference counting keeps a shared block alive in
    the producer ("limbo") until every receiver has released it, so a receiver killed with
    SIGKILL would pin the producer's ring until the producer exits. This module does not use
    it: the producer zeroes its counter right after exporting and receivers are given no
    counter. The ring's lifetime is instead the protocol's: consumers ``close`` (drop their
    mappings) first, then the producer ``close``s, which frees the memory at once whether or
    not a consumer died holding a mapping (a dead process's mappings die with it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from dflash_ipc.control.ring_descriptor import (
    CudaIpcMemory,
    GpuIdentity,
    RingDescriptor,
)
from dflash_ipc.platform.devices import DeviceLike, cuda_device
from dflash_ipc.transport.cuda_common import (
    AFTER_CURRENT,
    CudaCopyTicket,
    check_dst,
    check_uuid,
    device_uuid,
    wait_after,
)
from dflash_ipc.transport.ring import (
    InPlaceStaging,
    SlotRingBase,
    describe,
    layout_from_descriptor,
)
from dflash_ipc.transport.slots import SlotLayout, SlotViews

log = logging.getLogger(__name__)

# Name given to torch as the consumer's IPC reference-counter file: it never exists, so a
# consumer's release is a no-op (see the module docstring).
_NO_REFCOUNT = b"/dflash-ipc-no-refcount"
# cuda-ipc consumers on another GPU: "pull" maps the ring into the consumer's GPU and copies there
# (default, falls back to push if the mapping fails), "push" copies on the ring's GPU.
COPY_MODE_ENV = "DFLASH_IPC_CUDA_COPY"


class CudaIpcProducerRing(InPlaceStaging, SlotRingBase):
    backend = "cuda-ipc"

    def __init__(self, layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int, device: torch.device):
        super().__init__(layout, num_slots)
        self.device = cuda_device(device)
        nbytes = self.num_slots * self.slot_bytes
        with torch.cuda.device(self.device):
            # One allocation for the whole ring, made once; the IPC handle covers its block.
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            storage = self._buffer.untyped_storage()
            shared = storage._share_cuda_()
            _dev, mem_handle, mem_nbytes, mem_offset, ref_handle, ref_offset = shared[:6]
            # Opt out of torch's receiver reference counting (module docstring): without this
            # the block would stay in torch's IPC limbo while any receiver holds it, forever if
            # that receiver was killed.
            if ref_handle:
                torch.UntypedStorage._release_ipc_counter_cuda(ref_handle, ref_offset)
            self._events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True) for _ in range(self.num_slots)]
            event_handles = [bytes(ev.ipc_handle()) for ev in self._events]
            torch.cuda.synchronize(self.device)
        self._descriptor = describe(
            self,
            run_id,
            producer_rank,
            gpu=GpuIdentity(index=int(self.device.index), uuid=device_uuid(self.device.index)),
            cuda_ipc=CudaIpcMemory(
                mem_handle=bytes(mem_handle), offset=int(mem_offset), nbytes=int(mem_nbytes), event_handles=event_handles
            ),
        )

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: torch.cuda.Stream | None = None) -> None:
        """Record the slot's event on the stream that wrote it (default: the device's current stream)."""
        self._check_index(index)
        if self._buffer is None:
            raise RuntimeError("cuda-ipc ring is closed")
        self.layout.check_counts(n_tokens, n_seqs)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if stream.device.index != self.device.index:
            raise ValueError(f"commit on a stream of {stream.device}; the ring is on {self.device}")
        self._events[index].record(stream)

    def descriptor(self) -> RingDescriptor:
        return self._descriptor

    def close(self, release_memory: bool = True) -> None:
        """Free the ring (after the consumers closed theirs; a dead consumer does not matter).

        Idempotent. With release_memory, cached free blocks go back to the driver
        (``torch.cuda.empty_cache``), so ``mem_get_info`` shows the ring released."""
        if self._buffer is None:
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            self._events = []
            self._buffer = None
            torch.cuda.ipc_collect()
            if release_memory:
                torch.cuda.empty_cache()


def _import_ring(device: torch.device, args: tuple, nbytes: int) -> torch.Tensor:
    """Import the ring's memory handle into ``device``'s context: the only import of it in this
    process's life. No ref counter and no first-use event (the producer synchronized before
    exporting; every slot has its own event)."""
    handle, mem_nbytes, mem_offset = args
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(device.index, handle, mem_nbytes, mem_offset, _NO_REFCOUNT, 0, bytes(64), False)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class CudaIpcConsumerRing(SlotRingBase):
    backend = "cuda-ipc"

    def __init__(self, descriptor: RingDescriptor, local_device: torch.device):
        layout, num_slots = layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        if descriptor.gpu is None or descriptor.cuda_ipc is None:
            raise ValueError("a cuda-ipc ring descriptor needs its gpu and cuda_ipc parts")
        ring_index = descriptor.gpu.index
        check_uuid(ring_index, descriptor.gpu.uuid)
        shared = descriptor.cuda_ipc
        self.ring_device = torch.device("cuda", ring_index)
        self.local_device = cuda_device(local_device)
        self.device = self.local_device
        handles = shared.event_handles
        if len(handles) != self.num_slots:
            raise ValueError(f"descriptor has {len(handles)} event handles for {self.num_slots} slots")
        nbytes = self.num_slots * self.slot_bytes
        mem_nbytes = shared.nbytes
        if mem_nbytes < nbytes:
            raise ValueError(f"descriptor shares {mem_nbytes} bytes, the ring needs {nbytes}")
        t0 = time.perf_counter()
        mode = os.environ.get(COPY_MODE_ENV, "auto").strip().lower() or "auto"
        if mode not in ("auto", "pull", "push"):
            raise ValueError(f"{COPY_MODE_ENV}={mode!r}: use auto, pull or push")
        args = (shared.mem_handle, mem_nbytes, shared.offset)
        self._buffer = None
        if self.local_device == self.ring_device:
            self.copy_mode = "same-device"
            self._buffer = _import_ring(self.ring_device, args, nbytes)
        else:
            if mode in ("auto", "pull"):
                try:
                    # Map the ring into the consumer's own GPU (peer mapping): copies out of it
                    # run on the consumer's GPU (pull over NVLink), so the consumer puts no copy
                    # work on the producer's GPU to be time-sliced against the producer.
                    self._buffer = _import_ring(self.local_device, args, nbytes)
                    self.copy_mode = "pull"
                except Exception as e:
                    if mode == "pull":
                        raise
                    log.warning(
                        "cuda-ipc: mapping the ring of %s into %s failed (%s); copying from the ring's GPU (push)",
                        self.ring_device,
                        self.local_device,
                        e,
                    )
            if self._buffer is None:
                self._buffer = _import_ring(self.ring_device, args, nbytes)
                self.copy_mode = "push"
        with torch.cuda.device(self.ring_device):
            self._events = [torch.cuda.Event.from_ipc_handle(self.ring_device, h) for h in handles]
            # Waits on the producer's interprocess events run on a stream of the ring's device.
            self._ring_stream = torch.cuda.Stream(self.ring_device)
        if self.local_device == self.ring_device:
            self._local_stream = self._ring_stream
        else:
            self._local_stream = torch.cuda.Stream(self.local_device)
        self.open_seconds = time.perf_counter() - t0
        self.producer_pid = descriptor.producer_pid

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream of the consumer's device on which copies complete."""
        return self._local_stream

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor, *, after=AFTER_CURRENT) -> CudaCopyTicket:
        """Copy the used ranges of slot ``index`` into ``dst`` (same offsets); returns a ticket.

        Nothing blocks on the host. ``after`` orders the write into dst after prior GPU work:
        "current" (default: whatever the caller has enqueued so far on its current stream of
        the consumer's device, e.g. reads of dst's previous contents), None, an event or a
        stream. Send SlotFree only once ``ticket.done()``."""
        if self._buffer is None:
            raise RuntimeError("cuda-ipc ring is closed")
        self._check_index(index)
        self.layout.check_counts(n_tokens, n_seqs)
        check_dst(dst, self.local_device, self.slot_bytes)
        b = self.slot_bytes
        src = self._buffer[index * b : (index + 1) * b]
        rs, ls = self._ring_stream, self._local_stream
        ev = self._events[index]
        wait_after(ls, after)
        if self.copy_mode == "pull":
            if not ev.query():
                # The producer's writes may still run: order the copy after them on the GPU.
                # Same-device wait on the interprocess event (from another device's stream it
                # crashes), then an ordinary event hops to the consumer's stream.
                rs.wait_event(ev)
                hop = torch.cuda.Event()
                hop.record(rs)
                ls.wait_event(hop)
            with torch.cuda.stream(ls):
                self.layout.copy_used(dst, src, n_tokens, n_seqs, non_blocking=True)
        else:
            rs.wait_event(ev)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.cuda.stream(rs))
                if ls is not rs:
                    # push: torch's peer copy runs on the source device's current stream (rs) and
                    # fences with the destination's current stream: make that ours, not the caller's.
                    stack.enter_context(torch.cuda.stream(ls))
                self.layout.copy_used(dst, src, n_tokens, n_seqs, non_blocking=True)
        return CudaCopyTicket.recorded_on(ls, index)

    @property
    def can_read_in_place(self) -> bool:
        """The ring lives on the consumer's GPU: its slots are read where they are."""
        return self.copy_mode == "same-device"

    def read_in_place(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        """Views of slot ``index`` itself; work enqueued afterwards on the consumer's current stream runs
        after the producer's writes (a same-device wait on the slot's interprocess event). Return the slot
        only once :meth:`reads_done`'s ticket is done."""
        if not self.can_read_in_place:
            raise RuntimeError(f"ring on {self.ring_device}, consumer on {self.local_device}: copy it out instead")
        self.layout.check_counts(n_tokens, n_seqs)
        torch.cuda.current_stream(self.local_device).wait_event(self._events[index])
        return self.views(index, n_tokens, n_seqs)

    def reads_done(self, index: int) -> CudaCopyTicket:
        """A ticket for everything enqueued on the consumer's current stream so far (the step's reads of the slot)."""
        self._check_index(index)
        return CudaCopyTicket.recorded_on(torch.cuda.current_stream(self.local_device), index)

    def close(self) -> None:
        """Drop this process's mappings (idempotent); call before the producer closes."""
        if self._buffer is None:
            return
        self._local_stream.synchronize()
        self._ring_stream.synchronize()
        self._events = []
        self._buffer = None


def create_producer(
    layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int, device: DeviceLike, host: str, timeout_s: float
) -> CudaIpcProducerRing:
    """The factory's entry point (``transport/factory.py``): the ring on ``device``'s GPU; no host, no timeout."""
    return CudaIpcProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))


def open_consumer(descriptor: RingDescriptor, device: DeviceLike, consumer_rank: int | None, timeout_s: float) -> CudaIpcConsumerRing:
    return CudaIpcConsumerRing(descriptor, cuda_device(device))
