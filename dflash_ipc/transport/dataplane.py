"""Pure cores of the data plane: the producer's and the consumer's side of the slot rings.

Neither core touches a socket: each is given a ``send(peer_rank, message)`` callable and is
fed decoded messages through ``handle``. The process shells (``procs/``) wire them to
ZeroMQ; tests can wire two cores together in one process.

Producer side (per target)::

    acquire() ─▶ FILLING ── pack ── enqueue(slot, batch) ─▶ [waiting for credit]
                                   dispatch(): router.choose() ─▶ SlotReady ─▶ READY(d)
    SlotFree(slot, d) ─▶ SlotTable.release ─▶ FREE        Load(d) ─▶ router.on_report

Consumer side (per drafter), copying out (the default)::

    SlotReady ─▶ held ── free local buffer? copy_out ─▶ copying ── ticket done ─▶ SlotFree
                                                                   └─▶ ready ─▶ take() ─▶ in use
    release(buffer) ─▶ buffer free again                      (every change: Load to all)

reading in place (``in_place``: a ring whose slot the consumer's device reads directly, e.g. a
cuda-ipc ring on the drafter's own GPU; ``ConsumerRing.read_in_place``)::

    SlotReady ─▶ held ── read_in_place (the step's stream waits on the producer's event) ─▶ ready
                 ─▶ take() ─▶ in use (the step reads the slot itself: no copy, no local buffer)
    release(batch) ─▶ returning (ticket: an event after the step's last read) ── done ─▶ SlotFree

The slot stays the consumer's until the device has finished every read of it (the ticket, not
merely the host's return from the step), so the producer never overwrites a slot being trained on.

Nothing is taken on trust. ``handle(msg, sender)`` is given the rank of the authenticated
sender (``channels.PeerAuth``; None in the key-less benchmark): a message that names another
consumer/producer than its sender is refused (``wrong_sender``). A SlotReady must carry the next
sequence number of its (producer, consumer) stream (``bad_seq``: replays, gaps) and a slot this
consumer does not hold yet; a producer's EndOfData carries the number of SlotReady it sent *to
this consumer*, and the consumer accepts it only when it received exactly that many
(``end_of_data_mismatch``; ZeroMQ keeps one sender's messages in order, so every SlotReady
arrives before its EndOfData); a second EndOfData is refused. A SlotFree must name a slot in the
READY state held by its sender. Every refusal is counted in the receiver's RejectCounter and
changes no state.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.control.protocol import (
    EndOfData,
    Load,
    Message,
    RejectCounter,
    SlotFree,
    SlotReady,
)
from dflash_ipc.control.router import LeastBusyRouter
from dflash_ipc.transport.ring import (
    ConsumerRing,
    CopyTicket,
    ProducerRing,
    SlotStateError,
    SlotTable,
)
from dflash_ipc.transport.slots import SlotViews

Send = Callable[[int, Message], None]
# Routing decisions kept for inspection (the last ones; a decision is a few bytes).
ROUTING_LOG_LEN = 4096
# SlotReady hand-off latencies kept (the first ones): a run of days must not grow a list per slot.
HANDOFF_SAMPLES = 20000


@dataclass(frozen=True)
class RoutingDecision:
    """One dispatch: the consumer chosen and the router's load estimate of every consumer just
    before choosing (what least-busy routing promises is judged against this view)."""

    consumer: int
    loads: tuple[int, ...]


@dataclass
class _Filled:
    slot: int
    batch_id: list
    bucket: int
    n_tokens: int
    n_seqs: int
    meta: dict
    filled_ns: int
    holdout_pass_batches: int = 0  # > 0: a held-out batch, for consumer 0 only
    route: tuple[int, int] | None = None  # run.deterministic: (consumer, ordinal) from the deal


class ProducerDataPlane:
    """``deterministic`` (run.deterministic): every training batch goes to the consumer its
    ``route`` names (``control.router.deal_by_plan``), first in first out, when that consumer holds
    fewer than ``max_outstanding`` of this producer's slots; its ordinal travels as ``meta["order"]``."""

    def __init__(
        self,
        rank: int,
        ring: ProducerRing,
        num_consumers: int,
        max_outstanding: int,
        send: Send,
        rejects: RejectCounter,
        deterministic: bool = False,
    ):
        self.rank = rank
        self.deterministic = deterministic
        self.ring = ring
        ring.attach_consumers(num_consumers)
        self.table = SlotTable(ring.num_slots)
        self.router = LeastBusyRouter(num_consumers, max_outstanding)
        self._send = send
        self.rejects = rejects
        self._waiting: collections.deque[_Filled] = collections.deque()
        self.seq = [0] * num_consumers
        self.consumer_copying = [0] * num_consumers
        self.batches_sent = 0
        self.slot_free_received = 0
        self._end_requested = False
        self._end_sent = False
        self.routing_log: collections.deque[RoutingDecision] = collections.deque(maxlen=ROUTING_LOG_LEN)

    # -- slots
    def acquire(self) -> int | None:
        return self.table.acquire()

    def enqueue(
        self,
        slot: int,
        batch_id: list,
        bucket: int,
        n_tokens: int,
        n_seqs: int,
        meta: dict | None = None,
        holdout_pass_batches: int = 0,
        route: tuple[int, int] | None = None,
    ) -> None:
        """A slot is filled (packing completed): route it as soon as a drafter has credit.

        ``holdout_pass_batches`` > 0 marks a held-out batch: it goes to consumer 0 (the drafter that
        writes metrics) and to no other, so it never meets another rank's collective."""
        if self.deterministic and not holdout_pass_batches:
            if route is None or not 0 <= route[0] < self.router.num_consumers:
                raise ValueError(f"batch {batch_id}: run.deterministic needs its drafter from the deal (got {route})")
            meta = {**(meta or {}), "order": int(route[1])}
        filled = _Filled(slot, list(batch_id), bucket, n_tokens, n_seqs, meta or {}, time.monotonic_ns(), holdout_pass_batches, route)
        self._waiting.append(filled)

    def _pair_credit(self, consumer: int) -> bool:
        return self.router.alive[consumer] and len(self.table.held_by(consumer)) < self.router.max_outstanding

    def _next_consumer(self) -> int | None:
        head = self._waiting[0]
        if self.deterministic:
            consumer = 0 if head.holdout_pass_batches else head.route[0]
            return consumer if self._pair_credit(consumer) else None
        if head.holdout_pass_batches:
            return 0 if self.router.has_credit(0) else None
        return self.router.choose()

    def dispatch(self) -> int:
        sent = 0
        while self._waiting:
            loads = tuple(self.router.inflight())
            consumer = self._next_consumer()
            if consumer is None:
                break
            self.routing_log.append(RoutingDecision(consumer, loads))
            f = self._waiting.popleft()
            self.table.publish(f.slot, consumer)
            msg = SlotReady(
                producer=self.rank,
                slot=f.slot,
                batch_id=f.batch_id,
                bucket=f.bucket,
                n_tokens=f.n_tokens,
                n_seqs=f.n_seqs,
                seq=self.seq[consumer],
                sent_ns=time.monotonic_ns(),
                meta=f.meta,
                holdout=f.holdout_pass_batches > 0,
                holdout_pass_batches=f.holdout_pass_batches,
            )
            self.seq[consumer] += 1
            self.router.on_sent(consumer)
            self._send(consumer, msg)
            # After SlotReady: a ring that sends the bytes (nccl) must not make its consumer wait for them.
            self.ring.hand_over(f.slot, consumer, f.n_tokens, f.n_seqs)
            self.batches_sent += 1
            sent += 1
        self._maybe_send_end()
        return sent

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def handle(self, msg: Message, sender: int | None = None) -> None:
        if isinstance(msg, (SlotFree, Load)) and sender is not None and msg.consumer != sender:
            self.rejects.reject("wrong_sender", f"{type(msg).__name__} for consumer {msg.consumer} sent by drafter-{sender}")
            return
        if isinstance(msg, SlotFree):
            if msg.producer != self.rank:
                self.rejects.reject("wrong_producer", f"slot_free for producer {msg.producer} at {self.rank}")
                return
            if msg.consumer >= self.router.num_consumers:
                self.rejects.reject("out_of_range", f"slot_free from consumer {msg.consumer}")
                return
            try:
                self.table.release(msg.slot, msg.consumer)
            except SlotStateError as e:
                self.rejects.reject("bad_slot_free", str(e))
                return
            self.ring.slot_returned(msg.slot)
            self.slot_free_received += 1
            self.router.on_report(msg.consumer, msg.outstanding, msg.received)
        elif isinstance(msg, Load):
            if msg.consumer >= self.router.num_consumers:
                self.rejects.reject("out_of_range", f"load from consumer {msg.consumer}")
                return
            received = msg.received[self.rank] if self.rank < len(msg.received) else None
            if not isinstance(received, int) or received < 0:
                self.rejects.reject("bad_field_type", f"load.received = {msg.received!r}")
                return
            self.router.on_report(msg.consumer, msg.outstanding, received)
        else:
            self.rejects.reject("unexpected_type", f"{type(msg).__name__} at a producer")

    def end_of_data(self) -> None:
        """No more slots will be enqueued. EndOfData goes out once every filled slot is routed.

        A consumer stops once every producer sent EndOfData and it holds nothing, so a
        SlotReady sent after EndOfData may never be returned: with slots still waiting for
        credit, EndOfData is deferred until ``dispatch()`` has routed the last of them.
        """
        self._end_requested = True
        self._maybe_send_end()

    def _maybe_send_end(self) -> None:
        if not self._end_requested or self._end_sent or self._waiting:
            return
        self._end_sent = True
        for c in range(self.router.num_consumers):
            self._send(c, EndOfData(producer=self.rank, batches_sent=self.seq[c]))

    def all_returned(self) -> bool:
        return not self._waiting and self.table.counts()["ready"] == 0

    def stats(self) -> dict:
        counts = self.table.counts()
        return {
            "slots": {
                "free": counts["free"],
                "filling": counts["filling"] - len(self._waiting),
                "queued": len(self._waiting),
                "ready": counts["ready"],
            },
            "inflight_per_drafter": [len(self.table.held_by(c)) for c in range(self.router.num_consumers)],
            "routed_per_drafter": list(self.router.routed_total),
            "batches_sent": self.batches_sent,
        }


