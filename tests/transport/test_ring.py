"""Slot rings: SlotTable lifecycle, and cpu-shm rings shared between real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import types

import msgpack
import pytest
import torch

from dflash_ipc.bench import gpu_ring, gpu_wire
from dflash_ipc.control import protocol
from dflash_ipc.control.ring_descriptor import (
    DESCRIPTOR_VERSION,
    RingDescriptor,
    ShmSegment,
)
from dflash_ipc.transport import shm
from dflash_ipc.transport.cpu_shm import CpuShmConsumerRing, CpuShmProducerRing
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.ring import SlotState, SlotStateError, SlotTable
from dflash_ipc.transport.shm_names import SHM_DIR, list_run_shm, new_run_id, shm_name, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

LAYOUT = SlotLayout(num_planes=2, hidden_size=16, max_tokens=32, max_seqs=4, plane_dtype="float32")


@pytest.fixture
def run_id():
    rid = new_run_id()
    yield rid
    sweep_run_shm(rid)


# --------------------------------------------------------------------------- SlotTable


def test_slot_table_lifecycle():
    t = SlotTable(3)
    assert t.counts() == {"free": 3, "filling": 0, "ready": 0}
    s = t.acquire()
    assert s == 0 and t.state[s] is SlotState.FILLING
    t.publish(s, consumer=1)
    assert t.state[s] is SlotState.READY and t.holder[s] == 1
    assert t.held_by(1) == [s] and t.held_by(0) == []
    assert t.counts() == {"free": 2, "filling": 0, "ready": 1}
    t.release(s, consumer=1)
    assert t.state[s] is SlotState.FREE and t.holder[s] is None
    assert t.counts() == {"free": 3, "filling": 0, "ready": 0}


def test_slot_table_exhaustion_and_reuse():
    t = SlotTable(2)
    a, b = t.acquire(), t.acquire()
    assert {a, b} == {0, 1}
    assert t.acquire() is None  # nothing free: the producer waits, nothing is allocated
    t.publish(a, 0)
    t.publish(b, 1)
    assert t.acquire() is None
    t.release(b, 1)
    assert t.acquire() == b
    t.abort_filling(b)
    assert t.state[b] is SlotState.FREE and t.acquire() == b


def test_slot_table_rejects_stray_and_duplicated_release():
    t = SlotTable(4)
    s = t.acquire()
    # FILLING: not yet handed to anyone
    with pytest.raises(SlotStateError):
        t.release(s, 0)
    t.publish(s, 0)
    # wrong consumer
    with pytest.raises(SlotStateError, match="not held by consumer 1"):
        t.release(s, 1)
    assert t.state[s] is SlotState.READY and t.holder[s] == 0  # unchanged by the rejected release
    t.release(s, 0)
    # duplicated release
    with pytest.raises(SlotStateError):
        t.release(s, 0)
    # a slot that was never acquired
    with pytest.raises(SlotStateError):
        t.release(3, 0)
    # outside the ring
    for bad in (4, 99, -1):
        with pytest.raises(SlotStateError, match="outside ring"):
            t.release(bad, 0)
    # the free list was not corrupted by the rejected releases: each slot comes back exactly once
    got = [t.acquire() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and t.acquire() is None


def test_slot_table_publish_requires_filling():
    t = SlotTable(2)
    with pytest.raises(SlotStateError):
        t.publish(0, 0)  # FREE
    s = t.acquire()
    t.publish(s, 0)
    with pytest.raises(SlotStateError):
        t.publish(s, 1)  # READY already


# --------------------------------------------------------------------------- cpu-shm, one process


def test_cpu_shm_file_is_private_and_close_unlinks(run_id):
    ring = create_producer_ring("cpu-shm", LAYOUT, 3, run_id=run_id, producer_rank=0)
    path = SHM_DIR / ring.name
    assert path.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_size == 3 * LAYOUT.slot_bytes
    assert list_run_shm(run_id) == [str(path)]
    ring.close()
    assert not path.exists()
    assert list_run_shm(run_id) == []
    ring.close()  # idempotent
    with pytest.raises(RuntimeError):
        ring.slot(0)


def test_full_dev_shm_is_refused_before_anything_is_created(run_id, monkeypatch):
    need = 3 * LAYOUT.slot_bytes
    real_statvfs = os.statvfs

    def statvfs(path):  # /dev/shm with exactly `free` bytes left; any other path as it is
        st = real_statvfs(path)
        if os.fspath(path) != os.fspath(SHM_DIR):
            return st
        return types.SimpleNamespace(f_bavail=free // st.f_frsize, f_frsize=st.f_frsize)

    monkeypatch.setattr(shm.os, "statvfs", statvfs)
    frsize = real_statvfs(SHM_DIR).f_frsize
    free = (need // frsize - 1) * frsize  # at least one block short
    for backend in ("cpu-shm", "host-pinned"):
        if backend == "host-pinned" and not torch.cuda.is_available():
            continue
        with pytest.raises(shm.SharedMemoryFullError, match=re.escape(f"shared memory full ({SHM_DIR}, need {need} bytes, {free} free)")):
            create_producer_ring(backend, LAYOUT, 3, run_id=run_id, producer_rank=0, device="cuda:0" if backend != "cpu-shm" else "cpu")
        assert list_run_shm(run_id) == []  # refused before the segment existed: nothing to SIGBUS on, nothing to sweep
    free = -(-need // frsize) * frsize  # just enough
    ring = create_producer_ring("cpu-shm", LAYOUT, 3, run_id=run_id, producer_rank=0)
    ring.close()


def test_names_unique_per_run_id():
    a, b = new_run_id(), new_run_id()
    assert a != b
    assert shm_name(a, 0) != shm_name(b, 0) and shm_name(a, 0) != shm_name(a, 1)
    ra0 = CpuShmProducerRing(LAYOUT, 2, a, 0)
    try:
        ra1 = CpuShmProducerRing(LAYOUT, 2, a, 1)
        rb0 = CpuShmProducerRing(LAYOUT, 2, b, 0)
        assert len({ra0.name, ra1.name, rb0.name}) == 3
        # the same (run, rank) twice is refused, never silently shared
        with pytest.raises(FileExistsError):
            CpuShmProducerRing(LAYOUT, 2, a, 0)
        assert len(list_run_shm(a)) == 2 and len(list_run_shm(b)) == 1
        # sweeping one run leaves the other alone
        assert sorted(sweep_run_shm(a)) == sorted(str(SHM_DIR / n) for n in (ra0.name, ra1.name))
        assert list_run_shm(a) == [] and list_run_shm(b) == [str(SHM_DIR / rb0.name)]
        rb0.close()
    finally:
        sweep_run_shm(a)
        sweep_run_shm(b)


def test_consumer_ring_refuses_wrong_size(run_id):
    ring = create_producer_ring("cpu-shm", LAYOUT, 2, run_id=run_id, producer_rank=0)
    try:
        d = ring.descriptor()
        with pytest.raises(ValueError, match="bytes"):
            CpuShmConsumerRing(dataclasses.replace(d, num_slots=3))
        with pytest.raises(ValueError, match="unknown transport backend"):
            open_consumer_ring(dataclasses.replace(d, backend="carrier-pigeon"))
        with pytest.raises(ValueError, match="version 1, this build reads"):
            open_consumer_ring(dataclasses.replace(d, version=1))
    finally:
        ring.close()


def test_descriptor_is_typed_on_the_wire(run_id):
    ring = create_producer_ring("cpu-shm", LAYOUT, 2, run_id=run_id, producer_rank=3)
    try:
        d = ring.descriptor()
        assert isinstance(d, RingDescriptor) and d.backend == "cpu-shm" and d.version == DESCRIPTOR_VERSION
        assert d.shm == ShmSegment(name=ring.name) and d.gpu is None and d.cuda_ipc is None
        assert (d.run_id, d.producer_rank, d.producer_pid, d.num_slots) == (run_id, 3, os.getpid(), 2)
        raw = msgpack.unpackb(msgpack.packb(protocol.to_wire(d), use_bin_type=True), raw=False)
        assert protocol.from_wire(RingDescriptor, raw) == d
        # a renamed key, a mistyped field, or a part the backend does not have is refused on decode
        with pytest.raises(protocol.ProtocolError, match="unknown fields"):
            protocol.from_wire(RingDescriptor, {**raw, "name": ring.name})
        with pytest.raises(protocol.ProtocolError, match=r"RingDescriptor\.layout\.max_tokens"):
            protocol.from_wire(RingDescriptor, {**raw, "layout": {**raw["layout"], "max_tokens": "32"}})
        with pytest.raises(protocol.ProtocolError, match="carries no `gpu` part"):
            protocol.from_wire(RingDescriptor, {**raw, "gpu": {"index": 0, "uuid": "GPU-0"}})
        with pytest.raises(protocol.ProtocolError, match="needs `shm` part"):
            protocol.from_wire(RingDescriptor, {**raw, "shm": None})
    finally:
        ring.close()


# --------------------------------------------------------------------------- cpu-shm, two processes

CONSUMER_CHILD = textwrap.dedent(
    r"""
    import json, sys
    import msgpack, torch
    from dflash_ipc.control.protocol import from_wire
    from dflash_ipc.control.ring_descriptor import RingDescriptor
    from dflash_ipc.transport.factory import open_consumer_ring
    desc = from_wire(RingDescriptor, msgpack.unpackb(sys.stdin.buffer.read(), raw=False))
    ring = open_consumer_ring(desc)
    out = {"num_slots": ring.num_slots, "ok": []}
    buf = torch.zeros(ring.layout.slot_bytes, dtype=torch.uint8)
    for i in range(ring.num_slots):
        n = 5 + i
        buf.zero_()
        ring.copy_out(i, n, 2, buf).wait()
        v = ring.layout.views(buf, n, 2)
        ok = bool(torch.all(v.planes == float(100 + i))) and v.planes.shape == (ring.layout.num_planes, n, ring.layout.hidden_size)
        ok &= v.token_ids.tolist() == list(range(i, i + n))
        ok &= v.loss_mask.tolist() == [1, 0] * (n // 2) + [1] * (n % 2)
        ok &= v.seq_lens.tolist() == [n - 2, 2]
        out["ok"].append(ok)
    # write back through the same mapping: the producer must see it
    ring.slot(0)[-1] = 0xAB
    ring.close()
    print(json.dumps(out))
    """
)


def test_cpu_shm_cross_process(run_id):
    ring = create_producer_ring("cpu-shm", LAYOUT, 3, run_id=run_id, producer_rank=2)
    try:
        for i in range(3):
            n = 5 + i
            v = ring.staging_views(i, n, 2)
            v.planes.fill_(float(100 + i))
            v.token_ids.copy_(torch.arange(i, i + n))
            v.loss_mask.copy_(torch.tensor([1, 0] * (n // 2) + [1] * (n % 2), dtype=torch.uint8))
            v.seq_lens.copy_(torch.tensor([n - 2, 2], dtype=torch.int32))
            ring.commit(i, n, 2)
        wire = msgpack.packb(protocol.to_wire(ring.descriptor()), use_bin_type=True)
        proc = subprocess.run([sys.executable, "-c", CONSUMER_CHILD], input=wire, capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode()
        out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        assert out == {"num_slots": 3, "ok": [True, True, True]}
        assert int(ring.slot(0)[-1]) == 0xAB  # the child wrote into our mapping
        # the consumer closing its mapping does not remove the producer's segment
        assert list_run_shm(run_id) == [str(SHM_DIR / ring.name)]
    finally:
        ring.close()
    assert list_run_shm(run_id) == []


PRODUCER_CHILD = textwrap.dedent(
    r"""
    import sys, time
    from dflash_ipc.transport.factory import create_producer_ring
    from dflash_ipc.transport.slots import SlotLayout
    ring = create_producer_ring("cpu-shm", SlotLayout(1, 8, 8, 1), 2, run_id=sys.argv[1], producer_rank=0)
    ring.slot(1)[0] = 7
    print(ring.name, flush=True)
    time.sleep(600)
    """
)


def test_killed_producer_leaves_segment_and_sweep_removes_it(run_id):
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER_CHILD, run_id], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name == shm_name(run_id, 0)
        path = SHM_DIR / name
        assert path.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # nobody unlinked it: the segment outlives its creator...
    assert path.exists() and list_run_shm(run_id) == [str(path)]
    # ...and its data is still there for anyone who maps it
    layout = SlotLayout(1, 8, 8, 1)
    desc = RingDescriptor(
        backend="cpu-shm",
        version=DESCRIPTOR_VERSION,
        run_id=run_id,
        producer_rank=0,
        producer_pid=proc.pid,
        num_slots=2,
        slot_bytes=layout.slot_bytes,
        layout=layout.to_wire(),
        shm=ShmSegment(name=name),
    )
    cons = open_consumer_ring(desc)
    assert int(cons.slot(1)[0]) == 7
    cons.close()
    # the supervisor's sweep removes exactly that run's segments
    assert sweep_run_shm(run_id) == [str(path)]
    assert not path.exists() and list_run_shm(run_id) == []
    assert sweep_run_shm(run_id) == []


# --------------------------------------------------------------------------- the ring harness on CPU

HARNESS_LAYOUT = SlotLayout(num_planes=2, hidden_size=32, max_tokens=64, max_seqs=4, plane_dtype="bfloat16")
# random batch sizes (edges included), three slots reused 20 times each, every byte verified
RANDOM_SIZES = {"num_slots": 3, "iters": 60, "warmup": 0, "depth": 2, "sizes": "random", "verify": "full", "seed": 7}


@pytest.fixture(scope="module")
def ring_harness() -> dict[str, list[tuple[gpu_wire.Scenario, dict]]]:
    """The scenarios of both backends in one run of the harness (one spawned producer, one spawned
    consumer, each importing torch once), by backend: (scenario, its result) in order."""
    scs = {
        backend: [
            gpu_ring.scenario(f"{name} random", backend, -1, -1, HARNESS_LAYOUT, **RANDOM_SIZES),
            gpu_ring.handoff_scenario(backend, -1, -1, iters=20),
        ]
        for backend, name in (("cpu-shm", "cpu"), ("nccl", "cpu nccl"))
    }
    results = iter(gpu_ring.run_scenarios([sc for group in scs.values() for sc in group], timeout=240))
    return {backend: [(sc, next(results)) for sc in group] for backend, group in scs.items()}


def test_ring_harness_two_processes_typed_messages_on_cpu(ring_harness):
    """The GPU harness (bench gpu-ring, tests/transport/test_ring_cuda.py) on cpu-shm rings (device -1): two
    spawned processes, the descriptor and every message typed msgpack over pipes, every byte verified."""
    runs = ring_harness["cpu-shm"]
    assert [r["name"] for _, r in runs] == ["cpu random", "handoff cpu-shm cuda:-1->cuda:-1"]
    for sc, r in runs:
        assert r["slots"] == sc.iters and r["errors"] == 0 and r["stray_frees"] == 0, r
        assert r["copy_mode"] == "cpu-shm" and r["bytes"] > 0, r
    # the harness's frames are validated like control-plane messages
    frame = gpu_wire.pack(gpu_wire.SlotFilled(slot=1, seq=2, n_tokens=3, n_seqs=1))
    assert gpu_wire.unpack(frame, gpu_wire.SlotFilled) == gpu_wire.SlotFilled(slot=1, seq=2, n_tokens=3, n_seqs=1)
    with pytest.raises(gpu_wire.HarnessError, match="expected SlotReturned, got SlotFilled"):
        gpu_wire.unpack(frame, gpu_wire.SlotReturned)
    with pytest.raises(gpu_wire.HarnessError, match="the other side failed:\\nboom"):
        gpu_wire.unpack(gpu_wire.pack(gpu_wire.ChildFailed("boom")), gpu_wire.SlotReturned)
    with pytest.raises(protocol.ProtocolError, match="out_of_range"):
        gpu_wire.unpack(msgpack.packb({"t": "SlotFilled", "m": {"slot": -1, "seq": 0, "n_tokens": 0, "n_seqs": 0}}), gpu_wire.SlotFilled)
    with pytest.raises(protocol.ProtocolError, match="undecodable"):
        gpu_wire.unpack(b"\xc1", gpu_wire.SlotFilled)
    with pytest.raises(ValueError, match="verify='none'"):
        gpu_wire.Scenario("x", "cpu-shm", -1, -1, HARNESS_LAYOUT.to_wire(), fill="none")


def test_ring_harness_nccl_backend_over_gloo_on_cpu(ring_harness):
    """The ``nccl`` ring on CPU (gloo, the same code path): two spawned processes, a two-rank pair
    group from the producer's store, random batch sizes (edges included), three slots reused 20
    times each, every byte verified after the receive completed; then the one-in-flight handoff."""
    runs = ring_harness["nccl"]
    assert [r["name"] for _, r in runs] == ["cpu nccl random", "handoff nccl cuda:-1->cuda:-1"]
    for sc, r in runs:
        assert r["slots"] == sc.iters and r["errors"] == 0 and r["stray_frees"] == 0, r
        assert r["copy_mode"] == "nccl" and r["bytes"] > 0, r
