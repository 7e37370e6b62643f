"""Least-busy routing with credits: which drafter gets the next filled slot.

Each producer (target) routes on its own, from fresh reports of the consumers (drafters):

* ``outstanding[d]``: what drafter d last said it holds (slots it has not yet returned plus
  batches copied out and waiting to train), from every producer;
* ``received[d]``: how many of *our* SlotReady messages d had received when it said so.

Our estimate of d's load is ``outstanding[d] + (sent[d] - received[d])``: the report plus
our own sends it could not have seen yet. Slots other producers sent since d's last report
are unknown to us; d reports after every change, so that window is one message wide.

Credits bound every queue: we never send to a drafter whose estimate has reached
``max_outstanding``. When every drafter is full, the slot waits in the producer's ring
(state FILLING → READY only once routed), so nothing ever grows without bound and nothing
is staged in host RAM. Ties break round-robin, starting after the last drafter chosen.

``run.deterministic`` replaces the choice by timing with :func:`deal_by_plan`: the node's
training batches, in plan order, dealt round-robin to its drafters, each batch with its ordinal
on its drafter (the order the drafter trains them in). The producer then sends first-in
first-out, and a pair's credit (slots of this producer a drafter holds) bounds each queue: a
drafter waiting for its next ordinal from one producer is never kept full by another's slots.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence


def deal_by_plan(
    epoch_sizes: Sequence[int],
    num_shards: int,
    node_shards: Collection[int],
    shard: int,
    consumed: Callable[[tuple[int, int, int]], bool],
    num_consumers: int,
) -> dict[tuple[int, int, int], tuple[int, int]]:
    """The deterministic deal of ``shard``'s batches: batch id (epoch, shard, index) -> (drafter, ordinal).

    The node's batches (plan index j of epoch e is shard j % num_shards's batch j // num_shards),
    in (epoch, j) order and without those ``consumed`` (the ledger of a resumed run), go to
    drafters 0, 1, ..., num_consumers - 1, 0, 1, ...; a batch's ordinal is how many the same
    drafter gets before it. Every target of a node computes the same deal from the same plan."""
    if num_consumers < 1:
        raise ValueError("need at least one consumer")
    out: dict[tuple[int, int, int], tuple[int, int]] = {}
    n = 0
    for epoch, size in enumerate(epoch_sizes):
        for j in range(size):
            s = j % num_shards
            bid = (epoch, s, j // num_shards)
            if s not in node_shards or consumed(bid):
                continue
            if s == shard:
                out[bid] = (n % num_consumers, n // num_consumers)
            n += 1
    return out


class LeastBusyRouter:
    def __init__(self, num_consumers: int, max_outstanding: int):
        if num_consumers < 1:
            raise ValueError("need at least one consumer")
        if max_outstanding < 1:
            raise ValueError("max_outstanding must be >= 1")
        self.num_consumers = num_consumers
        self.max_outstanding = max_outstanding
        self.sent = [0] * num_consumers
        self.reported_outstanding = [0] * num_consumers
        self.reported_received = [0] * num_consumers
        self.routed_total = [0] * num_consumers
        self._last = -1
        self.alive = [True] * num_consumers

    def estimate(self, consumer: int) -> int:
        unseen = max(0, self.sent[consumer] - self.reported_received[consumer])
        return self.reported_outstanding[consumer] + unseen

    def on_report(self, consumer: int, outstanding: int, received: int) -> None:
        """A consumer's Load/SlotFree report. Stale (reordered) reports are ignored."""
        if received < self.reported_received[consumer]:
            return
        self.reported_received[consumer] = min(received, self.sent[consumer])
        self.reported_outstanding[consumer] = outstanding

    def choose(self) -> int | None:
        """The least-busy consumer with credit left, or None if all are full."""
        best = None
        best_load = None
        n = self.num_consumers
        for step in range(1, n + 1):
            c = (self._last + step) % n
            if not self.alive[c]:
                continue
            load = self.estimate(c)
            if load >= self.max_outstanding:
                continue
            if best_load is None or load < best_load:
                best, best_load = c, load
        return best

    def has_credit(self, consumer: int) -> bool:
        """A batch that must go to ``consumer`` (held-out batches: drafter 0) waits until it has credit."""
        return self.alive[consumer] and self.estimate(consumer) < self.max_outstanding

    def on_sent(self, consumer: int) -> None:
        self.sent[consumer] += 1
        self.routed_total[consumer] += 1
        self._last = consumer

    def inflight(self) -> list[int]:
        return [self.estimate(c) for c in range(self.num_consumers)]
