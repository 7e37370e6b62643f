"""Drafter process: one per drafter device. Wires :class:`DrafterCore` to the rings and sockets.

Start: join the process group, build the core, warm up (drafter.warm_up: one forward+backward on a
dummy batch, before Hello), handshake, open the rings, Ready.

Main loop::

    drain sockets (SlotReady/EndOfData -> data plane, Shutdown -> stop at the next boundary)
    pump copies out of the rings (SlotFree goes back the moment a copy completed)
    have a batch, or nothing more can come, or a stop was requested?  -> one lockstep step
    otherwise wait on the sockets (counted as slot wait)
    finish: checkpoint, export (rank 0), Done -> supervisor
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import torch

from dflash_ipc.config import load_resolved_config
from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Done, Heartbeat, Hello, RejectCounter
from dflash_ipc.control.stats import ChildInfo, DrafterStats, DrafterSummary, Vitals
from dflash_ipc.devices import gpu_memory_text
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.distributed import destroy_distributed, init_distributed
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.child import ChildContext, Placement, run_child
from dflash_ipc.transport.dataplane import ConsumerDataPlane
from dflash_ipc.transport.factory import open_consumer_ring


def run_drafter_process(argv: list[str] | None = None) -> int:
    """One drafter process (started by `dflash-ipc up`): one data-parallel rank of the drafter."""
    # Done is the last thing a drafter sends; give it up to 2 s to leave before the sockets go.
    return run_child(
        "drafter",
        drafter_main,
        place=_placement,
        pull_endpoint=channels.drafter_endpoint,
        add_arguments=_add_arguments,
        argv=argv,
        description="dflash-ipc drafter process (started by `dflash-ipc up`)",
        socket_linger_ms=2000,
    )


def _add_arguments(ap) -> None:
    ap.add_argument("--resume", action="store_true")


def _placement(args) -> Placement:
    cfg = load_resolved_config(Path(args.run_dir))
    return Placement(
        cfg.topology.drafters[args.rank],
        len(cfg.topology.targets) + len(cfg.topology.drafters),
        cfg.run.log_level,
        cfg,
        compile_threads=cfg.run.compile_threads,
    )


def drafter_main(child: ChildContext) -> int:
    cfg, rank, run_dir, device = child.config, child.rank, child.run_dir, child.device
    log, stop, socks, rejects = child.log, child.stop, child.socks, child.rejects
    proc = psutil.Process()
    world = init_distributed(cfg.topology.resolved_dist_backend(), timeout_s=max(600.0, cfg.run.handshake_timeout_s), device=device)
    child.closing.callback(destroy_distributed)
    plan = json.loads((run_dir / "plan.json").read_text())
    total_steps = cfg.training.max_steps or max(1, -(-plan["n_batches_total"] // world.world_size))
    core = DrafterCore(cfg, run_dir, world, device, total_steps, child.args.resume)
    child.closing.callback(core.close)
    log.info(
        "drafter %d/%d on %s: %.2fM trainable params, step %d; %s",
        rank, world.world_size, device, core.n_params / 1e6, core.step, liveness.host_memory_text(proc),
    )  # fmt: skip
    if cfg.drafter.warm_up:  # before Hello: overlaps the targets' model load, and no target waits on our first step
        took = core.warm_up()
        memory = liveness.host_memory_text(proc, gpu_memory_text(device))
        log.info("warm-up: one forward+backward on a dummy %d-token batch took %.1f s; %s", cfg.data.token_budget, took, memory)
    hello = Hello(
        role="drafter",
        rank=rank,
        pid=os.getpid(),
        device=str(device),
        endpoint=socks.pull_endpoint,
        info=ChildInfo(resume=core.resumed_from),
    )
    start = handshake.child_handshake(socks.dealer, hello, cfg.run.handshake_timeout_s, rejects, lambda: stop.requested, socks.auth)
    rings = []
    for d in start.rings:
        rings.append(open_consumer_ring(d, device, consumer_rank=rank, timeout_s=cfg.run.handshake_timeout_s))
        child.closing.callback(rings[-1].close)
    socks.connect_peers(start.target_endpoints, "target")
    slot_bytes = max(r.layout.slot_bytes for r in rings)
    buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(cfg.transport.drafter_prefetch + 1)]
    plane = ConsumerDataPlane(rank, rings, buffers, socks.send_to_peer, rejects)
    handshake.send_ready(socks.dealer, "drafter", rank, socks.auth)
    poller = socks.poller()
    max_steps = cfg.training.max_steps
    every = cfg.training.checkpoint_every
    next_beat = 0.0
    wait_s = 0.0
    wait_total = 0.0
    t0 = time.perf_counter()
    finish_reason = "data exhausted"
    stopped_on_request = False
    # A resumed run that already reached max_steps trains nothing more (systemd restarts it).
    while not (max_steps and core.step >= max_steps):
        for sender, msg in socks.drain_peers(rejects):
            plane.handle(msg, sender)
        child.read_control()
        plane.pump()
        batch = plane.take()
        if batch is not None and batch.msg.holdout:  # drafter 0 only; local, no collective, never trained on
            core.evaluate_holdout(batch.views, batch.msg.batch_id, batch.msg.holdout_pass_batches)
            plane.release(batch)
            continue
        if batch is None and not plane.all_ended() and not stop.requested:
            w0 = time.perf_counter()
            if plane.copying:
                plane.wait_for_copy()
            else:
                poller.poll(20)
            dt = time.perf_counter() - w0
            wait_s += dt
            wait_total += dt
        else:
            any_batch, any_stop = core.trainer.agree(batch is not None, stop.requested)
            if any_stop or not any_batch:
                if batch is not None:
                    plane.release(batch)  # not trained on: stays out of the ledger
                stopped_on_request = any_stop  # agreed: the same on every rank
                if any_stop and not stop.requested:
                    # A peer saw the supervisor's Shutdown first; ours is a moment behind.
                    deadline = time.monotonic() + 2.0
                    while not stop.requested and time.monotonic() < deadline:
                        child.read_control(wait_ms=50)
                finish_reason = (stop.reason or "stop requested (seen by another drafter)") if any_stop else "data exhausted"
                break
            copy_s = batch.copy_s if batch is not None else 0.0
            core.train_step(batch.views if batch else None, batch.msg.batch_id if batch else None, wait_s, copy_s)
            wait_s = 0.0
            if batch is not None:
                plane.release(batch)
            if every and core.step % every == 0:
                core.checkpoint(f"every {every} steps")
            if max_steps and core.step >= max_steps:
                break
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + cfg.run.heartbeat_interval_s
            stats = drafter_stats(core, plane, proc, rejects, time.perf_counter() - t0, wait_total)
            socks.send_to_supervisor(Heartbeat(role="drafter", rank=rank, drafter=stats))
    if max_steps and core.step >= max_steps:
        finish_reason = f"max_steps {max_steps}"
    memory = liveness.host_memory_text(proc, gpu_memory_text(device))
    log.info("finishing at step %d: %s; batches received per target: %s; %s", core.step, finish_reason, plane.slots_done, memory)
    # Collective: every rank takes the same branch (stopped_on_request was agreed).
    ckpt = core.checkpoint(finish_reason) if (cfg.training.checkpoint_on_finish or stopped_on_request) else None
    export = core.export() if cfg.training.export_on_finish else None
    core.write_rank_record()
    final = drafter_stats(core, plane, proc, rejects, time.perf_counter() - t0, wait_total, state="done")
    summary = DrafterSummary(final, finish_reason, str(ckpt) if ckpt else None, str(export) if export else None)
    socks.send_to_supervisor(Done(role="drafter", rank=rank, drafter=summary))
    return 0


def drafter_stats(
    core: DrafterCore,
    plane: ConsumerDataPlane,
    proc: psutil.Process,
    rejects: RejectCounter,
    elapsed: float,
    wait_total: float,
    state: str = "running",
) -> DrafterStats:
    return DrafterStats(
        Vitals.measure(state, elapsed, proc, rejects),
        core.stats(),
        queue_depth=len(plane.ready) + len(plane.held),
        outstanding=plane.outstanding,
        copying=len(plane.copying),
        wait_pct=100.0 * wait_total / max(1e-9, elapsed),
        slots_per_target=list(plane.slots_done),
    )


if __name__ == "__main__":
    raise SystemExit(run_drafter_process())
