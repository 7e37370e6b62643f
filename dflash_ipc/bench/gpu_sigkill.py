"""The SIGKILL check: a cuda-ipc consumer killed with SIGKILL while it holds the ring's mappings
(and a copy still queued) must not keep the producer from closing its ring and releasing its GPU
memory. Two spawned processes, typed msgpack messages (:mod:`dflash_ipc.bench.gpu_wire`)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
from typing import TypeVar

import torch

from dflash_ipc.bench.gpu_ring import (
    MIB,
    environ,
    fill_slot,
    layout_for_bytes,
    spawn_context,
    stop_processes,
    verify_slot,
)
from dflash_ipc.bench.gpu_wire import (
    ChildFailed,
    CloseRing,
    ConsumerHolding,
    Copied,
    HarnessError,
    ProducerHolding,
    RingClosed,
    RingOpen,
    SlotFilled,
    recv,
    send,
)
from dflash_ipc.control.protocol import Struct
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.shm_names import new_run_id

T = TypeVar("T", bound=Struct)


def _kill_producer_main(peer, parent, device: int, slot_bytes: int, num_slots: int) -> None:
    try:
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
        torch.cuda.synchronize(dev)
        free0 = torch.cuda.mem_get_info(dev)[0]
        layout = layout_for_bytes(slot_bytes)
        ring = create_producer_ring("cuda-ipc", layout, num_slots, run_id=new_run_id(), producer_rank=0, device=dev)
        ring_bytes = ring.num_slots * ring.slot_bytes
        free1 = torch.cuda.mem_get_info(dev)[0]
        send(peer, RingOpen(ring.descriptor()))
        base = torch.arange(layout.max_tokens, dtype=torch.int64, device=dev)
        stream = torch.cuda.Stream(dev)
        for slot in range(num_slots):
            with torch.cuda.stream(stream):
                fill_slot(ring.staging_views(slot, layout.max_tokens, 1), layout, slot, base)
            ring.commit(slot, layout.max_tokens, 1, stream)
            send(peer, SlotFilled(slot=slot, seq=slot, n_tokens=layout.max_tokens, n_seqs=1))
        copied = recv(peer, Copied, timeout=120)
        send(parent, ProducerHolding(free0=free0, free1=free1, ring_bytes=ring_bytes, consumer_errors=copied.errors))
        recv(parent, CloseRing, timeout=300)
        free2 = torch.cuda.mem_get_info(dev)[0]
        t0 = time.perf_counter()
        ring.close()
        close_s = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while True:
            free3 = torch.cuda.mem_get_info(dev)[0]
            if free3 - free2 >= 0.95 * ring_bytes or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        send(parent, RingClosed(free_before_close=free2, free_after_close=free3, close_s=close_s, released_bytes=free3 - free2))
    except BaseException:
        send(parent, ChildFailed(traceback.format_exc()))
        raise


def _kill_consumer_main(peer, parent, device: int) -> None:
    try:
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)
        ring = open_consumer_ring(recv(peer, RingOpen, timeout=120).descriptor, dev)
        layout = ring.layout
        err = torch.zeros((), dtype=torch.int64, device=dev)
        base = torch.arange(layout.max_tokens, dtype=torch.int64, device=dev)
        dsts, tickets = [], []
        for _ in range(ring.num_slots):
            m = recv(peer, SlotFilled, timeout=120)
            d = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=dev)
            tickets.append(ring.copy_out(m.slot, m.n_tokens, m.n_seqs, d))
            dsts.append((d, m))
        for t in tickets:
            t.wait()
        for d, m in dsts:
            verify_slot(layout.views(d, m.n_tokens, m.n_seqs), layout, m.seq, base, err, "full")
        errors = int(err.item())
        send(peer, Copied(errors=errors))
        send(parent, ConsumerHolding(pid=os.getpid(), errors=errors))
        # Hold the mappings (and a copy still queued on the ring stream) until SIGKILL.
        ring.copy_out(0, layout.max_tokens, 1, dsts[0][0])
        time.sleep(3600)
    except BaseException:
        send(parent, ChildFailed(traceback.format_exc()))
        raise


def run_sigkill_check(
    producer_device: int,
    consumer_device: int,
    *,
    slot_bytes: int = 256 * MIB,
    num_slots: int = 4,
    env: dict | None = None,
    timeout: float = 180.0,
) -> dict:
    """Kill a consumer with SIGKILL while it holds the ring's mappings; then close the producer's
    ring. Returns the producer's free-memory readings, its exit code and the consumer's."""
    ctx = spawn_context()
    a, b = ctx.Pipe(duplex=True)
    pp, pc = ctx.Pipe(duplex=True)
    cp, cc = ctx.Pipe(duplex=True)
    prod = ctx.Process(target=_kill_producer_main, args=(a, pc, producer_device, slot_bytes, num_slots), daemon=True)
    cons = ctx.Process(target=_kill_consumer_main, args=(b, cc, consumer_device), daemon=True)
    with environ(env):
        prod.start()
        cons.start()
    try:

        def expect(conn, what: str, proc, want: type[T]) -> T:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if conn.poll(0.1):
                    m = recv(conn, want, ChildFailed)
                    if isinstance(m, ChildFailed):
                        raise HarnessError(f"{what} failed:\n{m.error}")
                    return m
                if not proc.is_alive():
                    raise HarnessError(f"{what} exited with {proc.exitcode}")
            raise TimeoutError(f"no {want.__name__} from {what} in {timeout} s")

        c_hold = expect(cp, "consumer", cons, ConsumerHolding)
        p_hold = expect(pp, "producer", prod, ProducerHolding)
        os.kill(c_hold.pid, signal.SIGKILL)
        cons.join(timeout=30)
        time.sleep(0.5)
        send(pp, CloseRing())
        closed = expect(pp, "producer", prod, RingClosed)
        prod.join(timeout=60)
        return {
            **dataclasses.asdict(p_hold),
            **dataclasses.asdict(closed),
            "consumer_copy_errors": c_hold.errors,
            "consumer_exitcode": cons.exitcode,
            "producer_exitcode": prod.exitcode,
        }
    finally:
        stop_processes([prod, cons])
