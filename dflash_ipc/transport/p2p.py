"""``nccl`` rings: slots sent point to point with torch.distributed, for consumers on other hosts.

nccl
    The producer allocates its ring once in its own memory (its GPU, or host memory on CPU) and
    hosts a TCPStore on the configured host (a free port). The descriptor carries a
    :class:`~dflash_ipc.control.ring_descriptor.PairRendezvous` part: that address and the device
    type. Each consumer d joins its own two-rank process group there (key prefix ``pair-d``;
    rank 0 the producer, rank 1 the consumer), built straight from the store, so a drafter's own
    data-parallel default group is never touched: ``ProcessGroupNCCL`` when the slots are on a
    GPU, ``ProcessGroupGloo`` in host memory, one code path. Both sides join at start-up (the
    producer in one thread per consumer once the data plane knows them, ``attach_consumers``;
    the consumer in ``open``), and one small tensor carrying the consumer's rank crosses each
    pair, so the first slot pays no connection set-up and a mixed-up pair fails at start.

Per slot (the slot lifecycle of :mod:`dflash_ipc.transport.ring` is unchanged)::

    producer                                     consumer d
    commit: slot event recorded (GPU)
    SlotReady ─────────── ZeroMQ ──────────────▶ held (FIFO per producer)
    hand_over: send used ranges (pair d) ──────▶ copy_out: recv the same ranges into its buffer
                                                 ticket done (recvs completed) ─▶ SlotFree
    slot_returned: wait for the sends ◀─ SlotFree
    the slot is FREE again

A pair's sends and receives match in issue order (NCCL matches by order; gloo by tag, and every
message here has tag 0): the producer sends in its SlotReady order, and a consumer copies out
each producer's slots in the order their SlotReady arrived (``ConsumerDataPlane.held`` is FIFO
and ZeroMQ keeps one sender's messages in order). The used ranges are the slot layout's, with
nearby ranges coalesced (``slots.coalesce``), so a batch of n tokens moves its bytes, not the
slot's capacity.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch

from dflash_ipc.control.ring_descriptor import PairRendezvous, RingDescriptor
from dflash_ipc.platform.devices import DeviceLike, as_device, cuda_device
from dflash_ipc.transport.rendezvous import is_loopback, tcp_store
from dflash_ipc.transport.ring import InPlaceStaging, SlotRingBase, describe, layout_from_descriptor
from dflash_ipc.transport.slots import SlotLayout, coalesce

log = logging.getLogger(__name__)

PRODUCER, CONSUMER = 0, 1
# Seconds a pair may take to meet (both processes are up and handshaking), and a send or receive
# may take to complete before the process gives up with an error naming the pair.
PAIR_TIMEOUT_S = 300.0
_POLL_S = 50e-6


def pair_prefix(consumer: int) -> str:
    return f"pair-{consumer}"


def _gloo_device(host: str, *, bind: bool):
    """Which address gloo listens on: the rendezvous host itself on loopback or for the side that
    was told its address (the producer); else ``GLOO_SOCKET_IFNAME`` or the hostname's address."""
    from torch.distributed import ProcessGroupGloo

    if is_loopback(host):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1" if host == "localhost" else host)
    if bind:
        return ProcessGroupGloo.create_device(hostname=host)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    return ProcessGroupGloo.create_device(interface=ifname.split(",")[0]) if ifname else ProcessGroupGloo.create_default_device()


def join_pair(store, consumer: int, rank: int, device: torch.device, host: str, timeout_s: float):
    """This side's two-rank group for the pair (producer, ``consumer``), built from ``store``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(pair_prefix(consumer), store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("transport.backend = nccl with slots on a GPU needs a torch built with NCCL")
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, 2, options)
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._devices = [_gloo_device(host, bind=rank == PRODUCER)]
    options._timeout = timeout
    return ProcessGroupGloo(prefixed, rank, 2, options)


def wait_works(works: list, what: Callable[[], str], timeout_s: float, device: torch.device) -> None:
    """Block on the host until every work completed (NCCL's ``wait`` only orders streams), then
    surface a failed one's error (``wait`` raises it)."""
    if device.type == "cuda":
        deadline = time.monotonic() + timeout_s
        while not all(w.is_completed() for w in works):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what()} did not complete within {timeout_s:g} s")
            time.sleep(_POLL_S)
    for w in works:
        w.wait()


def close_group(group) -> None:
    """Release a pair's group without waiting on a peer that may be gone (NCCL: abort)."""
    abort = getattr(group, "abort", None)
    if abort is not None and type(group).__name__ == "ProcessGroupNCCL":
        try:
            abort()
        except Exception as e:  # teardown is best effort
            log.warning("aborting a pair's NCCL group failed: %s", e)


