"""Target process: one per target device. Wires :class:`TargetCore` to the rings and sockets.

Main loop (one iteration)::

    drain sockets (SlotFree/Load -> data plane, Shutdown -> stop)
    finished packs -> ring.commit -> data plane enqueue -> dispatch to least-busy drafter
    no captured batch?  forward the next one          (critical path)
    captured batch and a free slot?  submit the pack  (off the critical path)
    no free slot?  wait on the sockets (counted as slot wait)
    schedule empty and everything routed?  EndOfData to every drafter, then idle until Shutdown
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

import psutil
import torch
import zmq

from dflash_ipc import channels, handshake, protocol
from dflash_ipc.config import load_resolved_config
from dflash_ipc.dataplane import ProducerDataPlane
from dflash_ipc.protocol import Dead, Done, Heartbeat, Hello, RejectCounter, Shutdown
from dflash_ipc.ring import create_producer_ring
from dflash_ipc.target_core import TargetCore, read_ledger
from procs.common import apply_cpu_share, setup_child_process


def run_target_process(run_dir: Path, rank: int, forward_only: int = 0, cpus: str | None = None) -> int:
    """``forward_only`` > 0: the benchmark ceiling. No drafters; each slot is released the moment
    its pack completed, and every batch also runs once through the bare transformers stack."""
    cfg = load_resolved_config(run_dir)
    log, stop = setup_child_process("target", rank, run_dir, cfg.run.log_level)
    parent = os.getppid()
    device = torch.device(cfg.topology.targets[rank])
    n_cores = apply_cpu_share(cpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if n_cores:
            torch.set_num_threads(n_cores)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, len(cfg.topology.targets) + len(cfg.topology.drafters))))
    ctx = zmq.Context()
    dealer = channels.connect(ctx, zmq.DEALER, channels.supervisor_endpoint(run_dir), handshake.identity("target", rank))
    pull = channels.bind(ctx, zmq.PULL, channels.target_endpoint(run_dir, rank))
    rejects = RejectCounter(f"target-{rank}", log)
    core = ring = None
    pushes: list[zmq.Socket] = []
    proc = psutil.Process()
    try:
        core = TargetCore(cfg, rank, run_dir, device)
        fp = core.fast_path
        log.info("target %d: %s, layers %s; GatedDeltaNet kernels: flash-linear-attention %s, causal-conv1d %s (%s)",
                 rank, device, core.model.layer_ids, "active" if fp.get("fla") else "NOT active (slow torch fallback)",
                 "active" if fp.get("causal_conv1d") else "not active (torch conv fallback)", fp.get("implementations"))
        log.info("data: %s", core.corpus.report.summary())
        backend = resolve_backend(cfg, rank, log)
        ring = create_producer_ring(
            backend, core.layout, cfg.transport.ring_slots,
            run_id=cfg_run_id(run_dir), producer_rank=rank, device=device,
        )
        log.info("ring: %s, %d slots x %.1f MiB", ring.backend, ring.num_slots, core.layout.slot_bytes / 2**20)
        hello = Hello(role="target", rank=rank, pid=os.getpid(), device=str(device), ring=ring.descriptor(),
                      endpoint=channels.target_endpoint(run_dir, rank), info={"fla": bool(core.fast_path.get("fla")), "causal_conv1d": bool(core.fast_path.get("causal_conv1d"))})
        start = handshake.child_handshake(dealer, hello, cfg.run.handshake_timeout_s, rejects, lambda: stop.requested)
        ledger = read_ledger(start.resume.get("checkpoint"))
        core.start(ledger)
        log.info("schedule: %d batches planned, %d already consumed (ledger), %d to run", core.planned, core.skipped_ledgered, core.batches_left)
        pushes = [channels.connect(ctx, zmq.PUSH, ep) for ep in start.drafter_endpoints]
        plane = ProducerDataPlane(rank, ring, max(1, len(pushes)), cfg.transport.max_outstanding_per_drafter,
                                  lambda c, m: channels.send(pushes[c], m), rejects)
        handshake.send_ready(dealer, "target", rank)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        poller.register(dealer, zmq.POLLIN)
        # The pack already completed (observed on the host): record slot events on an idle
        # stream, never on the compute stream, or the drafter's copy would wait for the next forward.
        commit_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        captured = None
        end_sent = False
        next_beat = 0.0
        t0 = time.perf_counter()
        while not stop.requested:
            for msg in channels.drain(pull, rejects):
                plane.handle(msg)
            for msg in channels.drain(dealer, rejects):
                if isinstance(msg, Shutdown):
                    stop.set(f"shutdown: {msg.reason}")
            if os.getppid() != parent:
                stop.set("supervisor died")
            for done in core.finished_packs():
                b = done.batch
                ring.commit(done.slot, b.n_tokens, b.batch_size, commit_stream)
                if forward_only:
                    plane.table.abort_filling(done.slot)
                    continue
                plane.enqueue(done.slot, b.id.to_wire(), b.bucket, b.n_tokens, b.batch_size, {"padded_len": b.padded_len})
            if forward_only and captured is None and (core.forwards >= forward_only or core.batches_left == 0) and core.packs_in_flight == 0:
                stats = {**core.stats(), "rss_bytes": proc.memory_info().rss}
                dealer.send(protocol.encode(Done(role="target", rank=rank, summary=stats)))
                log.info("forward-only done: %s", stats)
                break
            plane.dispatch()
            waited = False
            if captured is None and not end_sent and not (forward_only and core.forwards >= forward_only):
                captured = core.forward_next()
                if forward_only and captured is not None:
                    core.bare_forward(core.last_input)
            if captured is not None:
                slot = plane.acquire()
                if slot is not None:
                    core.submit_pack(captured, slot, ring.pack_target(slot))
                    captured = None
                else:
                    w0 = time.perf_counter()
                    poller.poll(5)
                    core.slot_wait_s += time.perf_counter() - w0
                    waited = True
            if not forward_only and captured is None and core.batches_left == 0 and core.packs_in_flight == 0 and plane.waiting == 0 and not end_sent:
                plane.end_of_data()
                end_sent = True
                log.info("end of data: %d batches sent", plane.batches_sent)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + cfg.run.heartbeat_interval_s
                stats = {**core.stats(), **plane.stats(), "rss_bytes": proc.memory_info().rss, "rejected_messages": rejects.total,
                         "rejected_by_kind": dict(rejects.by_kind), "state": "done" if end_sent else "running",
                         "uptime_s": time.perf_counter() - t0}
                dealer.send(protocol.encode(Heartbeat(role="target", rank=rank, stats=stats)))
            if (end_sent or (captured is None and core.packs_in_flight)) and not waited:
                poller.poll(100 if end_sent else 2)
        log.info("stopping: %s; slots routed per drafter: %s", stop.reason, plane.router.routed_total)
        return 0
    except Exception as e:
        log.error("target failed: %s", traceback.format_exc())
        try:
            dealer.send(protocol.encode(Dead(role="target", rank=rank, error=f"{type(e).__name__}: {e}")))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        for s in pushes:
            s.close()
        if core is not None:
            core.close()
        if ring is not None:
            ring.close()
        pull.close()
        dealer.close(linger=1000)
        ctx.term()


def resolve_backend(cfg, rank: int, log) -> str:
    backend = cfg.transport.backend
    if backend != "auto":
        return backend
    if not cfg.topology.on_cuda:
        return "cpu-shm"
    from dflash_ipc.ring_cuda import choose_backend

    backend, reason = choose_backend(cfg.topology.targets[rank], cfg.topology.drafters)
    log.info("transport.backend = auto -> %s (%s)", backend, reason)
    return backend


def cfg_run_id(run_dir: Path) -> str:
    return (run_dir / "run_id").read_text().strip()


def main() -> int:
    ap = argparse.ArgumentParser(description="dflash-ipc target process (started by `dflash-ipc up`)")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--cpus", default=None, help="comma-separated CPU cores of this process (set by the supervisor)")
    ap.add_argument("--forward-only", type=int, default=0, help="benchmark: run N batches with no drafters")
    a = ap.parse_args()
    return run_target_process(Path(a.run_dir), a.rank, a.forward_only, a.cpus)


if __name__ == "__main__":
    raise SystemExit(main())
