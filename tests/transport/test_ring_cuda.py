"""GPU ring backends (cuda-ipc, host-pinned) with real processes and real rings.

Every test here needs CUDA and is skipped without it. The producer and the consumer are
separate spawned processes; the ring descriptor and every control message travel between them
as typed msgpack messages over a pipe (dflash_ipc.bench.gpu_ring, gpu_wire), never pickled. Run on an H200
machine: ``python -m pytest tests/transport/test_ring_cuda.py -q``.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from dflash_ipc.bench import gpu_ring as bg
from dflash_ipc.bench.gpu_sigkill import run_sigkill_check
from dflash_ipc.control import protocol
from dflash_ipc.control.ring_descriptor import RingDescriptor
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.shm_names import new_run_id
from dflash_ipc.transport.slots import SlotLayout

pytestmark = pytest.mark.gpu  # skipped without CUDA by tests/conftest.py

MIB = 1 << 20

EXPANDABLE = {
    False: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
    True: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}


def _consumer_device(where: str) -> int:
    if where == "same":
        return 0
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return 1


def _integrity(backend: str, cd: int, iters: int = 1200) -> dict:
    # bf16 planes, random n_tokens / n_seqs per slot (edges included), every byte verified.
    layout = SlotLayout(num_planes=3, hidden_size=512, max_tokens=2048, max_seqs=16, plane_dtype="bfloat16")
    return bg.scenario(
        f"integrity {backend} ->cuda:{cd}",
        backend,
        0,
        cd,
        layout,
        num_slots=4,
        iters=iters,
        warmup=0,
        depth=3,
        sizes="random",
        verify="full",
        seed=11,
    )


def _race(backend: str, cd: int, slot_bytes: int = 64 * MIB, iters: int = 150, early_return: bool = False) -> dict:
    # Two slots, both held by the consumer: a returned slot is the only free one, and the
    # producer overwrites it the instant its SlotFree arrives. Every byte verified.
    return bg.scenario(
        f"race {backend} ->cuda:{cd}{' early' if early_return else ''}",
        backend,
        0,
        cd,
        bg.layout_for_bytes(slot_bytes),
        num_slots=2,
        iters=iters,
        warmup=0,
        depth=2,
        sizes="full",
        verify="full",
        early_return=early_return,
    )


def _delayed(backend: str, cd: int, iters: int = 150) -> dict:
    # The producer's stream sleeps before each fill: SlotReady arrives before the data is
    # written, so the consumer's copy must be ordered after the fill on the GPU.
    layout = SlotLayout(num_planes=2, hidden_size=1024, max_tokens=1024, max_seqs=8, plane_dtype="bfloat16")
    return bg.scenario(
        f"delayed {backend} ->cuda:{cd}",
        backend,
        0,
        cd,
        layout,
        num_slots=3,
        iters=iters,
        warmup=0,
        depth=2,
        sizes="random",
        verify="full",
        seed=5,
        producer_delay_us=300,
    )


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["slots"] == r["iters"], r
        assert r["errors"] == 0, r
        assert r["stray_frees"] == 0, r


@pytest.mark.parametrize("expandable", [False, True], ids=["expandable-off", "expandable-on"])
@pytest.mark.parametrize("where", ["same", "other"], ids=["same-gpu", "other-gpu"])
def test_cuda_ipc_integrity_and_race(where, expandable):
    cd = _consumer_device(where)
    results = bg.run_scenarios(
        [_integrity("cuda-ipc", cd), _race("cuda-ipc", cd), _delayed("cuda-ipc", cd)], env=EXPANDABLE[expandable], timeout=120
    )
    _check(results)
    assert results[0]["bytes"] > 0
    if cd == 0:
        assert all(r["copy_mode"] == "same-device" for r in results)
    elif not expandable and torch.cuda.can_device_access_peer(0, cd) and torch.cuda.can_device_access_peer(cd, 0):
        assert all(r["copy_mode"] == "pull" for r in results), [r["copy_mode"] for r in results]
    print([(r["name"], r["copy_mode"], r["slots"], r["errors"]) for r in results])


def test_cuda_ipc_slots_read_in_place_on_the_same_gpu_keep_every_byte():
    # the drafter's same-GPU path: no copy, the slot returned only after an event behind its reads;
    # race (two slots, overwritten the instant one returns) and delayed fills (SlotReady before the data)
    scenarios = [
        dataclasses.replace(s, in_place=True) for s in (_integrity("cuda-ipc", 0, iters=300), _race("cuda-ipc", 0), _delayed("cuda-ipc", 0))
    ]
    results = bg.run_scenarios(scenarios, timeout=120)
    _check(results)
    assert all(r["copy_mode"] == "same-device" for r in results)


def test_cuda_ipc_push_copies_from_the_ring_gpu():
    """DFLASH_IPC_CUDA_COPY=push: the copy runs on the ring's GPU (the fallback path)."""
    cd = _consumer_device("other")
    results = bg.run_scenarios(
        [_integrity("cuda-ipc", cd, iters=600), _race("cuda-ipc", cd), _delayed("cuda-ipc", cd)],
        env={"DFLASH_IPC_CUDA_COPY": "push"},
        timeout=120,
    )
    _check(results)
    assert all(r["copy_mode"] == "push" for r in results)


