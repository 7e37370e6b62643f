"""GPU ring backends: ``cuda-ipc`` (GPU memory shared through CUDA IPC) and ``host-pinned``.

Both implement the ProducerRing / ConsumerRing protocols of :mod:`dflash_ipc.transport.ring`; the
factories there import this module lazily, so importing ``dflash_ipc.transport.ring`` never needs CUDA.

cuda-ipc
    The producer allocates its whole ring once, as one ``torch.empty(num_slots * slot_bytes,
    uint8)`` on its GPU, plus one interprocess CUDA event per slot. The ring's descriptor is a
    plain dict of msgpack-able fields (bytes / ints / strs): the IPC memory handle of the
    allocation (from the storage's ``_share_cuda_``), the offset of the ring inside it, its
    size, the device index and UUID, and one event IPC handle per slot. A consumer imports the
    memory handle and the event handles exactly once (``_new_shared_cuda`` /
    ``Event.from_ipc_handle``) and keeps them for its life.

    The packer writes straight into the GPU slot (``staging_views``) on its side stream;
    ``commit`` records the slot's event on that stream. A consumer on another GPU maps the ring
    into its own GPU's context (peer mapping, "pull"; ``DFLASH_IPC_CUDA_COPY=push`` or a failed
    mapping copies on the ring's GPU instead). ``copy_out``: if the slot's event has completed
    (host query) the copy of the used ranges is issued on the consumer's own copy stream;
    otherwise a stream **of the ring's device** waits on the event (waiting on an interprocess
    event from a stream of another device crashes the process, see GPU_NOTES) and an ordinary
    event carries the dependency to the copy stream. A completion event is the ticket. Several
    tickets may be in flight; nothing waits on the host.

    Reference counting: torch's own CUDA IPC reference counting keeps a shared block alive in
    the producer ("limbo") until every receiver has released it, so a receiver killed with
    SIGKILL would pin the producer's ring until the producer exits. This module does not use
    it: the producer zeroes its counter right after exporting and receivers are given no
    counter. The ring's lifetime is instead the protocol's: consumers ``close`` (drop their
    mappings) first, then the producer ``close``s, which frees the memory at once whether or
    not a consumer died holding a mapping (a dead process's mappings die with it).

host-pinned
    For GPUs without peer access. The ring is POSIX shared memory (as ``cpu-shm``), page-locked
    with ``cudaHostRegister`` in both processes. The packer writes into a producer-local GPU
    staging slot; ``commit`` copies the used ranges D2H into the shared slot on the packing
    stream and synchronizes that stream, so the bytes are in host memory before SlotReady is
    sent. ``copy_out`` is an H2D copy on a local stream plus a completion-event ticket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterable, Sequence

import torch

from dflash_ipc.transport.ring import SHM_DIR, create_shm_tensor, open_shm_tensor, shm_name
from dflash_ipc.transport.slots import SlotLayout, SlotViews

log = logging.getLogger(__name__)

DESCRIPTOR_VERSION = 1
# Ranges closer than this are copied as one range (the gap's bytes are copied too; they are
# unused on both sides). One copy costs more than copying a megabyte over NVLink.
COALESCE_GAP = 1 << 20
# GPU staging slots for writers that use staging_views (the target's packer writes the pinned
# slot directly through pack_target).
HOST_PINNED_STAGING_SLOTS = 3
# Name given to torch as the consumer's IPC reference-counter file: it never exists, so a
# consumer's release is a no-op (see the module docstring).
_NO_REFCOUNT = b"/dflash-ipc-no-refcount"

AFTER_CURRENT = "current"
# cuda-ipc consumers on another GPU: "pull" maps the ring into the consumer's GPU and copies there
# (default, falls back to push if the mapping fails), "push" copies on the ring's GPU.
COPY_MODE_ENV = "DFLASH_IPC_CUDA_COPY"


# --------------------------------------------------------------------------- helpers


def cuda_device(device: torch.device | str | int | None) -> torch.device:
    """A CUDA device with an explicit index (``"cuda"`` means the current device)."""
    if device is None:
        device = "cuda"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{device} is not a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_uuid(index: int) -> str:
    """The GPU's UUID as nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)."""
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)
    if raw is None:
        return str(uuid)
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _check_uuid(index: int, expected: str) -> None:
    n = torch.cuda.device_count()
    if index >= n:
        raise RuntimeError(
            f"ring is on cuda:{index} but this process sees only {n} CUDA device(s); start every process of a run "
            f"with the same CUDA_VISIBLE_DEVICES (here {os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
        )
    actual = device_uuid(index)
    if actual != expected:
        where = [i for i in range(n) if device_uuid(i) == expected]
        hint = f"; that GPU is cuda:{where[0]} here" if where else "; this process does not see that GPU at all"
        raise RuntimeError(
            f"ring device UUID mismatch: the producer's ring is on its cuda:{index} (UUID {expected}) but cuda:{index} "
            f"in this process is UUID {actual}{hint}. Start every process of a run with the same CUDA_VISIBLE_DEVICES "
            f"(here {os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})."
        )