#: ``ReceivedBatch.buffer_index`` of a batch read in place: the ring's slot, no local buffer
IN_PLACE = -1


@dataclass
class ReceivedBatch:
    msg: SlotReady
    buffer_index: int  # IN_PLACE: the views are the slot itself
    views: SlotViews
    received_ns: int
    copied_ns: int
    copy_s: float = 0.0


@dataclass
class _Copying:
    msg: SlotReady
    buffer_index: int
    ticket: CopyTicket
    started: float
    received_ns: int


def reads_in_place(rings: list[ConsumerRing], setting: bool | str) -> list[bool]:
    """Per ring, whether its slots are read in place (``transport.drafter_in_place``): "auto" where the ring can
    and its backend reads in place by default (cuda-ipc rings on the consumer's own GPU), True for every ring that
    can (a cpu-shm ring with a CPU consumer too), False never."""
    if setting not in (True, False, "auto"):
        raise ValueError(f"in_place must be true, false or 'auto', got {setting!r}")
    can = [bool(getattr(r, "can_read_in_place", False)) for r in rings]
    if setting == "auto":
        return [c and BACKENDS[r.backend].in_place_by_default for c, r in zip(can, rings)]
    return [c and bool(setting) for c in can]


def copy_buffers(rings: list[ConsumerRing], in_place: bool | str, prefetch: int, device: torch.device) -> list[torch.Tensor]:
    """The slot-sized buffers a consumer copies slots into: ``prefetch`` + 1 (the batch in use and those ready
    behind it), none when every ring is read in place (``in_place``: ``transport.drafter_in_place``)."""
    if all(reads_in_place(rings, in_place)):
        return []
    slot_bytes = max(r.layout.slot_bytes for r in rings)
    return [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(prefetch + 1)]


