"""What the two GPU ring backends (``cuda_ipc``, ``host_pinned``) share: the copy ticket, device
identity checks, page-locking, and stream ordering of copies."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from dflash_ipc.transport.slots import SlotLayout

AFTER_CURRENT = "current"
# Ranges closer than this are copied as one range (the gap's bytes are copied too; they are
# unused on both sides). One copy costs more than copying a megabyte over NVLink.
COALESCE_GAP = 1 << 20


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


def check_counts(layout: SlotLayout, n_tokens: int, n_seqs: int) -> None:
    if not 0 <= n_tokens <= layout.max_tokens:
        raise ValueError(f"n_tokens {n_tokens} outside slot capacity {layout.max_tokens}")
    if not 0 <= n_seqs <= layout.max_seqs:
        raise ValueError(f"n_seqs {n_seqs} outside slot capacity {layout.max_seqs}")


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
