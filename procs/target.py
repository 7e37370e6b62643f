"""Target process: one per target device. Wires :class:`~dflash_ipc.target.core.TargetCore`, its
ring and its data plane to the process's sockets, then runs :class:`~dflash_ipc.target.loop.TargetLoop`
(the loop's steps and states are drawn there)."""

from __future__ import annotations

import os

import psutil

from dflash_ipc.bench.forward_only import ForwardOnlyLoop
from dflash_ipc.bench.target_counters import TargetBenchCounters
from dflash_ipc.control import channels, handshake
from dflash_ipc.control.protocol import Hello
from dflash_ipc.control.stats import ChildInfo, FastPath
from dflash_ipc.drafter.checkpoint.verify import resume_ledger
from dflash_ipc.platform.devices import gpu_memory_text
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.child import ChildContext, run_child
from dflash_ipc.target.core import TargetCore
from dflash_ipc.target.loop import TargetLoop
from dflash_ipc.transport.dataplane import ProducerDataPlane
from dflash_ipc.transport.factory import create_producer_ring, resolve_backend


def run_target_process(argv: list[str] | None = None) -> int:
    """One target process (started by `dflash-ipc up`): the run's config, its device, its ring."""
    return run_child(
        "target",
        target_main,
        pull_endpoint=channels.target_endpoint,
        add_arguments=add_bench_arguments,
        argv=argv,
        description="dflash-ipc target process (started by `dflash-ipc up`)",
    )


def add_bench_arguments(ap) -> None:
    """What `bench pipeline` asks of a target (the supervisor's ``bench_counters`` and ``forward_only``)."""
    ap.add_argument("--bench-counters", action="store_true", help="benchmark: count steady-state figures")
    ap.add_argument("--forward-only", type=int, default=0, help="benchmark: run N batches with no drafters")


def target_main(child: ChildContext) -> int:
    cfg, rank, run_dir, device, log, socks = child.config, child.rank, child.run_dir, child.device, child.log, child.socks
    core = TargetCore(cfg, rank, run_dir, device)
    child.closing.callback(core.close)
    forward_only = child.args.forward_only
    if child.args.bench_counters or forward_only:
        core.observers.append(TargetBenchCounters(ceiling=bool(forward_only)))
    log.info("target %d: %s, layers %s; %s", rank, device, core.model.layer_ids, core.describe_kernels())
    log.info("target %d: forward %s; %s", rank, core.describe_forward(), liveness.host_memory_text(psutil.Process()))
    log.info("data: %s", core.corpus.report.summary())
    backend, why = resolve_backend(cfg.transport.backend, cfg.topology.targets[rank], cfg.topology.drafters)
    run_id = (run_dir / "run_id").read_text().strip()
    ring = create_producer_ring(
        backend, core.layout, cfg.transport.ring_slots, run_id=run_id, producer_rank=rank, device=device,
        host=cfg.run.control_host, timeout_s=cfg.run.handshake_timeout_s,
    )  # fmt: skip
    child.closing.callback(ring.close)
    child.closing.callback(core.close)  # idempotent; now before the ring: the packer thread writes into ring slots
    log.info("ring: %s (%s), %d slots x %.1f MiB", ring.backend, why, ring.num_slots, core.layout.slot_bytes / 2**20)
    fp = core.fast_path
    info = ChildInfo(fast_path=FastPath(fla=bool(fp.get("fla")), causal_conv1d=bool(fp.get("causal_conv1d"))))
    hello = Hello(
        role="target", rank=rank, pid=os.getpid(), device=str(device), ring=ring.descriptor(), endpoint=socks.pull_endpoint, info=info
    )
    start = handshake.child_handshake(
        socks.dealer, hello, cfg.run.handshake_timeout_s, child.rejects, lambda: child.stop.requested, socks.auth
    )
    core.start(resume_ledger(start.resume.checkpoint if start.resume else None, run_dir))
    log.info(
        "schedule: %d batches planned, %d already consumed (ledger), %d to run", core.planned, core.skipped_ledgered, core.batches_left
    )
    socks.connect_peers(start.drafter_endpoints, "drafter")
    plane = ProducerDataPlane(
        rank, ring, max(1, len(socks.pushes)), cfg.transport.max_outstanding_per_drafter, socks.send_to_peer, child.rejects,
        deterministic=cfg.run.deterministic,
    )  # fmt: skip
    handshake.send_ready(socks.dealer, "target", rank, socks.auth)
    child.start_heartbeats(cfg.run.heartbeat_interval_s)
    beat = cfg.run.heartbeat_interval_s
    if forward_only:  # the benchmark's ceiling: no drafters (bench/forward_only.py)
        ForwardOnlyLoop(core, ring, plane, child, heartbeat_interval_s=beat, batches=forward_only).run()
    else:
        TargetLoop(core, ring, plane, child, heartbeat_interval_s=beat).run()
    memory = liveness.host_memory_text(psutil.Process(), gpu_memory_text(device))
    log.info("stopping: %s; slots routed per drafter: %s; %s", child.stop.reason, plane.router.routed_total, memory)
    log.info("%s", core.describe_pack_overlap())
    return 0


if __name__ == "__main__":
    raise SystemExit(run_target_process())