class ConsumerDataPlane:
    """A drafter's side: hold slots, copy out into local buffers and return slots at once, or (``in_place``,
    rings that can) hand the slot itself to the step and return it once the step's reads are done.

    ``deterministic`` (run.deterministic): training batches are copied out, and so taken, in the
    order of their ``meta["order"]`` (0, 1, 2, ... from the deal), whatever order they arrived
    in; a producer's slots are still copied in the order they arrived (``transport.p2p`` matches
    sends to receives by order), and held-out batches go whenever a buffer is free. A training
    SlotReady without a fresh ordinal is refused (``bad_order``). A slot read in place waits, in this
    mode, until no copy is in flight, so batches still become ready in their order."""

    def __init__(
        self,
        rank: int,
        rings: list[ConsumerRing],
        buffers: list[torch.Tensor],
        send: Send,
        rejects: RejectCounter,
        handoff_samples: int = HANDOFF_SAMPLES,
        in_place: bool | str = False,
        deterministic: bool = False,
    ):
        self.rank = rank
        self.deterministic = deterministic
        self.next_order = 0  # deterministic: the ordinal of the next training batch to copy out
        self._held_orders: set[int] = set()
        self.rings = rings
        self.buffers = buffers
        self._send = send
        self.rejects = rejects
        self.num_producers = len(rings)
        self.held: collections.deque[tuple[SlotReady, int]] = collections.deque()
        self.copying: list[_Copying] = []
        self.ready: collections.deque[ReceivedBatch] = collections.deque()
        self.free_buffers = list(range(len(buffers)))
        self.in_use = 0
        self.received = [0] * self.num_producers
        self.ended = [False] * self.num_producers
        self.expected_total = [None] * self.num_producers
        self.handoff_ns: list[int] = []  # the first handoff_samples SlotReady send-to-receive latencies
        self.handoff_samples = handoff_samples
        self.copy_seconds = 0.0
        self.bytes_copied = 0
        self.slots_done = [0] * self.num_producers
        self._held_keys: set[tuple[int, int]] = set()
        self.reads_in_place = reads_in_place(rings, in_place)
        self.returning: list[tuple[SlotReady, CopyTicket]] = []  # in-place slots whose reads are still running

    @property
    def outstanding(self) -> int:
        return len(self.held) + len(self.copying) + len(self.ready) + self.in_use + len(self.returning)

    def handle(self, msg: Message, sender: int | None = None) -> None:
        now = time.monotonic_ns()
        if isinstance(msg, (SlotReady, EndOfData)) and sender is not None and msg.producer != sender:
            self.rejects.reject("wrong_sender", f"{type(msg).__name__} for producer {msg.producer} sent by target-{sender}")
            return
        if isinstance(msg, SlotReady):
            if msg.producer >= self.num_producers:
                self.rejects.reject("out_of_range", f"slot_ready from producer {msg.producer} of {self.num_producers}")
                return
            ring = self.rings[msg.producer]
            if msg.slot >= ring.num_slots:
                self.rejects.reject("out_of_range", f"slot_ready slot {msg.slot} >= ring size {ring.num_slots}")
                return
            if msg.n_tokens > ring.layout.max_tokens or msg.n_seqs > ring.layout.max_seqs:
                self.rejects.reject("out_of_range", f"slot_ready n_tokens {msg.n_tokens}/n_seqs {msg.n_seqs} over slot capacity")
                return
            key = (msg.producer, msg.slot)
            if key in self._held_keys:
                self.rejects.reject("duplicate_slot_ready", f"slot {key} already held")
                return
            if self.ended[msg.producer]:
                self.rejects.reject("after_end_of_data", f"slot_ready from producer {msg.producer} after its end_of_data")
                return
            if msg.seq != self.received[msg.producer]:
                self.rejects.reject(
                    "bad_seq", f"slot_ready seq {msg.seq} from producer {msg.producer}, expected {self.received[msg.producer]}"
                )
                return
            if self.deterministic and not msg.holdout:
                order = msg.meta.get("order") if isinstance(msg.meta, dict) else None
                if type(order) is not int or order < self.next_order or order in self._held_orders:
                    self.rejects.reject("bad_order", f"slot_ready order {order!r} from producer {msg.producer}, next {self.next_order}")
                    return
                self._held_orders.add(order)
            self._held_keys.add(key)
            self.received[msg.producer] += 1
            if msg.sent_ns and len(self.handoff_ns) < self.handoff_samples:
                self.handoff_ns.append(now - msg.sent_ns)
            self.held.append((msg, now))
            self._report_load()
        elif isinstance(msg, EndOfData):
            if msg.producer >= self.num_producers:
                self.rejects.reject("out_of_range", f"end_of_data from producer {msg.producer}")
                return
            if self.ended[msg.producer]:
                self.rejects.reject("duplicate_end_of_data", f"end_of_data from producer {msg.producer} again")
                return
            if msg.batches_sent != self.received[msg.producer]:
                self.rejects.reject(
                    "end_of_data_mismatch",
                    f"end_of_data from producer {msg.producer} says {msg.batches_sent} sent here, {self.received[msg.producer]} received",
                )
                return
            self.ended[msg.producer] = True
            self.expected_total[msg.producer] = msg.batches_sent
        else:
            self.rejects.reject("unexpected_type", f"{type(msg).__name__} at a consumer")

    def pump(self) -> int:
        """Hand held slots over (in arrival order, or in plan order when ``deterministic``): read in place
        (ready at once) or copied into a free buffer; finish completed copies; return in-place slots whose
        reads are done. Returns batches made ready."""
        made = 0
        while self.held:
            i = self._next_in_order() if self.deterministic else 0
            if i is None:
                break
            msg, received_ns = self.held[i]
            in_place = self.reads_in_place[msg.producer]
            if not in_place and not self.free_buffers:
                break
            if in_place and self.deterministic and self.copying:
                break  # ready in order: the copies before it first
            del self.held[i]
            if self.deterministic and not msg.holdout:
                self._held_orders.discard(msg.meta["order"])
                self.next_order = msg.meta["order"] + 1
            if in_place:
                self._ready_in_place(msg, received_ns)
                made += 1
            else:
                buf = self.free_buffers.pop(0)
                ticket = self.rings[msg.producer].copy_out(msg.slot, msg.n_tokens, msg.n_seqs, self.buffers[buf])
                self.copying.append(_Copying(msg, buf, ticket, time.perf_counter(), received_ns))
        finished = 0
        still = []
        for c in self.copying:
            if c.ticket.done() and not (self.deterministic and still):  # deterministic: ready in the order copied
                self._finish(c)
                finished += 1
            else:
                still.append(c)
        self.copying = still
        returned = self._return_read_slots()
        if finished or returned:
            self._report_load()
        return finished + made

    def _ready_in_place(self, msg: SlotReady, received_ns: int) -> None:
        """A slot of an in-place ring: its views (the step's stream ordered after the producer's writes), ready."""
        views = self.rings[msg.producer].read_in_place(msg.slot, msg.n_tokens, msg.n_seqs)
        self.slots_done[msg.producer] += 1
        self.ready.append(ReceivedBatch(msg, IN_PLACE, views, received_ns, time.monotonic_ns(), 0.0))

    def _return_read_slots(self) -> int:
        """SlotFree for every in-place slot whose reads have completed on the device."""
        done, still = [], []
        for entry in self.returning:
            (done if entry[1].done() else still).append(entry)
        self.returning = still
        for msg, _ in done:
            self._slot_free(msg)
        return len(done)

    def _next_in_order(self) -> int | None:
        """Deterministic: the index in ``held`` of the next slot to copy out: a producer's oldest slot,
        if it is held-out or the next training ordinal. Once every producer ended, the lowest ordinal
        left (a gap means a producer sent less than the deal: nothing may stay held)."""
        heads: dict[int, int] = {}
        for i, (msg, _) in enumerate(self.held):
            if msg.producer in heads:
                continue
            heads[msg.producer] = i
            if msg.holdout or msg.meta["order"] == self.next_order:
                return i
        if all(self.ended):
            return min(heads.values(), key=lambda i: self.held[i][0].meta.get("order", -1))
        return None

    def wait_for_copy(self) -> None:
        """Block until the oldest copy in flight (else the oldest in-place slot's reads) completed (a GPU
        copy takes well under a millisecond per 256 MiB: sleeping on the sockets instead would idle the link)."""
        if self.copying:
            self.copying[0].ticket.wait()
        elif self.returning:
            self.returning[0][1].wait()

    def _finish(self, c: _Copying) -> None:
        msg = c.msg
        copy_s = time.perf_counter() - c.started
        self.copy_seconds += copy_s
        ring = self.rings[msg.producer]
        self.bytes_copied += sum(n for _, n in ring.layout.used_ranges(msg.n_tokens, msg.n_seqs))
        self.slots_done[msg.producer] += 1
        views = ring.layout.views(self.buffers[c.buffer_index], msg.n_tokens, msg.n_seqs)
        self.ready.append(ReceivedBatch(msg, c.buffer_index, views, c.received_ns, time.monotonic_ns(), copy_s))
        # The slot goes back only now: the copy out of it has completed.
        self._slot_free(msg)

    def _slot_free(self, msg: SlotReady) -> None:
        self._held_keys.discard((msg.producer, msg.slot))
        self._send(
            msg.producer,
            SlotFree(
                producer=msg.producer, slot=msg.slot, consumer=self.rank, outstanding=self.outstanding, received=self.received[msg.producer]
            ),
        )

    def take(self) -> ReceivedBatch | None:
        if not self.ready:
            return None
        self.in_use += 1
        return self.ready.popleft()

    def release(self, batch: ReceivedBatch) -> None:
        """The step is done with ``batch`` (its work enqueued): a local buffer is free again; a slot read in
        place goes back once the device has finished reading it (at once when it already has)."""
        self.in_use -= 1
        if batch.buffer_index == IN_PLACE:
            msg = batch.msg
            self.returning.append((msg, self.rings[msg.producer].reads_done(msg.slot)))
            self._return_read_slots()
        else:
            self.free_buffers.append(batch.buffer_index)
        self._report_load()

    def _report_load(self) -> None:
        msg = Load(consumer=self.rank, outstanding=self.outstanding, received=list(self.received))
        for p in range(self.num_producers):
            self._send(p, msg)

    def all_ended(self) -> bool:
        """Every producer said it is done and everything it sent has been copied out (or read in place and returned)."""
        return all(self.ended) and not self.held and not self.copying and not self.returning

    def drained(self) -> bool:
        return self.all_ended() and not self.ready