def coalesce(ranges: Iterable[tuple[int, int]], max_gap: int = COALESCE_GAP) -> list[tuple[int, int]]:
    """Drop empty ranges and merge ranges (sorted by offset) separated by at most max_gap bytes."""
    out: list[tuple[int, int]] = []
    for off, nbytes in ranges:
        if nbytes <= 0:
            continue
        if out and off - (out[-1][0] + out[-1][1]) <= max_gap:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][0] + out[-1][1], off + nbytes) - start)
        else:
            out.append((off, nbytes))
    return out


def _check_counts(layout: SlotLayout, n_tokens: int, n_seqs: int) -> None:
    if not 0 <= n_tokens <= layout.max_tokens:
        raise ValueError(f"n_tokens {n_tokens} outside slot capacity {layout.max_tokens}")
    if not 0 <= n_seqs <= layout.max_seqs:
        raise ValueError(f"n_seqs {n_seqs} outside slot capacity {layout.max_seqs}")


def _host_register(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))


def _host_unregister(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


def _wait_after(stream: torch.cuda.Stream, after) -> None:
    """Make ``stream`` wait for ``after``: "current" (the current stream of stream's device),
    None (nothing), a CUDA event, a CUDA stream, or a list of those."""
    if after is None:
        return
    if isinstance(after, str):
        if after != AFTER_CURRENT:
            raise ValueError(f"after={after!r}: use 'current', None, an event or a stream")
        cur = torch.cuda.current_stream(stream.device)
        if cur != stream:
            stream.wait_stream(cur)
        return
    if isinstance(after, (list, tuple)):
        for a in after:
            _wait_after(stream, a)
        return
    if isinstance(after, torch.cuda.Event):
        stream.wait_event(after)
    elif isinstance(after, torch.cuda.Stream):
        if after != stream:
            stream.wait_stream(after)
    else:
        raise TypeError(f"after: expected 'current', None, a torch.cuda.Event or Stream, got {type(after).__name__}")


class CudaCopyTicket:
    """A copy in flight. ``done()`` polls its completion event, ``wait()`` blocks on it.

    ``event`` is the completion event (recorded on the consumer's copy stream, device = the
    consumer's device): ``stream.wait_event(ticket.event)`` orders GPU work after the copy
    without a host round trip."""

    __slots__ = ("event", "slot", "_done")

    def __init__(self, event: torch.cuda.Event, slot: int):
        self.event = event
        self.slot = slot
        self._done = False

    def done(self) -> bool:
        if not self._done and self.event.query():
            self._done = True
        return self._done

    def wait(self) -> None:
        if not self._done:
            self.event.synchronize()
            self._done = True

    def stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        (stream or torch.cuda.current_stream(self.event.device)).wait_event(self.event)


class _RingBase:
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

    @property
    def closed(self) -> bool:
        return self._buffer is None


def _layout_from_descriptor(d: dict) -> tuple[SlotLayout, int]:
    layout = SlotLayout.from_wire(d["layout"])
    if layout.slot_bytes != int(d["slot_bytes"]):
        raise ValueError("ring descriptor slot_bytes disagrees with its layout")
    return layout, int(d["num_slots"])


# --------------------------------------------------------------------------- cuda-ipc


class CudaIpcProducerRing(_RingBase):
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
        self._descriptor = {
            "backend": self.backend,
            "version": DESCRIPTOR_VERSION,
            "run_id": str(run_id),
            "producer_rank": int(producer_rank),
            "producer_pid": os.getpid(),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "layout": layout.to_wire(),
            "device": int(self.device.index),
            "device_uuid": device_uuid(self.device.index),
            "mem_handle": bytes(mem_handle),
            "mem_offset": int(mem_offset),
            "mem_nbytes": int(mem_nbytes),
            "event_handles": event_handles,
        }

    # The packer writes straight into the GPU slot on its side stream.
    def staging_views(self, index: int, n_tokens: int, n_seqs: int) -> SlotViews:
        return self.views(index, n_tokens, n_seqs)

    def pack_target(self, index: int) -> torch.Tensor:
        """The flat buffer the packer writes for this slot: the GPU slot itself."""
        return self.slot(index)

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: torch.cuda.Stream | None = None) -> None:
        """Record the slot's event on the stream that wrote it (default: the device's current stream)."""
        self._check_index(index)
        if self._buffer is None:
            raise RuntimeError("cuda-ipc ring is closed")
        _check_counts(self.layout, n_tokens, n_seqs)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if stream.device.index != self.device.index:
            raise ValueError(f"commit on a stream of {stream.device}; the ring is on {self.device}")
        self._events[index].record(stream)

    def descriptor(self) -> dict:
        d = dict(self._descriptor)
        d["event_handles"] = list(d["event_handles"])
        d["layout"] = dict(d["layout"])
        return d

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
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, handle, mem_nbytes, mem_offset, _NO_REFCOUNT, 0, bytes(64), False
        )
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


