"""What the two GPU ring backends (``cuda_ipc``, ``host_pinned``) share: the copy ticket, device
identity checks, page-locking, and stream ordering of copies."""

from __future__ import annotations

import os

import torch

AFTER_CURRENT = "current"


def device_uuid(index: int) -> str:
    """The GPU's UUID as nvidia-smi prints it (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)."""
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)
    if raw is None:
        return str(uuid)
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def check_uuid(index: int, expected: str) -> None:
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


def check_dst(dst: torch.Tensor, device: torch.device, slot_bytes: int) -> None:
    """A copy_out destination: a contiguous 1-D uint8 tensor on the consumer's device, a slot long."""
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError("dst must be a contiguous 1-D uint8 tensor")
    if dst.device != device:
        raise ValueError(f"dst is on {dst.device}; this ring copies to {device}")
    if dst.numel() < slot_bytes:
        raise ValueError(f"dst has {dst.numel()} bytes, a slot has {slot_bytes}")


def host_register(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))


def host_unregister(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


def wait_after(stream: torch.cuda.Stream, after) -> None:
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
            wait_after(stream, a)
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

    __slots__ = ("_done", "event", "slot")

    def __init__(self, event: torch.cuda.Event, slot: int):
        self.event = event
        self.slot = slot
        self._done = False

    @classmethod
    def recorded_on(cls, stream: torch.cuda.Stream, slot: int) -> CudaCopyTicket:
        """A ticket for everything enqueued on ``stream`` so far (the copy just issued there)."""
        done = torch.cuda.Event()
        done.record(stream)
        return cls(done, slot)

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
