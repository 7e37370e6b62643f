"""The ``nccl`` transport on CPU (gloo, the same code path as NCCL on GPUs), end to end.

* ``dflash-ipc up`` with ``transport.backend = "nccl"``: the run of
  tests/faults/test_hostile_peers.py (real target and drafter processes, one two-rank pair group
  per target-drafter pair, every planned batch trained exactly once, with hostile frames in every
  socket besides).
* ``dflash-ipc bench transport --backend nccl`` on CPU: verified slots between real processes,
  several producers and consumers (the cpu-shm harness of tests/transport/test_transport_procs.py).
"""

from __future__ import annotations

from dflash_ipc.bench import transport as bench_transport


def test_bench_ring_nccl_over_gloo_two_by_two_verified(tmp_path, monkeypatch):
    """Two producer and two consumer processes: four pair groups, least-busy routing, every slot
    verified after its receive completed, every slot back at its producer at the end."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = bench_transport.BenchArgs(backend="nccl", producers=2, consumers=2, slots=3, slot_mib=0.25, seconds=1.5)
    res = bench_transport.run_ring(args, 1 << 18, args.seconds)
    summ = res["summaries"]
    ring = bench_transport._ring_result(res, args)
    assert ring["verified"] is True and ring["rejected"] == 0, ring
    assert all(n > 0 for n in ring["per_consumer_slots"]), ring
    for p in range(2):
        ps = summ[("producer", p)]
        slots = ps.plane.slots
        assert ps.rejected == 0 and slots.ready == 0 and slots.queued == 0 and slots.free == args.slots
        # every slot was reused, and each batch sent was received and verified by exactly one consumer
        assert ps.batches > 2 * args.slots
        assert ps.batches == sum(summ[("consumer", c)].per_producer[p] for c in range(2))
