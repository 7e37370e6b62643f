"""run.deterministic's data plane: the plan's deal, and drafters that train it in order whatever the timing.

Two producer cores and two consumer cores over real cpu-shm rings; every message goes through
``protocol.encode``/``decode``. Message delivery is shuffled by a seeded RNG (standing in for the
scheduler), and the consumers step in lockstep as the drafters do (a step when every consumer has
its next batch or will get none): each consumer must train the deal's batches in ordinal order,
the same under every interleaving, within its credits and without a deadlock on small rings.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import RejectCounter, SlotReady
from dflash_ipc.control.router import deal_by_plan
from dflash_ipc.transport.dataplane import ConsumerDataPlane, ProducerDataPlane
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

LAYOUT = SlotLayout(num_planes=1, hidden_size=4, max_tokens=8, max_seqs=2, plane_dtype="float32")


def wire(msg: protocol.Message) -> protocol.Message:
    return protocol.decode(protocol.encode(msg))


def test_deal_covers_every_batch_once_round_robin_in_plan_order():
    sizes, shards, consumers = [7, 5], 2, 3
    deals = [deal_by_plan(sizes, shards, range(shards), s, lambda b: False, consumers) for s in range(shards)]
    merged = {**deals[0], **deals[1]}
    assert len(merged) == 12 and sum(len(d) for d in deals) == 12
    in_plan_order = sorted(merged, key=lambda b: (b[0], b[2] * shards + b[1]))
    assert [merged[b] for b in in_plan_order] == [(n % consumers, n // consumers) for n in range(12)]
    assert all(b[1] == 0 for b in deals[0]) and all(b[1] == 1 for b in deals[1])


def test_deal_leaves_out_consumed_batches_and_other_nodes_shards():
    consumed = {(0, 0, 0), (0, 1, 1)}
    deal = deal_by_plan([8], 4, range(2, 4), 2, consumed.__contains__, 2)  # node 1 of 2: shards 2 and 3
    assert deal == {(0, 2, 0): (0, 0), (0, 2, 1): (0, 1)}  # shard 3's batches take drafter 1's turns
    resumed = deal_by_plan([8], 2, range(2), 0, consumed.__contains__, 2)
    assert resumed == {(0, 0, 1): (1, 0), (0, 0, 2): (0, 1), (0, 0, 3): (0, 2)}  # plan indices 2, 4, 6 of 1..7
    with pytest.raises(ValueError):
        deal_by_plan([1], 1, range(1), 0, lambda b: False, 0)


class DealWiring:
    """Two producers (shards 0 and 1 of one epoch), ``nc`` consumers, deterministic planes."""

    def __init__(self, n_batches: int, ring_slots: int, max_outstanding: int, prefetch: int, nc: int = 2):
        self.run_id = new_run_id()
        self.nc = nc
        self.rings = [create_producer_ring("cpu-shm", LAYOUT, ring_slots, run_id=self.run_id, producer_rank=p) for p in range(2)]
        self.deal = {}
        for p in range(2):
            self.deal.update(deal_by_plan([n_batches], 2, range(2), p, lambda b: False, nc))
        self.schedule = [collections.deque(sorted(b for b in self.deal if b[1] == p)) for p in range(2)]
        self.inbox: list[collections.deque] = [collections.deque() for _ in range(nc + 2)]  # consumers, then producers 0, 1
        self.rejects = [RejectCounter(f"peer-{i}") for i in range(nc + 2)]
        self.producers = [
            ProducerDataPlane(p, self.rings[p], nc, max_outstanding, self._sender(lambda c: c), self.rejects[nc + p], deterministic=True)
            for p in range(2)
        ]
        descs = [
            wire(protocol.Hello(role="target", rank=p, pid=1, device="cpu", ring=r.descriptor())).ring for p, r in enumerate(self.rings)
        ]
        self.consumers = [
            ConsumerDataPlane(
                c,
                [open_consumer_ring(d) for d in descs],
                [torch.empty(LAYOUT.slot_bytes, dtype=torch.uint8) for _ in range(prefetch + 1)],
                self._sender(lambda p: nc + p),
                self.rejects[c],
                deterministic=True,
            )
            for c in range(nc)
        ]
        self.trained: list[list[tuple[int, ...]]] = [[] for _ in range(nc)]
        self.steps = 0

    def _sender(self, box):
        return lambda peer, msg: self.inbox[box(peer)].append(wire(msg))

    def close(self) -> None:
        for c in self.consumers:
            for r in c.rings:
                r.close()
        for r in self.rings:
            r.close()
        sweep_run_shm(self.run_id)

    def produce(self, p: int) -> None:
        prod = self.producers[p]
        if self.schedule[p] and (slot := prod.acquire()) is not None:
            bid = self.schedule[p].popleft()
            v = self.rings[p].staging_views(slot, 2, 1)
            v.token_ids.copy_(torch.tensor([bid[2], p]))
            v.seq_lens.fill_(2)
            self.rings[p].commit(slot, 2, 1)
            prod.enqueue(slot, list(bid), 0, 2, 1, {}, 0, self.deal[bid])
        prod.dispatch()
        if not self.schedule[p] and prod.waiting == 0 and not prod._end_requested:
            prod.end_of_data()

    def deliver_one(self, box: int) -> None:
        msg = self.inbox[box].popleft()
        if box < self.nc:
            self.consumers[box].handle(msg, msg.producer)
        else:
            self.producers[box - self.nc].handle(msg, msg.consumer)

    def lockstep(self, taken: list) -> None:
        """A step once every consumer has its batch or will get none (the drafters' all-reduce)."""
        for c, cons in enumerate(self.consumers):
            cons.pump()
            if taken[c] is None:
                taken[c] = cons.take()
        done = [t is None and cons.drained() for t, cons in zip(taken, self.consumers, strict=True)]
        if all(t is not None or d for t, d in zip(taken, done, strict=True)) and not all(done):
            for c, t in enumerate(taken):
                if t is not None:
                    assert list(t.views.token_ids) == [t.msg.batch_id[2], t.msg.batch_id[1]]  # the slot's bytes
                    self.trained[c].append(tuple(t.msg.batch_id))
                    self.consumers[c].release(t)
                    taken[c] = None
            self.steps += 1

    def run(self, rng: random.Random) -> None:
        taken: list = [None] * self.nc
        for _ in range(20000):
            if all(c.drained() for c in self.consumers) and all(t is None for t in taken):
                return
            what = rng.randrange(6)
            if what < 2:
                self.produce(what)
            elif what < 4:
                boxes = [b for b in range(self.nc + 2) if self.inbox[b]]
                if boxes:
                    self.deliver_one(rng.choice(boxes))
            else:
                self.lockstep(taken)
            for p in self.producers:  # a pair's credit bounds what a consumer holds of a producer's slots
                assert all(len(p.table.held_by(c)) <= p.router.max_outstanding for c in range(self.nc))
        raise AssertionError(f"no progress: trained {[len(t) for t in self.trained]} of {len(self.deal)}")


@pytest.mark.parametrize("nc,ring_slots,max_outstanding,prefetch", [(2, 2, 1, 0), (3, 2, 1, 0), (1, 4, 3, 1), (3, 3, 1, 2)])
def test_every_interleaving_trains_the_deal_in_order(nc, ring_slots, max_outstanding, prefetch):
    n_batches = 23
    runs = []
    for trial in range(6):
        w = DealWiring(n_batches, ring_slots, max_outstanding, prefetch, nc)
        try:
            w.run(random.Random(trial))
            runs.append(w.trained)
            for c in range(nc):
                assert [w.deal[b] for b in w.trained[c]] == [(c, k) for k in range(len(w.trained[c]))]
            assert sum(len(t) for t in w.trained) == n_batches
            assert all(r.total == 0 for r in w.rejects)
        finally:
            w.close()
    assert all(r == runs[0] for r in runs)


def test_a_training_slot_without_a_fresh_ordinal_is_refused():
    w = DealWiring(4, 2, 1, 0)
    try:
        cons = w.consumers[0]
        base = dict(producer=0, slot=0, batch_id=[0, 0, 0], bucket=0, n_tokens=2, n_seqs=1)
        cons.handle(wire(SlotReady(**base, seq=0, meta={})), 0)
        cons.handle(wire(SlotReady(**base, seq=0, meta={"order": "1"})), 0)
        cons.handle(wire(SlotReady(**base, seq=0, meta={"order": 2})), 0)
        cons.handle(wire(SlotReady(**{**base, "slot": 1}, seq=1, meta={"order": 2})), 0)  # a second ordinal 2
        assert cons.rejects.by_kind == {"bad_order": 3}
        assert [m.meta["order"] for m, _ in cons.held] == [2]
    finally:
        w.close()
