"""Bench consumer process: copies slots out, verifies every element, returns the slot."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from dflash_ipc.bench import transport as bench_transport
from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Done, Hello, RejectCounter
from dflash_ipc.control.stats import ConsumerSummary
from dflash_ipc.runtime.child import ChildSockets, place_process, setup_child_process
from dflash_ipc.transport.dataplane import ConsumerDataPlane
from dflash_ipc.transport.factory import open_consumer_ring


def run_bench_consumer_process(a: argparse.Namespace) -> int:
    run_dir = Path(a.run_dir)
    log, stop = setup_child_process("consumer", a.rank, run_dir)
    device = place_process(a.device, None, a.producers + a.consumers)
    socks = ChildSockets(run_dir, "consumer", a.rank, channels.drafter_endpoint(run_dir, a.rank))
    rejects = RejectCounter(f"consumer-{a.rank}", log)
    rings = []
    try:
        hello = Hello(role="consumer", rank=a.rank, pid=os.getpid(), device=a.device, endpoint=socks.pull_endpoint)
        start = handshake.child_handshake(socks.dealer, hello, 120, rejects)
        rings = [open_consumer_ring(d, device, consumer_rank=a.rank) for d in start.rings]
        socks.connect_peers(start.target_endpoints, "producer")
        slot_bytes = max(r.layout.slot_bytes for r in rings)
        buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(a.prefetch + 1)]
        plane = ConsumerDataPlane(a.rank, rings, buffers, socks.send_to_peer, rejects)
        handshake.send_ready(socks.dealer, "consumer", a.rank)
        poller = socks.poller()
        verified = True
        slots = 0
        t_first = None
        t_last = time.perf_counter()
        while not plane.drained() and not stop.requested:
            for msg in channels.drain(socks.pull, rejects):
                plane.handle(msg)
            plane.pump()
            batch = plane.take()
            if batch is None:
                if plane.copying:
                    plane.wait_for_copy()
                else:
                    poller.poll(50)
                continue
            if t_first is None:
                t_first = time.perf_counter() - batch.copy_s
            m = batch.msg
            verified &= bench_transport.verify_pattern(batch.views, m.producer, m.batch_id[2])
            if a.slow_ms > 0:
                time.sleep(a.slow_ms / 1000)
            plane.release(batch)
            slots += 1
            t_last = time.perf_counter()
        summary = ConsumerSummary(
            slots=slots,
            bytes=plane.bytes_copied,
            verified=bool(verified),
            active_s=(t_last - t_first) if t_first is not None else 0.0,
            copy_s=plane.copy_seconds,
            handoff_ns=plane.handoff_ns,
            rejected=rejects.total,
            per_producer=list(plane.slots_done),
        )
        socks.send_to_supervisor(Done(role="consumer", rank=a.rank, consumer=summary))
        return 0
    except Exception as e:
        socks.report_dead(e, log)
        return 1
    finally:
        for r in rings:
            r.close()
        socks.close()


def main() -> int:
    ap = bench_transport.process_arg_parser()
    ap.add_argument("--slow-ms", type=float, default=0.0)
    ap.add_argument("--prefetch", type=int, default=1)
    return run_bench_consumer_process(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