class CudaIpcConsumerRing(_RingBase):
    backend = "cuda-ipc"

    def __init__(self, descriptor: dict, local_device: torch.device):
        layout, num_slots = _layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        ring_index = int(descriptor["device"])
        _check_uuid(ring_index, str(descriptor["device_uuid"]))
        self.ring_device = torch.device("cuda", ring_index)
        self.local_device = cuda_device(local_device)
        self.device = self.local_device
        handles = list(descriptor["event_handles"])
        if len(handles) != self.num_slots:
            raise ValueError(f"descriptor has {len(handles)} event handles for {self.num_slots} slots")
        nbytes = self.num_slots * self.slot_bytes
        mem_nbytes = int(descriptor["mem_nbytes"])
        if mem_nbytes < nbytes:
            raise ValueError(f"descriptor shares {mem_nbytes} bytes, the ring needs {nbytes}")
        t0 = time.perf_counter()
        mode = os.environ.get(COPY_MODE_ENV, "auto").strip().lower() or "auto"
        if mode not in ("auto", "pull", "push"):
            raise ValueError(f"{COPY_MODE_ENV}={mode!r}: use auto, pull or push")
        args = (bytes(descriptor["mem_handle"]), mem_nbytes, int(descriptor["mem_offset"]))
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
                    log.warning("cuda-ipc: mapping the ring of %s into %s failed (%s); copying from the ring's GPU (push)",
                                self.ring_device, self.local_device, e)
            if self._buffer is None:
                self._buffer = _import_ring(self.ring_device, args, nbytes)
                self.copy_mode = "push"
        with torch.cuda.device(self.ring_device):
            self._events = [torch.cuda.Event.from_ipc_handle(self.ring_device, bytes(h)) for h in handles]
            # Waits on the producer's interprocess events run on a stream of the ring's device.
            self._ring_stream = torch.cuda.Stream(self.ring_device)
        if self.local_device == self.ring_device:
            self._local_stream = self._ring_stream
        else:
            self._local_stream = torch.cuda.Stream(self.local_device)
        self.open_seconds = time.perf_counter() - t0
        self.producer_pid = descriptor.get("producer_pid")

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream of the consumer's device on which copies complete."""
        return self._local_stream

    def _check_dst(self, dst: torch.Tensor) -> None:
        if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
            raise ValueError("dst must be a contiguous 1-D uint8 tensor")
        if dst.device != self.local_device:
            raise ValueError(f"dst is on {dst.device}; this ring copies to {self.local_device}")
        if dst.numel() < self.slot_bytes:
            raise ValueError(f"dst has {dst.numel()} bytes, a slot has {self.slot_bytes}")

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor, *, after=AFTER_CURRENT) -> CudaCopyTicket:
        """Copy the used ranges of slot ``index`` into ``dst`` (same offsets); returns a ticket.

        Nothing blocks on the host. ``after`` orders the write into dst after prior GPU work:
        "current" (default: whatever the caller has enqueued so far on its current stream of
        the consumer's device, e.g. reads of dst's previous contents), None, an event or a
        stream. Send SlotFree only once ``ticket.done()``."""
        if self._buffer is None:
            raise RuntimeError("cuda-ipc ring is closed")
        self._check_index(index)
        _check_counts(self.layout, n_tokens, n_seqs)
        self._check_dst(dst)
        b = self.slot_bytes
        src = self._buffer[index * b : (index + 1) * b]
        rs, ls = self._ring_stream, self._local_stream
        ev = self._events[index]
        _wait_after(ls, after)
        ranges = coalesce(self.layout.used_ranges(n_tokens, n_seqs))
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
                for off, nbytes in ranges:
                    dst[off : off + nbytes].copy_(src[off : off + nbytes], non_blocking=True)
        else:
            rs.wait_event(ev)
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.cuda.stream(rs))
                if ls is not rs:
                    # push: torch's peer copy runs on the source device's current stream (rs) and
                    # fences with the destination's current stream: make that ours, not the caller's.
                    stack.enter_context(torch.cuda.stream(ls))
                for off, nbytes in ranges:
                    dst[off : off + nbytes].copy_(src[off : off + nbytes], non_blocking=True)
        done = torch.cuda.Event()
        done.record(ls)
        return CudaCopyTicket(done, index)

    def close(self) -> None:
        """Drop this process's mappings (idempotent); call before the producer closes."""
        if self._buffer is None:
            return
        self._local_stream.synchronize()
        self._ring_stream.synchronize()
        self._events = []
        self._buffer = None


