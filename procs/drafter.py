"""Drafter process: one per drafter device, one data-parallel rank. Joins the process group,
builds :class:`~dflash_ipc.drafter.core.DrafterCore`, warms it up (drafter.warm_up: one
forward+backward on a dummy batch, before Hello), handshakes, opens the rings, then runs
:class:`~dflash_ipc.drafter.loop.DrafterLoop` (the loop's steps and states are drawn there)."""

from __future__ import annotations

import os

import psutil

from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Hello
from dflash_ipc.control.stats import ChildInfo
from dflash_ipc.drafter.core import DrafterCore, planned_steps
from dflash_ipc.drafter.loop import DrafterLoop
from dflash_ipc.drafter.training.distributed import destroy_distributed, init_distributed
from dflash_ipc.platform.devices import gpu_memory_text
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.child import ChildContext, run_child
from dflash_ipc.runtime.resources import anchor_chunk_target_need
from dflash_ipc.transport.dataplane import ConsumerDataPlane, copy_buffers
from dflash_ipc.transport.factory import open_consumer_ring


def run_drafter_process(argv: list[str] | None = None) -> int:
    """One drafter process (started by `dflash-ipc up`): one data-parallel rank of the drafter."""
    return run_child(
        "drafter",
        drafter_main,
        pull_endpoint=channels.drafter_endpoint,
        add_arguments=lambda ap: ap.add_argument("--resume", action="store_true"),
        argv=argv,
        description="dflash-ipc drafter process (started by `dflash-ipc up`)",
        socket_linger_ms=2000,  # Done is the last thing a drafter sends: up to 2 s to leave before the sockets go
    )


def drafter_main(child: ChildContext) -> int:
    cfg, rank, run_dir, device, log, socks = child.config, child.rank, child.run_dir, child.device, child.log, child.socks
    proc = psutil.Process()
    world = init_distributed(cfg.topology.resolved_dist_backend(), timeout_s=max(600.0, cfg.run.handshake_timeout_s), device=device)
    child.closing.callback(destroy_distributed)
    total_steps = planned_steps(cfg, run_dir, world.world_size)
    target_need = anchor_chunk_target_need(cfg, device)
    core = DrafterCore(cfg, run_dir, world, device, total_steps, child.args.resume, fence=child.fence, target_need=target_need)
    child.closing.callback(core.close)
    log.info(
        "drafter %d/%d on %s: %.2fM trainable params, step %d; %s",
        rank, world.world_size, device, core.n_params / 1e6, core.step, liveness.host_memory_text(proc),
    )  # fmt: skip
    if cfg.drafter.warm_up:  # before Hello: overlaps the targets' model load, and no target waits on our first step
        took = core.warm_up()
        memory = liveness.host_memory_text(proc, gpu_memory_text(device))
        log.info("warm-up: one forward+backward on a dummy %d-token batch took %.1f s; %s", cfg.data.token_budget, took, memory)
    info = ChildInfo(resume=core.resumed_from)
    hello = Hello(role="drafter", rank=rank, pid=os.getpid(), device=str(device), endpoint=socks.pull_endpoint, info=info)
    start = handshake.child_handshake(
        socks.dealer, hello, cfg.run.handshake_timeout_s, child.rejects, lambda: child.stop.requested, socks.auth
    )
    rings = []
    for d in start.rings:
        rings.append(open_consumer_ring(d, device, consumer_rank=rank, timeout_s=cfg.run.handshake_timeout_s))
        child.closing.callback(rings[-1].close)
    socks.connect_peers(start.target_endpoints, "target")
    buffers = copy_buffers(rings, cfg.transport.drafter_in_place, cfg.transport.drafter_prefetch, device)
    plane = ConsumerDataPlane(
        rank,
        rings,
        buffers,
        socks.send_to_peer,
        child.rejects,
        in_place=cfg.transport.drafter_in_place,
        deterministic=cfg.run.deterministic,
    )
    if any(plane.reads_in_place):
        log.info("reading %d of %d rings in place (transport.drafter_in_place)", sum(plane.reads_in_place), len(rings))
    handshake.send_ready(socks.dealer, "drafter", rank, socks.auth)
    child.start_heartbeats(cfg.run.heartbeat_interval_s)
    memory = lambda: liveness.host_memory_text(proc, gpu_memory_text(device))  # noqa: E731
    DrafterLoop(core, plane, child, rank=rank, heartbeat_interval_s=cfg.run.heartbeat_interval_s, memory_text=memory).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_drafter_process())