class RecvTicket:
    """The receives of one slot: done when all completed (their errors surface here)."""

    def __init__(self, works: list, device: torch.device, slot: int, timeout_s: float):
        self._works = works
        self._device = device
        self._slot = slot
        self._timeout_s = timeout_s
        self._done = False

    def done(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._works):
            self.wait()
        return self._done

    def wait(self) -> None:
        if not self._done:
            wait_works(self._works, lambda: f"receiving slot {self._slot}", self._timeout_s, self._device)
            self._done = True

    def stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order later work on ``stream`` (default: the current one) after the receives, without
        waiting on the host (an NCCL work's ``wait`` does exactly that)."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for w in self._works:
                w.wait()


class P2PProducerRing(InPlaceStaging, SlotRingBase):
    backend = "nccl"

    def __init__(
        self,
        layout: SlotLayout,
        num_slots: int,
        run_id: str,
        producer_rank: int,
        device: torch.device,
        host: str = "127.0.0.1",
        timeout_s: float = PAIR_TIMEOUT_S,
    ):
        super().__init__(layout, num_slots)
        self.device = cuda_device(device) if device.type == "cuda" else torch.device("cpu")
        self._run_id = str(run_id)
        self._rank = int(producer_rank)
        self.host = host
        self.timeout_s = float(timeout_s)
        self._store = tcp_store(host, 0, True, timedelta(seconds=timeout_s), bind_only=True)
        self.port = int(self._store.port)
        self._buffer = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._events = [torch.cuda.Event() for _ in range(self.num_slots)] if self.device.type == "cuda" else []
        self._pairs: list[Future] = []
        self._sends: dict[int, list] = {}

    def commit(self, index: int, n_tokens: int, n_seqs: int, stream: torch.cuda.Stream | None = None) -> None:
        """On a GPU, record the slot's event on the stream that wrote it; the send waits on it."""
        self._check_index(index)
        self.layout.check_counts(n_tokens, n_seqs)
        if self.device.type == "cuda":
            self._events[index].record(stream if stream is not None else torch.cuda.current_stream(self.device))

    def attach_consumers(self, num_consumers: int) -> None:
        """Meet each consumer in its own group, one thread per pair (a consumer joins while it
        opens the ring; the first send to it waits for its group)."""
        if self._pairs:
            raise RuntimeError("nccl ring: consumers are already attached")
        for consumer in range(num_consumers):
            fut: Future = Future()
            threading.Thread(target=self._connect, args=(consumer, fut), name=f"nccl-pair-{consumer}", daemon=True).start()
            self._pairs.append(fut)

    def _connect(self, consumer: int, fut: Future) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            group = join_pair(self._store, consumer, PRODUCER, self.device, self.host, self.timeout_s)
            hello = torch.full((1,), consumer, dtype=torch.int64, device=self.device)
            wait_works([group.send([hello], CONSUMER, 0)], lambda: f"meeting consumer {consumer}", self.timeout_s, self.device)
            fut.set_result(group)
        except BaseException as e:
            fut.set_exception(e)

    def _group(self, consumer: int):
        if not 0 <= consumer < len(self._pairs):
            raise ValueError(f"nccl ring: consumer {consumer} is not attached ({len(self._pairs)} are)")
        try:
            return self._pairs[consumer].result(timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"nccl ring of producer {self._rank}: consumer {consumer} did not join at {self.host}:{self.port} in {self.timeout_s:g} s"
            ) from None

    def hand_over(self, index: int, consumer: int, n_tokens: int, n_seqs: int) -> None:
        """Send the used ranges of slot ``index`` to ``consumer`` (asynchronous)."""
        if self._buffer is None:
            raise RuntimeError("nccl ring is closed")
        group = self._group(consumer)
        slot = self.slot(index)
        ranges = coalesce(self.layout.used_ranges(n_tokens, n_seqs))
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.current_stream(self.device).wait_event(self._events[index])
                works = [group.send([slot[o : o + n]], CONSUMER, 0) for o, n in ranges]
        else:
            works = [group.send([slot[o : o + n]], CONSUMER, 0) for o, n in ranges]
        self._sends[index] = works

    def slot_returned(self, index: int) -> None:
        """The consumer received the slot; wait until our sends let go of it before it is refilled."""
        works = self._sends.pop(index, [])
        if works:
            wait_works(works, lambda: f"sending slot {index}", self.timeout_s, self.device)

    def descriptor(self) -> RingDescriptor:
        return describe(self, self._run_id, self._rank, pair=PairRendezvous(host=self.host, port=self.port, device_type=self.device.type))

    def close(self) -> None:
        """Drop the pairs' groups, the store and the ring (idempotent)."""
        if self._buffer is None:
            return
        for fut in self._pairs:
            if fut.done() and fut.exception() is None:
                close_group(fut.result())
        self._pairs = []
        self._sends = {}
        self._events = []
        self._store = None
        self._buffer = None


class P2PConsumerRing(SlotRingBase):
    """A consumer's side: no ring memory of its own; copy_out receives into the caller's buffer."""

    backend = "nccl"

    def __init__(self, descriptor: RingDescriptor, consumer_rank: int, local_device: torch.device, timeout_s: float = PAIR_TIMEOUT_S):
        layout, num_slots = layout_from_descriptor(descriptor)
        super().__init__(layout, num_slots)
        pair = descriptor.pair
        if pair is None:
            raise ValueError("an nccl ring descriptor needs its pair part")
        local_device = torch.device(local_device)
        if (local_device.type == "cuda") != (pair.device_type == "cuda"):
            raise ValueError(
                f"nccl ring of producer {descriptor.producer_rank} holds slots on {pair.device_type}, this consumer is on {local_device}"
            )
        self.device = cuda_device(local_device) if local_device.type == "cuda" else torch.device("cpu")
        self.consumer_rank = int(consumer_rank)
        self.timeout_s = float(timeout_s)
        self.producer_pid = descriptor.producer_pid
        t0 = time.perf_counter()
        self._store = tcp_store(pair.host, pair.port, False, timedelta(seconds=timeout_s))
        self._group = join_pair(self._store, self.consumer_rank, CONSUMER, self.device, pair.host, timeout_s)
        try:
            hello = torch.full((1,), -1, dtype=torch.int64, device=self.device)
            wait_works([self._group.recv([hello], PRODUCER, 0)], lambda: "meeting the producer", timeout_s, self.device)
            if int(hello.item()) != self.consumer_rank:
                raise RuntimeError(
                    f"nccl ring pair mix-up: producer {descriptor.producer_rank} greeted consumer {int(hello.item())}, "
                    f"this is {self.consumer_rank}"
                )
        except BaseException:
            self.close()
            raise
        self.open_seconds = time.perf_counter() - t0

    def slot(self, index: int) -> torch.Tensor:
        raise RuntimeError("an nccl consumer ring has no slot memory: copy_out receives into your buffer")

    @property
    def closed(self) -> bool:
        return self._group is None

    def copy_out(self, index: int, n_tokens: int, n_seqs: int, dst: torch.Tensor) -> RecvTicket:
        """Receive the used ranges of slot ``index`` straight into ``dst`` (flat uint8, slot offsets)."""
        if self._group is None:
            raise RuntimeError("nccl ring is closed")
        self._check_index(index)
        self.layout.check_counts(n_tokens, n_seqs)
        if dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() < self.slot_bytes or dst.device != self.device:
            raise ValueError(
                f"copy_out needs a flat uint8 buffer of >= {self.slot_bytes} bytes on {self.device}; "
                f"got {dst.dtype} {tuple(dst.shape)} on {dst.device}"
            )
        ranges = coalesce(self.layout.used_ranges(n_tokens, n_seqs))
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                works = [self._group.recv([dst[o : o + n]], PRODUCER, 0) for o, n in ranges]
        else:
            works = [self._group.recv([dst[o : o + n]], PRODUCER, 0) for o, n in ranges]
        return RecvTicket(works, self.device, index, self.timeout_s)

    def close(self) -> None:
        if getattr(self, "_group", None) is not None:
            close_group(self._group)
        self._group = None
        self._store = None


def create_producer(
    layout: SlotLayout, num_slots: int, run_id: str, producer_rank: int, device: DeviceLike, host: str, timeout_s: float
) -> P2PProducerRing:
    """The factory's entry point (``transport/factory.py``): consumers meet the producer at ``host`` within ``timeout_s``."""
    return P2PProducerRing(layout, num_slots, run_id, producer_rank, as_device(device), host, timeout_s)


def open_consumer(descriptor: RingDescriptor, device: DeviceLike, consumer_rank: int | None, timeout_s: float) -> P2PConsumerRing:
    if consumer_rank is None:
        raise ValueError("opening an nccl ring needs the consumer's rank")
    return P2PConsumerRing(descriptor, consumer_rank, as_device(device), timeout_s)