# --------------------------------------------------------------------------- host-pinned


class HostPinnedProducerRing(_RingBase):
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
                _host_register(self._buffer)
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
        _check_counts(self.layout, n_tokens, n_seqs)
        k = self._staging_for(index)
        if k is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if stream.device.index != self.device.index:
            raise ValueError(f"commit on a stream of {stream.device}; the staging slot is on {self.device}")
        src = self._staging[k]
        dst = self.slot(index)
        with torch.cuda.stream(stream):
            for off, nbytes in coalesce(self.layout.used_ranges(n_tokens, n_seqs)):
                dst[off : off + nbytes].copy_(src[off : off + nbytes], non_blocking=True)
        stream.synchronize()
        self._staging_owner[k] = None

    def descriptor(self) -> dict:
        return {
            "backend": self.backend,
            "version": DESCRIPTOR_VERSION,
            "run_id": self._run_id,
            "producer_rank": self._rank,
            "producer_pid": os.getpid(),
            "name": self.name,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "layout": self.layout.to_wire(),
            "device": int(self.device.index),
            "device_uuid": device_uuid(self.device.index),
        }

    def _unmap(self) -> None:
        if self._buffer is not None and self._registered:
            try:
                _host_unregister(self._buffer)
            except Exception as e:  # teardown is best effort
                log.warning("cudaHostUnregister of %s failed: %s", self.name, e)
        self._registered = False
        self._buffer = None
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass

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


