"""Pack one batch's captured hidden states into a ring slot, off the critical path.

Captured planes come right-padded ``[B, L, H]`` (the padded forward) or packed ``[1, n, H]``
(the varlen forward, :mod:`dflash_ipc.target.varlen`: already the slot's order, copied as is).

What goes into the slot (see :mod:`dflash_ipc.transport.slots`): the per-layer planes ``[k, n, H]`` of the
*real* tokens only (right padding stripped; ``n = sum(seq_lens)``, documents back to back),
their token ids, loss mask and the per-document lengths. Layers are not concatenated and no
noise is added: the drafter does that.

Gathering is one ``index_select`` per plane with a precomputed flat index of the real
positions (``b * L + t`` for ``t < len_b``), written straight into the slot view (or into a
staging buffer plus one copy when the slot lives on another device).

:class:`AsyncPacker` takes packing off the target's critical path:

* CUDA: packing runs on a side stream that waits on an event recorded on the compute stream
  after the forward, then records a completion event. The captured tensors (and every other
  tensor the side stream reads) get ``record_stream(side)`` *and* stay referenced by the
  handle until that event has completed, so the caching allocator can never hand their memory
  to the next forward while the pack still reads it; the next forward starts immediately.
* CPU: a background worker thread (torch ops release the GIL) with the same interface.
* ``async_pack=False``: pack inline on the caller's stream/thread, for comparison.

Contract for callers: after :meth:`AsyncPacker.submit` the captured tensors belong to the
packer. Dropping them is safe; modifying them *in place* before the handle is done is not
(nothing could order that write after the pack). The slot must not be read (or handed to a
consumer) before ``handle.done()`` / ``handle.wait()``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_ipc.transport.slots import SlotLayout, SlotViews

__all__ = ["BatchMeta", "PackHandle", "AsyncPacker", "OverlapMeter", "flat_batch_meta", "real_token_index", "pack_into_slot"]


@dataclass
class BatchMeta:
    """Host-side description of one batch.

    ``token_ids`` / ``loss_mask`` are either right-padded ``[B, L]`` (same layout as the
    target's input) or already flat ``[n]`` over the real tokens; any device. ``seq_lens`` are
    the real lengths per row, on the host (a list or a CPU tensor), so no device sync is needed.
    """

    seq_lens: Sequence[int] | torch.Tensor
    token_ids: torch.Tensor
    loss_mask: torch.Tensor

    def lens(self) -> list[int]:
        s = self.seq_lens
        if isinstance(s, torch.Tensor):
            if s.device.type != "cpu":
                raise ValueError("BatchMeta.seq_lens must be on the host (a list or a CPU tensor)")
            return [int(x) for x in s.tolist()]
        return [int(x) for x in s]


def real_token_index(seq_lens: torch.Tensor, padded_len: int, n_tokens: int) -> torch.Tensor:
    """Flat positions ``b * L + t`` (t < len_b) of the real tokens of a right-padded [B, L]
    batch, in order; computed on ``seq_lens``'s device without a host sync."""
    lens = seq_lens.to(torch.int64)
    b = lens.shape[0]
    starts = torch.arange(b, device=lens.device, dtype=torch.int64) * padded_len
    excl = torch.cumsum(lens, 0) - lens  # position of each row's first token in the packed order
    offset = torch.repeat_interleave(starts - excl, lens, output_size=n_tokens)
    return offset + torch.arange(n_tokens, device=lens.device, dtype=torch.int64)


def flat_batch_meta(token_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: Sequence[int] | torch.Tensor, pin: bool) -> BatchMeta:
    """The real tokens' ids (int64) and loss mask (uint8) of a right-padded host batch, flat
    ``[n]``; ``pin``: in page-locked memory, so a pack copies them host-to-device without the
    host waiting. Doing this before ``submit`` (on GPU: while the forward still runs) keeps
    ``submit`` to enqueueing GPU work (docs/BENCHMARKS.md has the measured submit times)."""
    meta = BatchMeta(seq_lens=seq_lens, token_ids=token_ids, loss_mask=loss_mask)
    lens = meta.lens()
    idx = real_token_index(torch.tensor(lens, dtype=torch.int64), token_ids.shape[1], sum(lens))
    ids = token_ids.reshape(-1).index_select(0, idx).to(torch.int64)
    mask = loss_mask.reshape(-1).index_select(0, idx).to(torch.uint8)
    if pin:
        ids, mask = ids.pin_memory(), mask.pin_memory()
    return BatchMeta(seq_lens=lens, token_ids=ids, loss_mask=mask)


def _check(layout: SlotLayout, captured: Sequence[torch.Tensor], lens: list[int]) -> tuple[int, int, int, bool]:
    """Validate one batch; returns ``(rows, row_len, n_tokens, packed)``. Captured planes are
    right-padded ``[B, L, H]`` (one document per row) or packed ``[1, n, H]`` (the documents back
    to back, the varlen forward's layout: already the slot's, copied without a gather)."""
    if len(captured) != layout.num_planes:
        raise ValueError(f"{len(captured)} captured planes but the slot layout has {layout.num_planes}")
    shape = tuple(captured[0].shape)
    if len(shape) != 3 or shape[2] != layout.hidden_size:
        raise ValueError(f"captured planes must be [B, L, {layout.hidden_size}] (got {shape})")
    for t in captured:
        if tuple(t.shape) != shape:
            raise ValueError(f"captured planes differ in shape: {tuple(t.shape)} vs {shape}")
    b, seq = shape[0], shape[1]
    n = sum(lens)
    packed = b == 1 and seq == n and len(lens) >= 1
    if not packed and len(lens) != b:
        raise ValueError(f"{len(lens)} sequence lengths for a batch of {b} rows (nor a packed [1, {n}] row)")
    if any(not 0 < x <= seq for x in lens):
        raise ValueError(f"sequence lengths must be in 1..{seq} (got {lens})")
    if n > layout.max_tokens or len(lens) > layout.max_seqs:
        raise ValueError(f"batch of {n} tokens / {len(lens)} sequences exceeds the slot ({layout.max_tokens} / {layout.max_seqs})")
    return b, seq, n, packed


def _gather_flat(t: torch.Tensor, b: int, seq: int, n: int, idx_for: Any) -> torch.Tensor:
    """``t`` ([B, L] padded, [1, n] packed or [n] flat) -> [n] real tokens, on t's device."""
    if t.dim() == 2 and tuple(t.shape) == (1, n):
        return t.reshape(-1)
    if t.dim() == 2:
        if tuple(t.shape) != (b, seq):
            raise ValueError(f"token_ids/loss_mask must be [B, L] = {(b, seq)} or flat [n] (got {tuple(t.shape)})")
        return t.reshape(-1).index_select(0, idx_for(t.device))
    if t.dim() == 1 and t.shape[0] == n:
        return t
    raise ValueError(f"token_ids/loss_mask must be [B, L] = {(b, seq)} or flat [{n}] (got {tuple(t.shape)})")


def _copy_into(dst: torch.Tensor, src: torch.Tensor, keep: list) -> None:
    """dst.copy_(src) across devices without stalling the host where possible."""
    if src.device != dst.device and src.device.type == "cpu" and dst.device.type == "cuda":
        src = src.contiguous().pin_memory()  # caching host allocator: cheap after warm-up
    keep.append(src)
    dst.copy_(src, non_blocking=src.device != dst.device)


def pack_into_slot(
    layout: SlotLayout,
    slot_tensor: torch.Tensor,
    captured: Sequence[torch.Tensor],
    meta: BatchMeta,
    keep: list | None = None,
) -> SlotViews:
    """Write one batch into ``slot_tensor`` on the current stream / thread (the synchronous core).

    ``keep`` collects temporaries that in-flight copies still read (for asynchronous callers)."""
    keep = [] if keep is None else keep
    lens = meta.lens()
    b, seq, n, packed = _check(layout, captured, lens)
    views = layout.views(slot_tensor, n, len(lens))
    dev = captured[0].device
    lens_host = torch.tensor(lens, dtype=torch.int64)

    idx_cache: dict[torch.device, torch.Tensor] = {}

    def idx_for(device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        if device not in idx_cache:
            if device.type == "cuda":
                lens_dev = lens_host.pin_memory().to(device, non_blocking=True)
                keep.append(lens_dev)
                idx_cache[device] = real_token_index(lens_dev, seq, n)
            else:
                idx_cache[device] = real_token_index(lens_host, seq, n)
            keep.append(idx_cache[device])
        return idx_cache[device]

    idx = None if packed else idx_for(dev)
    same = views.planes.device == dev
    staging = None
    if not same:
        staging = torch.empty((layout.num_planes, n, layout.hidden_size), dtype=views.planes.dtype, device=dev)
        keep.append(staging)
    target = views.planes if same else staging
    for j, h in enumerate(captured):
        flat = h.reshape(-1, layout.hidden_size)  # a view for contiguous [B, L, H]
        if idx is None:
            target[j].copy_(flat)
        elif flat.dtype == target.dtype:
            torch.index_select(flat, 0, idx, out=target[j])
        else:
            target[j].copy_(flat.index_select(0, idx))
    if staging is not None:
        views.planes.copy_(staging, non_blocking=True)

    ids = _gather_flat(meta.token_ids, b, seq, n, idx_for)
    _copy_into(views.token_ids, ids if ids.dtype == torch.int64 else ids.to(torch.int64), keep)
    mask = _gather_flat(meta.loss_mask, b, seq, n, idx_for)
    _copy_into(views.loss_mask, mask if mask.dtype == torch.uint8 else mask.to(torch.uint8), keep)
    _copy_into(views.seq_lens, lens_host.to(torch.int32), keep)
    return views


class PackHandle:
    """One submitted pack. ``done()`` polls, ``wait()`` blocks (and re-raises a pack error)."""

    def __init__(self, slot_index: int, n_tokens: int, n_seqs: int):
        self.slot_index = slot_index
        self.n_tokens = n_tokens
        self.n_seqs = n_seqs
        self.submit_time = time.perf_counter()
        self._event: Any = None  # torch.cuda.Event (CUDA) / threading.Event (CPU)
        self._start_event: Any = None
        self._keep: list | None = []  # tensors the pack reads/writes, released once done
        self._error: BaseException | None = None
        self._pack_s: float | None = None
        self._host_interval: tuple[float, float] | None = None  # perf_counter start/end (CPU packs)
        self._finished = False

    def done(self) -> bool:
        if self._finished:
            return True
        ev = self._event
        ok = ev.is_set() if isinstance(ev, threading.Event) else (ev is None or ev.query())
        if ok:
            self._finish()
        return ok

    def wait(self, timeout: float | None = None) -> PackHandle:
        if not self._finished:
            ev = self._event
            if isinstance(ev, threading.Event):
                if not ev.wait(timeout):
                    raise TimeoutError(f"pack into slot {self.slot_index} not done after {timeout} s")
            elif ev is not None:
                ev.synchronize()
            self._finish()
        if self._error is not None:
            raise RuntimeError(f"packing into slot {self.slot_index} failed") from self._error
        return self

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def pack_time_s(self) -> float | None:
        """Time spent packing (GPU time on CUDA, worker wall time on CPU); None until done."""
        if self._pack_s is None and self._finished and self._start_event is not None:
            self._pack_s = self._start_event.elapsed_time(self._event) / 1e3
        return self._pack_s

    @property
    def marks(self) -> tuple[Any, Any] | None:
        """Start and end of the pack on :class:`OverlapMeter`'s clock: CUDA events on the
        packing stream, or host ``perf_counter`` seconds for a CPU pack; None until done."""
        if not self._finished or self._error is not None:
            return None
        if self._start_event is not None:
            return (self._start_event, self._event)
        return self._host_interval

    def _finish(self) -> None:
        self._finished = True
        self._keep = None  # only now may the captured tensors be freed / reused


class AsyncPacker:
    """Packs captured planes into ring slots on a side CUDA stream / a CPU worker thread.

    ``submit`` returns immediately (after at most ``max_pending`` packs are in flight; older
    ones are waited for first). ``stats()`` reports pack counts and times.
    """

    def __init__(
        self,
        layout: SlotLayout,
        device,
        async_pack: bool = True,
        max_pending: int = 2,
        *,
        _debug_delay_s: float = 0.0,
        _unsafe_no_keepalive: bool = False,
    ):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.layout = layout
        self.device = torch.device(device)
        self.async_pack = bool(async_pack)
        self.max_pending = int(max_pending)
        self._delay = float(_debug_delay_s)  # tests: make the pack start late
        self._unsafe = bool(_unsafe_no_keepalive)  # tests only: prove the keep-alive matters
        self._pending: deque[PackHandle] = deque()
        self._count = 0
        self._total_s = 0.0
        self._max_s = 0.0
        self._closed = False
        self._cuda = self.device.type == "cuda"
        self._stream = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if self.async_pack and self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
        elif self.async_pack:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._worker, name="dflash-packer", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public

    def submit(self, captured: Sequence[torch.Tensor], batch_meta: BatchMeta, slot_index: int, slot_tensor: torch.Tensor) -> PackHandle:
        if self._closed:
            raise RuntimeError("AsyncPacker is closed")
        lens = batch_meta.lens()
        _check(self.layout, captured, lens)
        if slot_tensor.dtype != torch.uint8 or slot_tensor.dim() != 1 or slot_tensor.numel() < self.layout.slot_bytes:
            raise ValueError(f"slot_tensor must be a 1-D uint8 tensor of >= {self.layout.slot_bytes} bytes")
        self._reap(block_until=self.max_pending - 1)
        handle = PackHandle(slot_index, sum(lens), len(lens))
        captured = list(captured)
        if not self._unsafe:
            handle._keep.extend(captured)
            handle._keep.extend([batch_meta.token_ids, batch_meta.loss_mask])
        if self._cuda:
            self._submit_cuda(handle, captured, batch_meta, slot_tensor)
        elif self._queue is not None:
            handle._event = threading.Event()
            self._queue.put((handle, captured, batch_meta, slot_tensor))
        else:
            t0 = time.perf_counter()
            try:
                pack_into_slot(self.layout, slot_tensor, captured, batch_meta)
            except BaseException as e:  # surfaced by wait()
                handle._error = e
            t1 = time.perf_counter()
            handle._pack_s = t1 - t0
            handle._host_interval = (t0, t1)
            handle._finish()
        self._pending.append(handle)
        return handle

    def drain(self) -> None:
        """Wait for every submitted pack (re-raises the first error)."""
        self._reap(block_until=0)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True
            if self._queue is not None:
                self._queue.put(None)
                if self._thread is not None:
                    self._thread.join(timeout=10)

    def stats(self) -> dict[str, float]:
        self._reap(block_until=None)
        mean = self._total_s / self._count if self._count else 0.0
        return {
            "packs": self._count,
            "pack_s_total": self._total_s,
            "pack_s_mean": mean,
            "pack_s_max": self._max_s,
            "pending": len(self._pending),
        }

    def __enter__(self) -> AsyncPacker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _submit_cuda(self, handle: PackHandle, captured: list, meta: BatchMeta, slot_tensor: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        if not self.async_pack:
            handle._start_event = torch.cuda.Event(enable_timing=True)
            handle._event = torch.cuda.Event(enable_timing=True)
            handle._start_event.record(compute)
            pack_into_slot(self.layout, slot_tensor, captured, meta, keep=handle._keep if not self._unsafe else None)
            handle._event.record(compute)
            return
        side = self._stream
        ready = torch.cuda.Event()
        ready.record(compute)  # after the forward that produced `captured`
        if not self._unsafe:
            for t in captured + [meta.token_ids, meta.loss_mask]:
                if t.device.type == "cuda":
                    t.record_stream(side)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if self._delay > 0:
                torch.cuda._sleep(int(self._delay * 1.5e9))  # ~cycles at ~1.5 GHz
            handle._start_event = torch.cuda.Event(enable_timing=True)
            handle._event = torch.cuda.Event(enable_timing=True)
            handle._start_event.record(side)
            keep: list = []
            pack_into_slot(self.layout, slot_tensor, captured, meta, keep=keep)
            handle._event.record(side)
        if not self._unsafe:
            handle._keep.extend(keep)  # side-stream temporaries: allocated on `side`, safe anyway

    def _worker(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            if item is None:
                return
            handle, captured, meta, slot_tensor = item
            try:
                if self._delay > 0:
                    time.sleep(self._delay)
                t0 = time.perf_counter()
                pack_into_slot(self.layout, slot_tensor, captured, meta)
                t1 = time.perf_counter()
                handle._pack_s = t1 - t0
                handle._host_interval = (t0, t1)
            except BaseException as e:  # surfaced by wait()
                handle._error = e
            finally:
                del captured, meta, slot_tensor, item
                handle._event.set()

    def _reap(self, block_until: int | None) -> None:
        """Retire finished packs; with ``block_until`` wait until at most that many remain."""
        err = None
        while self._pending:
            h = self._pending[0]
            if not h.done():
                if block_until is None or len(self._pending) <= block_until:
                    break
                try:
                    h.wait()
                except RuntimeError:
                    pass
            self._pending.popleft()
            if h.pack_time_s is not None:
                self._count += 1
                self._total_s += h.pack_time_s
                self._max_s = max(self._max_s, h.pack_time_s)
            if h.error is not None and err is None:
                err = h.error
        if err is not None:
            raise RuntimeError("an earlier pack failed") from err


class OverlapMeter:
    """How much of the packing ran while a forward was running: the point of packing async.

    Forwards and packs are intervals on one clock per device: on CUDA, GPU time since a
    reference event recorded at start (the marks are CUDA events, read only once complete, so
    measuring adds no host sync); on CPU, host ``perf_counter`` seconds. A pack is settled once
    a forward has ended after it (or at :meth:`stats` with ``final``): the part of it that
    intersects no forward is *exposed*; with synchronous packing all of it would be.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._ref = None
        if self.device.type == "cuda":
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record(torch.cuda.current_stream(self.device))
        self._forwards: deque[tuple[float, float]] = deque(maxlen=16)
        self._unsettled: list[tuple[float, float]] = []
        self.packs = 0
        self.pack_s = 0.0
        self.overlapped_s = 0.0

    def mark(self) -> Any:
        """A point in time on this meter's clock, taken on the current stream."""
        if self._ref is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _seconds(self, mark: Any) -> float:
        if isinstance(mark, float):
            return mark
        return self._ref.elapsed_time(mark) / 1e3

    def add_forward(self, start: Any, end: Any) -> None:
        """A forward whose end mark has completed."""
        interval = (self._seconds(start), self._seconds(end))
        self._forwards.append(interval)
        self._settle(until=interval[1])

    def add_pack(self, handle: PackHandle) -> None:
        """A pack that is done (failed packs are ignored)."""
        marks = handle.marks
        if marks is None:
            return
        self._unsettled.append((self._seconds(marks[0]), self._seconds(marks[1])))

    def _settle(self, until: float | None) -> None:
        keep = []
        for start, end in self._unsettled:
            if until is not None and end > until:
                keep.append((start, end))
                continue
            self.packs += 1
            self.pack_s += end - start
            self.overlapped_s += sum(max(0.0, min(end, fe) - max(start, fs)) for fs, fe in self._forwards)
        self._unsettled = keep

    def stats(self, final: bool = False) -> dict[str, float]:
        if final:
            self._settle(until=None)
        exposed = self.pack_s - self.overlapped_s
        return {
            "packs_measured": self.packs,
            "pack_overlap_pct": 100.0 * self.overlapped_s / self.pack_s if self.pack_s > 0 else 0.0,
            "pack_exposed_ms": 1e3 * exposed / self.packs if self.packs else 0.0,
        }
