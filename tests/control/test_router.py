"""Least-busy routing with credits."""

from __future__ import annotations

import random

import pytest

from dflash_ipc.control.router import LeastBusyRouter


def send(r: LeastBusyRouter) -> int | None:
    c = r.choose()
    if c is not None:
        r.on_sent(c)
    return c


def test_constructor_validates():
    with pytest.raises(ValueError):
        LeastBusyRouter(0, 2)
    with pytest.raises(ValueError):
        LeastBusyRouter(2, 0)


def test_least_busy_choice():
    r = LeastBusyRouter(3, max_outstanding=4)
    r.on_report(0, outstanding=3, received=0)
    r.on_report(1, outstanding=1, received=0)
    r.on_report(2, outstanding=2, received=0)
    assert r.choose() == 1
    r.on_sent(1)  # estimate of 1 is now 2 (report 1 + one send it has not seen)
    assert r.estimate(1) == 2
    c = r.choose()
    assert c in (1, 2) and r.estimate(c) == 2
    # a report that saw our send and shows the drafter drained makes it the least busy again
    r.on_report(1, outstanding=0, received=1)
    assert r.estimate(1) == 0 and r.choose() == 1


def test_fair_round_robin_between_equal_consumers():
    n = 4
    r = LeastBusyRouter(n, max_outstanding=2)
    for _ in range(1001):
        c = send(r)
        assert c is not None
        # every consumer drains at once and reports: all are always equally (un)loaded
        r.on_report(c, outstanding=0, received=r.sent[c])
        assert max(r.routed_total) - min(r.routed_total) <= 1
    assert sum(r.routed_total) == 1001
    assert max(r.routed_total) - min(r.routed_total) <= 1


def test_round_robin_without_reports_fills_evenly():
    r = LeastBusyRouter(3, max_outstanding=3)
    order = [send(r) for _ in range(9)]
    assert order == [0, 1, 2] * 3
    assert send(r) is None


def test_credits_never_exceeded_and_none_when_all_full():
    r = LeastBusyRouter(2, max_outstanding=3)
    got = [send(r) for _ in range(6)]
    assert sorted(got) == [0, 0, 0, 1, 1, 1]
    assert r.choose() is None  # all full: the slot waits in the producer's ring
    assert r.inflight() == [3, 3]
    # a consumer reports it has seen everything but still holds all three: still full
    r.on_report(0, outstanding=3, received=3)
    assert r.choose() is None
    # it returns one: exactly one credit comes back
    r.on_report(0, outstanding=2, received=3)
    assert send(r) == 0
    assert r.choose() is None


def test_credits_hold_under_random_traffic():
    rng = random.Random(5)
    n, cap = 3, 2
    r = LeastBusyRouter(n, max_outstanding=cap)
    held = [0] * n  # ground truth at each consumer
    seen = [0] * n
    for _ in range(3000):
        if rng.random() < 0.6:
            c = send(r)
            if c is None:
                assert all(r.estimate(i) >= cap for i in range(n))
            else:
                held[c] += 1
                assert held[c] <= cap
        else:
            c = rng.randrange(n)
            if rng.random() < 0.5 and held[c]:
                held[c] -= 1
            if rng.random() < 0.7:  # deliver everything this consumer has received so far
                seen[c] = r.sent[c]
                r.on_report(c, outstanding=held[c], received=seen[c])
        assert all(r.estimate(i) >= held[i] for i in range(n))  # never under-estimates


def test_stale_reports_ignored():
    r = LeastBusyRouter(2, max_outstanding=5)
    for _ in range(4):
        r.on_sent(0)
    r.on_report(0, outstanding=1, received=4)  # fresh: saw all four, holds one
    assert r.estimate(0) == 1
    r.on_report(0, outstanding=4, received=2)  # older report arriving late
    assert r.estimate(0) == 1
    assert r.reported_received[0] == 4 and r.reported_outstanding[0] == 1
    # an equally fresh report is applied (the consumer reports on every change)
    r.on_report(0, outstanding=0, received=4)
    assert r.estimate(0) == 0


def test_report_cannot_claim_more_than_sent():
    r = LeastBusyRouter(1, max_outstanding=2)
    r.on_sent(0)
    r.on_report(0, outstanding=0, received=10)  # bogus count: clamped to what we really sent
    assert r.reported_received[0] == 1
    r.on_sent(0)
    assert r.estimate(0) == 1  # the new send is still counted as unseen


def test_dead_consumer_is_skipped():
    r = LeastBusyRouter(3, max_outstanding=2)
    r.alive[1] = False
    got = [send(r) for _ in range(4)]
    assert 1 not in got and sorted(got) == [0, 0, 2, 2]
    assert send(r) is None
