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

import os
import time
from pathlib import Path

import psutil
import torch

from dflash_ipc.config import load_resolved_config
from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Done, Heartbeat, Hello
from dflash_ipc.control.stats import ChildInfo, FastPath, ProducerPlaneStats, TargetStats, TargetWork, Vitals
from dflash_ipc.devices import gpu_memory_text
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.child import ChildContext, Placement, run_child
from dflash_ipc.target.core import TargetCore, read_ledger
from dflash_ipc.transport.dataplane import ProducerDataPlane
from dflash_ipc.transport.factory import create_producer_ring


def run_target_process(argv: list[str] | None = None) -> int:
    """One target process (started by `dflash-ipc up`): the run's config, its device, its ring."""
    return run_child(
        "target",
        target_main,
        place=_placement,
        pull_endpoint=channels.target_endpoint,
        add_arguments=_add_arguments,
        argv=argv,
        description="dflash-ipc target process (started by `dflash-ipc up`)",
    )


def _add_arguments(ap) -> None:
    ap.add_argument("--forward-only", type=int, default=0, help="benchmark: run N batches with no drafters")


def _placement(args) -> Placement:
    cfg = load_resolved_config(Path(args.run_dir))
    return Placement(
        cfg.topology.targets[args.rank],
        len(cfg.topology.targets) + len(cfg.topology.drafters),
        cfg.run.log_level,
        cfg,
        compile_threads=cfg.run.compile_threads,
    )