def test_race_check_sees_an_early_return():
    """Negative control for the race test: a consumer that returns each slot right after
    enqueueing its copy (not after it completed) must be caught as corrupted data."""
    cd = _consumer_device("other")
    (r,) = bg.run_scenarios([_race("cuda-ipc", cd, slot_bytes=256 * MIB, iters=60, early_return=True)], timeout=120)
    assert r["slots"] == 60
    assert r["errors"] > 0, "an early SlotFree went unnoticed: the race test cannot see corruption"


@pytest.mark.parametrize("where", ["same", "other"], ids=["same-gpu", "other-gpu"])
def test_host_pinned_integrity_and_race(where):
    cd = _consumer_device(where)
    results = bg.run_scenarios(
        [
            _integrity("host-pinned", cd, iters=1000),
            _race("host-pinned", cd, slot_bytes=32 * MIB, iters=60),
            _delayed("host-pinned", cd, iters=60),
        ],
        timeout=120,
    )
    _check(results)


def test_consumer_killed_while_mapped_does_not_pin_producer_memory():
    cd = 1 if torch.cuda.device_count() > 1 else 0
    r = run_sigkill_check(0, cd, slot_bytes=256 * MIB, num_slots=4, timeout=90)
    assert r["consumer_copy_errors"] == 0, r
    assert r["consumer_exitcode"] == -9, r
    assert r["producer_exitcode"] == 0, r
    assert r["free0"] - r["free1"] >= r["ring_bytes"], r  # the ring really took GPU memory
    assert r["released_bytes"] >= 0.95 * r["ring_bytes"], r
    assert r["close_s"] < 10, r


def test_descriptor_is_typed_and_device_uuid_is_checked():
    layout = SlotLayout(num_planes=1, hidden_size=256, max_tokens=64, max_seqs=4, plane_dtype="bfloat16")
    for backend in ("cuda-ipc", "host-pinned"):
        ring = create_producer_ring(backend, layout, 3, run_id=new_run_id(), producer_rank=0, device="cuda:0")
        try:
            d = ring.descriptor()
            wire = msgpack.packb(protocol.to_wire(d), use_bin_type=True)
            assert protocol.from_wire(RingDescriptor, msgpack.unpackb(wire, raw=False)) == d
            assert d.slot_bytes == layout.slot_bytes and d.num_slots == 3
            assert d.gpu is not None and d.gpu.index == 0 and d.gpu.uuid.startswith("GPU-")
            if backend == "cuda-ipc":
                assert d.shm is None and len(d.cuda_ipc.event_handles) == 3 and isinstance(d.cuda_ipc.mem_handle, bytes)
                bad = dataclasses.replace(d, gpu=dataclasses.replace(d.gpu, uuid="GPU-00000000-0000-0000-0000-000000000000"))
                with pytest.raises(RuntimeError, match="UUID"):
                    open_consumer_ring(bad, "cuda:0")
            else:
                assert d.shm is not None and d.cuda_ipc is None
            with pytest.raises(IndexError):
                ring.slot(3)
            with pytest.raises(ValueError):
                ring.commit(0, layout.max_tokens + 1, 1)
        finally:
            ring.close()
            ring.close()  # idempotent


def test_choose_backend():
    from dflash_ipc.transport.factory import choose_backend

    backend, reason = choose_backend("cuda:0", ["cuda:0"])
    assert backend == "cuda-ipc" and reason
    assert choose_backend("cpu", ["cpu"])[0] == "cpu-shm"
    if torch.cuda.device_count() > 1:
        peer = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
        backend, reason = choose_backend(0, [0, 1])
        assert backend == ("cuda-ipc" if peer else "host-pinned"), reason


@pytest.mark.gpu(2)
def test_nccl_integrity_race_and_ordering_on_two_gpus():
    """The ``nccl`` ring between two GPUs (two processes, one two-rank NCCL pair group): random
    sizes with every byte verified, two slots overwritten the instant they come back, and a
    producer whose fill is still queued when SlotReady arrives (the send must wait for it)."""
    results = bg.run_scenarios([_integrity("nccl", 1), _race("nccl", 1), _delayed("nccl", 1)], timeout=180)
    _check(results)
    assert all(r["copy_mode"] == "nccl" and r["bytes"] > 0 for r in results), results
    print([(r["name"], r["slots"], r["errors"], r.get("gbps")) for r in results])


@pytest.mark.gpu(2)
def test_nccl_descriptor_carries_the_pair_rendezvous():
    layout = SlotLayout(num_planes=1, hidden_size=256, max_tokens=64, max_seqs=4, plane_dtype="bfloat16")
    ring = create_producer_ring("nccl", layout, 3, run_id=new_run_id(), producer_rank=0, device="cuda:0")
    try:
        d = ring.descriptor()
        wire = msgpack.packb(protocol.to_wire(d), use_bin_type=True)
        assert protocol.from_wire(RingDescriptor, msgpack.unpackb(wire, raw=False)) == d
        assert d.pair is not None and d.pair.host == "127.0.0.1" and d.pair.device_type == "cuda" and d.pair.port > 0
        assert d.shm is None and d.gpu is None and d.cuda_ipc is None
        with pytest.raises(ValueError, match="holds slots on cuda"):
            open_consumer_ring(d, "cpu", consumer_rank=0)
    finally:
        ring.close()
        ring.close()  # idempotent
