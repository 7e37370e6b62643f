"""Bench producer process: fills ring slots with a verifiable pattern for `bench transport`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from dflash_ipc.bench import transport as bench_transport
from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Done, Hello, RejectCounter
from dflash_ipc.control.stats import ProducerPlaneStats, ProducerSummary, RoutedSlot, RoutingLog
from dflash_ipc.runtime.child import ChildSockets, place_process, setup_child_process
from dflash_ipc.transport.dataplane import ProducerDataPlane
from dflash_ipc.transport.factory import create_producer_ring


def run_bench_producer_process(a: argparse.Namespace) -> int:
    run_dir = Path(a.run_dir)
    log, stop = setup_child_process("producer", a.rank, run_dir)
    device = place_process(a.device, None, a.producers + a.consumers)
    socks = ChildSockets(run_dir, "producer", a.rank, channels.target_endpoint(run_dir, a.rank))
    rejects = RejectCounter(f"producer-{a.rank}", log)
    ring = None
    try:
        layout = bench_transport.bench_layout(a.slot_bytes)
        ring = create_producer_ring(a.backend, layout, a.slots, run_id=a.run_id, producer_rank=a.rank, device=device)
        hello = Hello(role="producer", rank=a.rank, pid=os.getpid(), device=a.device, ring=ring.descriptor(), endpoint=socks.pull_endpoint)
        start = handshake.child_handshake(socks.dealer, hello, 120, rejects)
        socks.connect_peers(start.drafter_endpoints, "consumer")
        plane = ProducerDataPlane(a.rank, ring, len(socks.pushes), a.max_outstanding, socks.send_to_peer, rejects)
        handshake.send_ready(socks.dealer, "producer", a.rank)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        poller = socks.poller()
        index = 0
        end = time.monotonic() + a.seconds
        while time.monotonic() < end and not stop.requested:
            for msg in channels.drain(socks.pull, rejects):
                plane.handle(msg)
            slot = plane.acquire()
            if slot is not None:
                n = layout.max_tokens
                if stream is not None:
                    with torch.cuda.stream(stream):
                        bench_transport.fill_pattern(ring.staging_views(slot, n, 1), a.rank, index)
                        ring.commit(slot, n, 1, stream)
                    stream.synchronize()
                else:
                    bench_transport.fill_pattern(ring.staging_views(slot, n, 1), a.rank, index)
                    ring.commit(slot, n, 1)
                plane.enqueue(slot, [0, a.rank, index], 0, n, 1)
                index += 1
            plane.dispatch()
            if slot is None or plane.waiting:
                poller.poll(50)
        plane.end_of_data()
        deadline = time.monotonic() + 60
        while not plane.all_returned() and time.monotonic() < deadline:
            if poller.poll(100):
                for msg in channels.drain(socks.pull, rejects):
                    plane.handle(msg)
            plane.dispatch()
        routing = RoutingLog(
            max_outstanding=a.max_outstanding, decisions=[RoutedSlot(consumer=d.consumer, loads=list(d.loads)) for d in plane.routing_log]
        )
        summary = ProducerSummary(batches=plane.batches_sent, rejected=rejects.total, plane=ProducerPlaneStats.of(plane), routing=routing)
        socks.send_to_supervisor(Done(role="producer", rank=a.rank, producer=summary))
        return 0
    except Exception as e:
        socks.report_dead(e, log)
        return 1
    finally:
        if ring is not None:
            ring.close()
        socks.close()


def main() -> int:
    ap = bench_transport.process_arg_parser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--slot-bytes", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--max-outstanding", type=int, default=2)
    return run_bench_producer_process(ap.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