def target_main(child: ChildContext) -> int:
    """``--forward-only N`` > 0: the benchmark ceiling. No drafters; each slot is released the moment
    its pack completed, and every batch also runs once through the bare transformers stack."""
    cfg, rank, run_dir, device = child.config, child.rank, child.run_dir, child.device
    log, stop, socks, rejects = child.log, child.stop, child.socks, child.rejects
    forward_only = child.args.forward_only
    proc = psutil.Process()
    core = TargetCore(cfg, rank, run_dir, device)
    child.closing.callback(core.close)
    fp = core.fast_path
    if fp.get("gated_delta_net_layers"):
        log.info(
            "target %d: %s, layers %s; GatedDeltaNet kernels: flash-linear-attention %s, causal-conv1d %s (%s)",
            rank,
            device,
            core.model.layer_ids,
            "active" if fp.get("fla") else "NOT active (slow torch fallback)",
            "active" if fp.get("causal_conv1d") else "not active (torch conv fallback)",
            fp.get("implementations"),
        )
    else:  # e.g. a Llama target: no linear-attention layers, so no kernels to report
        log.info(
            "target %d: %s, layers %s; %s, attention %s",
            rank,
            device,
            core.model.layer_ids,
            type(core.model.stack).__name__,
            cfg.target.attn_implementation,
        )
    log.info(
        "target %d: forward %s (%s); %s",
        rank, "packed (varlen)" if core.model.varlen else "padded", core.model.varlen_reason, liveness.host_memory_text(proc),
    )  # fmt: skip
    log.info("data: %s", core.corpus.report.summary())
    backend = resolve_backend(cfg, rank, log)
    ring = create_producer_ring(
        backend,
        core.layout,
        cfg.transport.ring_slots,
        run_id=cfg_run_id(run_dir),
        producer_rank=rank,
        device=device,
        host=cfg.run.control_host,
        timeout_s=cfg.run.handshake_timeout_s,
    )
    child.closing.callback(ring.close)
    # Closed again (it is idempotent), now before the ring: the packer thread writes into ring slots.
    child.closing.callback(core.close)
    log.info("ring: %s, %d slots x %.1f MiB", ring.backend, ring.num_slots, core.layout.slot_bytes / 2**20)
    hello = Hello(
        role="target",
        rank=rank,
        pid=os.getpid(),
        device=str(device),
        ring=ring.descriptor(),
        endpoint=socks.pull_endpoint,
        info=ChildInfo(fast_path=FastPath(fla=bool(fp.get("fla")), causal_conv1d=bool(fp.get("causal_conv1d")))),
    )
    start = handshake.child_handshake(socks.dealer, hello, cfg.run.handshake_timeout_s, rejects, lambda: stop.requested, socks.auth)
    ledger = read_ledger(start.resume.checkpoint if start.resume else None)
    core.start(ledger)
    log.info(
        "schedule: %d batches planned, %d already consumed (ledger), %d to run", core.planned, core.skipped_ledgered, core.batches_left
    )
    socks.connect_peers(start.drafter_endpoints, "drafter")
    plane = ProducerDataPlane(rank, ring, max(1, len(socks.pushes)), cfg.transport.max_outstanding_per_drafter, socks.send_to_peer, rejects)
    handshake.send_ready(socks.dealer, "target", rank, socks.auth)
    poller = socks.poller()
    # The pack already completed (observed on the host): record slot events on an idle
    # stream, never on the compute stream, or the drafter's copy would wait for the next forward.
    commit_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    captured = None
    end_sent = False
    next_beat = 0.0
    t0 = time.perf_counter()
    while not stop.requested:
        for sender, msg in socks.drain_peers(rejects):
            plane.handle(msg, sender)
        child.read_control()
        for done in core.finished_packs():
            b = done.batch
            ring.commit(done.slot, b.n_tokens, b.batch_size, commit_stream)
            if forward_only:
                plane.table.abort_filling(done.slot)
                continue
            meta = {"padded_len": b.padded_len}
            plane.enqueue(done.slot, done.wire_id, b.bucket, b.n_tokens, b.batch_size, meta, done.holdout_pass_batches)
        if forward_only and captured is None and (core.forwards >= forward_only or core.batches_left == 0) and core.packs_in_flight == 0:
            stats = TargetStats(
                Vitals.measure("done", time.perf_counter() - t0, proc, rejects), core.stats(final=True), ProducerPlaneStats.of(plane)
            )
            socks.send_to_supervisor(Done(role="target", rank=rank, target=stats))
            log.info("forward-only done: %s", stats)
            break
        plane.dispatch()
        waited = False
        if captured is None and not end_sent and not (forward_only and core.forwards >= forward_only):
            captured = core.forward_next(bare_baseline=bool(forward_only))
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
        if (
            not forward_only
            and captured is None
            and core.batches_left == 0
            and core.packs_in_flight == 0
            and plane.waiting == 0
            and not end_sent
        ):
            plane.end_of_data()
            end_sent = True
            log.info("end of data: %d batches sent", plane.batches_sent)
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + cfg.run.heartbeat_interval_s
            vitals = Vitals.measure("done" if end_sent else "running", time.perf_counter() - t0, proc, rejects)
            stats = TargetStats(vitals, core.stats(), ProducerPlaneStats.of(plane))
            socks.send_to_supervisor(Heartbeat(role="target", rank=rank, target=stats))
        if captured is None and not waited:
            # Nothing to forward: waiting for packs, for credit to route, or for Shutdown.
            poller.poll(100 if end_sent else 2)
    memory = liveness.host_memory_text(proc, gpu_memory_text(device))
    log.info("stopping: %s; slots routed per drafter: %s; %s", stop.reason, plane.router.routed_total, memory)
    _log_pack_overlap(log, core.stats(final=True))
    return 0


def resolve_backend(cfg, rank: int, log) -> str:
    backend = cfg.transport.backend
    if backend != "auto":
        return backend
    if not cfg.topology.on_cuda:
        return "cpu-shm"
    from dflash_ipc.transport.factory import choose_backend

    backend, reason = choose_backend(cfg.topology.targets[rank], cfg.topology.drafters)
    log.info("transport.backend = auto -> %s (%s)", backend, reason)
    return backend


def cfg_run_id(run_dir: Path) -> str:
    return (run_dir / "run_id").read_text().strip()


def _log_pack_overlap(log, stats: TargetWork) -> None:
    log.info(
        "forward %.1f ms/batch; pack %.2f ms/batch off the critical path, %.1f%% of it while a forward ran "
        "(exposed %.2f ms/batch over %d packs); handing a batch to the packer took %.2f ms",
        stats.forward_ms,
        stats.pack_ms,
        stats.pack_overlap_pct,
        stats.pack_exposed_ms,
        stats.packs_measured,
        stats.pack_submit_ms,
    )


if __name__ == "__main__":
    raise SystemExit(run_target_process())
