"""Producer and consumer data-plane cores wired in one process through real cpu-shm rings.

Every message between the cores goes through ``protocol.encode`` and ``protocol.decode``,
exactly as it would over a socket; the slot contents travel through POSIX shared memory.
"""

from __future__ import annotations

import collections

import pytest
import torch

from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import (
    EndOfData,
    Hello,
    Load,
    RejectCounter,
    SlotFree,
    SlotReady,
)
from dflash_ipc.control.ring_descriptor import RingDescriptor
from dflash_ipc.transport.dataplane import IN_PLACE, ConsumerDataPlane, ProducerDataPlane, reads_in_place
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

LAYOUT = SlotLayout(num_planes=2, hidden_size=8, max_tokens=24, max_seqs=4, plane_dtype="float32")


def wire(msg: protocol.Message) -> protocol.Message:
    return protocol.decode(protocol.encode(msg))


def batch_shape(index: int) -> tuple[int, int]:
    n = 1 + (index * 7) % LAYOUT.max_tokens
    s = 1 + index % min(n, LAYOUT.max_seqs)
    return n, s


def expected(index: int) -> dict[str, torch.Tensor]:
    n, s = batch_shape(index)
    k, h = LAYOUT.num_planes, LAYOUT.hidden_size
    lens = [n // s] * (s - 1) + [n - (n // s) * (s - 1)]
    return {
        "planes": (torch.arange(k * n * h, dtype=torch.float32) + index * 3).view(k, n, h),
        "token_ids": torch.arange(n, dtype=torch.int64) + index * 1000,
        "loss_mask": ((torch.arange(n) + index) % 2).to(torch.uint8),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }


class Wiring:
    """One producer core, C consumer cores, FIFO 'sockets' carrying decoded wire frames."""

    def __init__(self, num_consumers: int = 2, ring_slots: int = 4, max_outstanding: int = 2, prefetch: int = 1, **consumer_kw):
        self.run_id = new_run_id()
        self.max_outstanding = max_outstanding
        self.ring = create_producer_ring("cpu-shm", LAYOUT, ring_slots, run_id=self.run_id, producer_rank=0)
        self.to_consumer: list[collections.deque] = [collections.deque() for _ in range(num_consumers)]
        self.to_producer: collections.deque = collections.deque()
        self.stream_log: list[list[str]] = [[] for _ in range(num_consumers)]  # what each consumer received, in order
        self.prod_rejects = RejectCounter("producer-0")
        self.producer = ProducerDataPlane(0, self.ring, num_consumers, max_outstanding, self._to_consumer, self.prod_rejects)
        # the descriptor crosses the wire in a Hello and comes back decoded, as in the handshake
        hello = wire(Hello(role="target", rank=0, pid=1, device="cpu", ring=self.ring.descriptor()))
        desc = hello.ring
        assert isinstance(desc, RingDescriptor) and desc == self.ring.descriptor()
        self.cons_rejects = [RejectCounter(f"consumer-{c}") for c in range(num_consumers)]
        self.consumers = [
            ConsumerDataPlane(
                c,
                [open_consumer_ring(desc)],
                [torch.empty(LAYOUT.slot_bytes, dtype=torch.uint8) for _ in range(prefetch + 1)],
                self._to_producer,
                self.cons_rejects[c],
                **consumer_kw,
            )
            for c in range(num_consumers)
        ]
        self.next_index = 0
        self.seen: collections.Counter = collections.Counter()
        self.taken_by = [0] * num_consumers
        self.max_outstanding_seen = [0] * num_consumers

    def _to_consumer(self, c: int, msg) -> None:
        self.to_consumer[c].append(wire(msg))

    def _to_producer(self, p: int, msg) -> None:
        assert p == 0
        self.to_producer.append(wire(msg))

    def close(self) -> None:
        for c in self.consumers:
            for r in c.rings:
                r.close()
        self.ring.close()
        sweep_run_shm(self.run_id)

    # -- steps
    def produce(self, limit: int) -> bool:
        if self.next_index >= limit:
            return False
        slot = self.producer.acquire()
        if slot is None:
            return False
        i = self.next_index
        n, s = batch_shape(i)
        v = self.ring.staging_views(slot, n, s)
        e = expected(i)
        for name in ("planes", "token_ids", "loss_mask", "seq_lens"):
            getattr(v, name).copy_(e[name])
        self.ring.commit(slot, n, s)
        self.producer.enqueue(slot, [0, 0, i], 0, n, s, {"i": i})
        self.next_index += 1
        return True

    def deliver(self) -> None:
        while any(self.to_consumer) or self.to_producer:
            for c, q in enumerate(self.to_consumer):
                while q:
                    msg = q.popleft()
                    self.stream_log[c].append(type(msg).__name__)
                    self.consumers[c].handle(msg)
                    self.check_bounds()
            while self.to_producer:
                self.producer.handle(self.to_producer.popleft())

    def check_bounds(self) -> None:
        for c, cons in enumerate(self.consumers):
            out = len(cons.held) + len(cons.copying) + len(cons.ready) + cons.in_use
            assert out == cons.outstanding
            assert out <= self.max_outstanding, f"consumer {c} holds {out} > credits {self.max_outstanding}"
            self.max_outstanding_seen[c] = max(self.max_outstanding_seen[c], out)
        for c in range(len(self.consumers)):
            assert len(self.producer.table.held_by(c)) <= self.max_outstanding

    def consume(self, c: int) -> int:
        cons = self.consumers[c]
        cons.pump()
        got = 0
        while (b := cons.take()) is not None:
            i = b.msg.batch_id[2]
            assert b.msg.meta == {"i": i}
            e = expected(i)
            assert (b.msg.n_tokens, b.msg.n_seqs) == batch_shape(i)
            for name in ("planes", "token_ids", "loss_mask", "seq_lens"):
                assert torch.equal(getattr(b.views, name), e[name]), (i, name)
            self.seen[i] += 1
            self.taken_by[c] += 1
            cons.release(b)
            cons.pump()
            got += 1
        return got

    def step(self, limit: int, active: tuple[int, ...], burst: bool = False) -> None:
        while self.produce(limit) and burst:  # burst: fill every free slot before routing
            pass
        self.producer.dispatch()
        self.deliver()
        for c in active:
            self.consume(c)
            self.deliver()


@pytest.fixture
def wiring_factory():
    made = []

    def make(**kw) -> Wiring:
        w = Wiring(**kw)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.mark.parametrize("in_place", [False, True], ids=["copy-out", "in-place"])
def test_many_batches_flow_and_every_slot_verifies(wiring_factory, in_place):
    w = wiring_factory(num_consumers=2, ring_slots=4, max_outstanding=2, in_place=in_place)
    n_batches = 300
    for _ in range(20 * n_batches):
        if w.next_index >= n_batches and w.producer.waiting == 0:
            break
        w.step(n_batches, active=(0, 1))
    w.producer.end_of_data()
    for _ in range(100):
        if all(c.drained() for c in w.consumers) and w.producer.all_returned():
            break
        w.step(n_batches, active=(0, 1))
    assert all(c.drained() for c in w.consumers)
    assert w.producer.all_returned() and w.producer.table.counts() == {"free": 4, "filling": 0, "ready": 0}
    assert sorted(w.seen) == list(range(n_batches)) and set(w.seen.values()) == {1}  # each exactly once
    assert w.producer.batches_sent == n_batches == w.producer.slot_free_received
    assert all(t > 0 for t in w.taken_by) and sum(w.taken_by) == n_batches
    assert sum(c.slots_done[0] for c in w.consumers) == n_batches
    assert [c.received[0] for c in w.consumers] == w.producer.router.routed_total
    for c in w.consumers:
        assert c.expected_total == c.received  # EndOfData counts what this producer sent to this consumer
        assert w.stream_log[c.rank][-1] == "EndOfData"
    assert w.prod_rejects.total == 0 and all(r.total == 0 for r in w.cons_rejects)
    assert max(w.max_outstanding_seen) <= 2
    assert all((c.bytes_copied == 0) == in_place for c in w.consumers)


def test_consumer_keeps_a_bounded_number_of_handoff_samples(wiring_factory):
    # a run of days hands over millions of slots: the latency samples stop at handoff_samples
    w = wiring_factory(num_consumers=1, ring_slots=4, max_outstanding=2, handoff_samples=25)
    cons = w.consumers[0]
    first = None
    for _ in range(2000):
        if w.next_index >= 200 and w.producer.waiting == 0:
            break
        w.step(200, active=(0,))
        if first is None and cons.received[0] >= 10:
            first = list(cons.handoff_ns)
    assert cons.received[0] == 200
    assert 10 <= len(first) < 25
    assert len(cons.handoff_ns) == 25 and cons.handoff_ns[: len(first)] == first  # the first ones, kept
    assert all(ns >= 0 for ns in cons.handoff_ns)


def test_stalled_consumer_gets_at_most_its_credits(wiring_factory):
    cap = 2
    w = wiring_factory(num_consumers=2, ring_slots=5, max_outstanding=cap)
    n_batches = 60
    for _ in range(20 * n_batches):
        if w.next_index >= n_batches and w.producer.waiting == 0:
            break
        # the producer outpaces the consumers; consumer 1 receives messages but never copies or trains
        w.step(n_batches, active=(0,), burst=True)
        assert w.consumers[1].outstanding <= cap
        assert w.producer.waiting <= 5
    stalled = w.consumers[1]
    assert stalled.received == [cap] and len(stalled.held) == cap and not stalled.ready
    assert w.producer.router.routed_total == [n_batches - cap, cap]
    assert sorted(w.producer.table.held_by(1)) == sorted(m.slot for m, _ in stalled.held)
    assert w.taken_by == [n_batches - cap, 0]
    assert sorted(w.seen) == [i for i in range(n_batches) if i not in {m.batch_id[2] for m, _ in stalled.held}]
    assert w.max_outstanding_seen[1] == cap and w.max_outstanding_seen[0] <= cap
    # the producer cannot finish while the stalled consumer holds its slots...
    w.producer.end_of_data()
    w.deliver()
    assert not w.producer.all_returned()
    # ...and once it wakes up, everything drains and verifies
    for _ in range(50):
        w.step(n_batches, active=(0, 1))
    assert w.producer.all_returned() and all(c.drained() for c in w.consumers)
    assert sorted(w.seen) == list(range(n_batches)) and set(w.seen.values()) == {1}


def test_end_of_data_waits_for_slots_still_queued_for_credit(wiring_factory):
    """EndOfData must follow every SlotReady: a consumer stops once it has it and holds nothing."""
    w = wiring_factory(num_consumers=2, ring_slots=6, max_outstanding=1)
    for _ in range(6):
        assert w.produce(6)
    w.producer.dispatch()  # one per consumer: four slots wait for credit
    assert w.producer.waiting == 4
    w.producer.end_of_data()
    w.deliver()
    assert all("EndOfData" not in log for log in w.stream_log)
    for _ in range(50):
        w.step(6, active=(0, 1))
    assert sorted(w.seen) == list(range(6))
    for log in w.stream_log:
        assert log.count("EndOfData") == 1 and log[-1] == "EndOfData"
        assert log.count("SlotReady") >= 1
    assert w.producer.all_returned() and all(c.drained() for c in w.consumers)
    assert [c.expected_total for c in w.consumers] == [c.received for c in w.consumers]
    assert sum(c.expected_total[0] for c in w.consumers) == 6


def test_bad_messages_are_rejected_and_counted_without_raising(wiring_factory):
    w = wiring_factory(num_consumers=2, ring_slots=4, max_outstanding=2)
    for _ in range(3):
        w.produce(100)
    w.producer.dispatch()
    w.deliver()  # consumers hold their SlotReady
    w.consumers[0].pump()  # consumer 0 copies out one slot and returns it
    frees = [m for m in w.to_producer if isinstance(m, SlotFree)]
    assert len(frees) >= 1
    dup = frees[0]
    w.deliver()
    before = w.producer.table.counts()
    p = w.producer
    p.handle(wire(dup))  # duplicated SlotFree
    p.handle(wire(SlotFree(producer=0, slot=99, consumer=0, outstanding=0, received=1)))  # slot outside the ring
    p.handle(wire(SlotFree(producer=0, slot=3, consumer=0, outstanding=0, received=1)))  # slot never handed out
    p.handle(wire(SlotFree(producer=0, slot=dup.slot, consumer=7, outstanding=0, received=1)))  # no such consumer
    p.handle(wire(SlotFree(producer=3, slot=0, consumer=0, outstanding=0, received=1)))  # not our ring
    p.handle(wire(Load(consumer=9, outstanding=0, received=[0])))
    p.handle(wire(Load(consumer=0, outstanding=0, received=[])))  # no count for us
    p.handle(wire(Hello(role="x", rank=0, pid=1, device="cpu")))  # not a data-plane message
    assert p.rejects.by_kind == {"bad_slot_free": 3, "out_of_range": 2, "wrong_producer": 1, "bad_field_type": 1, "unexpected_type": 1}
    assert p.table.counts() == before  # nothing changed state
    assert p.slot_free_received == len(frees)

    c = w.consumers[1]
    held_before, received_before = len(c.held), list(c.received)
    c.handle(wire(SlotReady(producer=0, slot=4, batch_id=[0, 0, 1], bucket=0, n_tokens=1, n_seqs=1, seq=0)))  # slot == ring size
    c.handle(wire(SlotReady(producer=0, slot=1000, batch_id=[0, 0, 1], bucket=0, n_tokens=1, n_seqs=1, seq=0)))
    c.handle(wire(SlotReady(producer=1, slot=0, batch_id=[0, 0, 1], bucket=0, n_tokens=1, n_seqs=1, seq=0)))  # no such producer
    c.handle(wire(SlotReady(producer=0, slot=0, batch_id=[0, 0, 1], bucket=0, n_tokens=LAYOUT.max_tokens + 1, n_seqs=1, seq=0)))
    c.handle(wire(SlotReady(producer=0, slot=0, batch_id=[0, 0, 1], bucket=0, n_tokens=1, n_seqs=LAYOUT.max_seqs + 1, seq=0)))
    held_msg = c.held[0][0]
    c.handle(wire(held_msg))  # the same slot again while held
    c.handle(wire(EndOfData(producer=5, batches_sent=1)))
    c.handle(wire(SlotFree(producer=0, slot=0, consumer=1, outstanding=0, received=0)))  # wrong direction
    assert c.rejects.by_kind == {"out_of_range": 6, "duplicate_slot_ready": 1, "unexpected_type": 1}
    assert len(c.held) == held_before and c.received == received_before and not any(c.ended)
    assert not w.to_producer or all(not isinstance(m, SlotFree) for m in w.to_producer)

    # rejected frames changed nothing: the run still completes and every batch verifies
    for _ in range(400):
        if w.next_index >= 40 and w.producer.waiting == 0:
            break
        w.step(40, active=(0, 1))
    w.producer.end_of_data()
    for _ in range(50):
        w.step(40, active=(0, 1))
    assert sorted(w.seen) == list(range(40)) and set(w.seen.values()) == {1}
    assert w.producer.all_returned() and all(cc.drained() for cc in w.consumers)
    assert p.rejects.total == 8 and c.rejects.total == 8 and w.cons_rejects[0].total == 0


def test_forged_data_plane_messages_change_nothing_and_are_counted(wiring_factory):
    """Messages that do not fit the state machine, or name another sender than
    the authenticated one, are refused. Before: an EndOfData with any count ended a consumer's
    input (the run 'finished' with nothing trained), a SlotReady with a made-up seq was copied."""
    w = wiring_factory(num_consumers=2, ring_slots=4, max_outstanding=2)
    for _ in range(2):
        w.produce(100)
    w.producer.dispatch()
    w.deliver()
    c = w.consumers[0]
    state = (len(c.held), list(c.received), list(c.ended))
    c.handle(wire(EndOfData(producer=0, batches_sent=0)), sender=0)  # fewer than it received: a forgery or a loss
    c.handle(wire(EndOfData(producer=0, batches_sent=c.received[0])), sender=1)  # a target speaking for another
    nxt = c.received[0]
    c.handle(wire(SlotReady(producer=0, slot=3, batch_id=[0, 0, 9], bucket=0, n_tokens=1, n_seqs=1, seq=nxt + 5)), sender=0)  # gap
    c.handle(wire(SlotReady(producer=0, slot=3, batch_id=[0, 0, 9], bucket=0, n_tokens=1, n_seqs=1, seq=0)), sender=0)  # replayed seq
    assert c.rejects.by_kind == {"end_of_data_mismatch": 1, "wrong_sender": 1, "bad_seq": 2}
    assert (len(c.held), list(c.received), list(c.ended)) == state
    # the producer: a drafter reporting for another, a replayed SlotFree
    p = w.producer
    p.handle(wire(Load(consumer=1, outstanding=0, received=[0])), sender=0)
    p.handle(wire(SlotFree(producer=0, slot=0, consumer=1, outstanding=0, received=1)), sender=0)
    assert p.rejects.by_kind == {"wrong_sender": 2}
    # the genuine stream still completes exactly once, and EndOfData is accepted when it fits
    for _ in range(400):
        if w.next_index >= 20 and w.producer.waiting == 0:
            break
        w.step(20, active=(0, 1))
    w.producer.end_of_data()
    for _ in range(100):
        if all(x.drained() for x in w.consumers) and w.producer.all_returned():
            break
        w.step(20, active=(0, 1))
    assert all(x.drained() for x in w.consumers) and sorted(w.seen) == list(range(20)) and set(w.seen.values()) == {1}
    c.handle(wire(EndOfData(producer=0, batches_sent=c.received[0])), sender=0)  # a second one
    assert c.rejects.by_kind["duplicate_end_of_data"] == 1


def test_a_slot_read_in_place_is_the_rings_memory_and_goes_back_only_after_the_step(wiring_factory):
    w = wiring_factory(num_consumers=1, ring_slots=3, max_outstanding=2, in_place=True)
    cons = w.consumers[0]
    assert cons.reads_in_place == [True] and reads_in_place(cons.rings, "auto") == [False]  # auto: cuda-ipc only
    w.produce(10)
    w.produce(10)
    w.producer.dispatch()
    w.deliver()
    assert cons.pump() == 2 and len(cons.ready) == 2
    b = cons.take()
    assert b.buffer_index == IN_PLACE and b.copy_s == 0.0
    slot = cons.rings[0].slot(b.msg.slot)
    for t in (b.views.planes, b.views.token_ids):  # the step reads the shared slot itself
        assert slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + slot.numel()
    assert torch.equal(b.views.planes, expected(0)["planes"])
    w.deliver()
    assert w.producer.slot_free_received == 0 and b.msg.slot in w.producer.table.held_by(0)  # in use: still ours
    assert cons.outstanding == 2
    cons.release(b)
    w.deliver()
    assert w.producer.slot_free_received == 1 and b.msg.slot not in w.producer.table.held_by(0)
    assert cons.outstanding == 1 and cons.bytes_copied == 0 and cons.free_buffers == [0, 1]


def test_in_place_setting_is_checked():
    with pytest.raises(ValueError, match="in_place must be"):
        reads_in_place([], "yes")


def test_slots_read_in_place_across_real_processes_keep_every_byte():
    # producer and consumer processes over a real shared-memory ring; two slots, each overwritten the
    # instant it returns: a slot handed back before its reads were done would fail the verification
    from dflash_ipc.bench import gpu_ring as bg

    layout = SlotLayout(num_planes=2, hidden_size=64, max_tokens=128, max_seqs=4, plane_dtype="float32")
    sc = bg.scenario(
        "in-place", "cpu-shm", -1, -1, layout, num_slots=2, iters=60, warmup=0, depth=2, sizes="random", verify="full", in_place=True
    )
    (r,) = bg.run_scenarios([sc], timeout=120)
    assert (r["slots"], r["errors"], r["stray_frees"]) == (60, 0, 0)