class HostPinnedConsumerRing(_RingBase):
    backend = "host-pinned"

    def __init__(self, descriptor: dict, local_device: torch.device):
        layout, num_slots = _layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        self.local_device = cuda_device(local_device)
        self.device = self.local_device
        self.name = str(descriptor["name"])
        t0 = time.perf_counter()
        self._buffer = open_shm_tensor(self.name, self.num_slots * self.slot_bytes)
        self._registered = False
        try:
            with torch.cuda.device(self.local_device):
                _host_register(self._buffer)
                self._registered = True
                self._stream = torch.cuda.Stream(self.local_device)
        except BaseException:
            self.close()
            raise
        self.open_seconds = time.perf_counter() - t0
        self.producer_pid = descriptor.get("producer_pid")

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._stream

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor, *, after=AFTER_CURRENT) -> CudaCopyTicket:
        """H2D of the used ranges of slot ``index`` into ``dst`` on a local stream; see CudaIpcConsumerRing.copy_out."""
        if self._buffer is None:
            raise RuntimeError("host-pinned ring is closed")
        self._check_index(index)
        _check_counts(self.layout, n_tokens, n_seqs)
        if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous() or dst.device != self.local_device:
            raise ValueError(f"dst must be a contiguous 1-D uint8 tensor on {self.local_device}")
        if dst.numel() < self.slot_bytes:
            raise ValueError(f"dst has {dst.numel()} bytes, a slot has {self.slot_bytes}")
        src = self.slot(index)
        s = self._stream
        _wait_after(s, after)
        with torch.cuda.stream(s):
            for off, nbytes in coalesce(self.layout.used_ranges(n_tokens, n_seqs)):
                dst[off : off + nbytes].copy_(src[off : off + nbytes], non_blocking=True)
        done = torch.cuda.Event()
        done.record(s)
        return CudaCopyTicket(done, index)

    def close(self) -> None:
        if self._buffer is None:
            return
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.synchronize()
        if self._registered:
            try:
                with torch.cuda.device(self.local_device):
                    _host_unregister(self._buffer)
            except Exception as e:
                log.warning("cudaHostUnregister of %s failed: %s", self.name, e)
            self._registered = False
        self._buffer = None


# --------------------------------------------------------------------------- factories


def create_producer_ring(
    backend: str,
    layout: SlotLayout,
    num_slots: int,
    *,
    run_id: str,
    producer_rank: int,
    device: torch.device | str | int,
):
    if backend == "cuda-ipc":
        return CudaIpcProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))
    if backend == "host-pinned":
        return HostPinnedProducerRing(layout, num_slots, run_id, producer_rank, cuda_device(device))
    raise ValueError(f"ring_cuda has no backend {backend!r} (cuda-ipc, host-pinned)")


def open_consumer_ring(descriptor: dict, local_device: torch.device | str | int):
    """Import a producer's ring once; keep the returned object for the consumer's life."""
    backend = descriptor.get("backend")
    version = int(descriptor.get("version", DESCRIPTOR_VERSION))
    if version != DESCRIPTOR_VERSION:
        raise ValueError(f"ring descriptor version {version}, this build reads {DESCRIPTOR_VERSION}")
    if backend == "cuda-ipc":
        return CudaIpcConsumerRing(descriptor, cuda_device(local_device))
    if backend == "host-pinned":
        return HostPinnedConsumerRing(descriptor, cuda_device(local_device))
    raise ValueError(f"ring_cuda has no backend {backend!r} (cuda-ipc, host-pinned)")


def _as_device(d: torch.device | str | int) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    return torch.device(d)


def choose_backend(producer_device: torch.device | str | int, consumer_devices: Sequence[torch.device | str | int]) -> tuple[str, str]:
    """``transport.backend = "auto"``: (backend, reason). cuda-ipc when every consumer GPU is the
    producer's GPU or has peer access with it both ways, host-pinned otherwise; cpu-shm when
    the producer or a consumer is not on a GPU. The caller logs the reason."""
    pd = _as_device(producer_device)
    cds = [_as_device(d) for d in consumer_devices]
    if pd.type != "cuda":
        return "cpu-shm", f"producer device is {pd}"
    if not torch.cuda.is_available():
        return "cpu-shm", "CUDA is not available"
    not_gpu = [str(d) for d in cds if d.type != "cuda"]
    if not_gpu:
        return "cpu-shm", f"consumer device(s) {', '.join(not_gpu)} not on a GPU"
    p = cuda_device(pd).index
    peers, missing = set(), []
    for d in cds:
        c = cuda_device(d).index
        if c == p:
            continue
        if torch.cuda.can_device_access_peer(p, c) and torch.cuda.can_device_access_peer(c, p):
            peers.add(c)
        else:
            missing.append(c)
    if missing:
        lst = ", ".join(f"cuda:{p}<->cuda:{c}" for c in sorted(set(missing)))
        return "host-pinned", f"no CUDA peer access for {lst}: staging through page-locked host memory"
    if not peers:
        return "cuda-ipc", f"every consumer is on the producer's GPU cuda:{p}"
    lst = ", ".join(f"cuda:{c}" for c in sorted(peers))
    return "cuda-ipc", f"cuda:{p} has peer access with {lst}" + (" (others on the same GPU)" if len(peers) < len(cds) else "")
