"""`dflash-ipc bench transport`: real producer and consumer processes move real data.

Three measurements in one invocation:

1. **ring**: P producer processes fill slots of their ring with a pattern tied to the batch id,
   C consumer processes copy each slot out, verify every element, return it. Routing is the
   product's least-busy router over the product's ZeroMQ + msgpack control plane.
2. **baseline**: the naive path a user would write — each batch a fresh tensor sent through a
   ``torch.multiprocessing`` queue (on GPU: staged through pinned host memory), consumers
   copy it into their buffer and verify it the same way.
3. **handoff**: the ring again with tiny (4 KiB) slots; ``handoff_us`` is the control-plane
   latency from the producer's send of SlotReady to the consumer's receipt
   (CLOCK_MONOTONIC is shared by all processes of a host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.control import channels, handshake, protocol
from dflash_ipc.control.protocol import Done, RejectCounter
from dflash_ipc.runtime.forkserver import ForkServer, popen_with
from dflash_ipc.runtime.launch import child_env
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

BENCH_HIDDEN = 1024


def bench_layout(slot_bytes: int) -> SlotLayout:
    """A one-plane float32 layout whose planes take ~slot_bytes."""
    tokens = max(1, slot_bytes // (BENCH_HIDDEN * 4))
    return SlotLayout(num_planes=1, hidden_size=BENCH_HIDDEN, max_tokens=tokens, max_seqs=1, plane_dtype="float32")


def pattern_value(producer: int, index: int) -> float:
    # Exactly representable in float32 and distinct for consecutive batches of any producer.
    return float((producer * 7919 + index * 31 + 1) % 65521)


def fill_pattern(views, producer: int, index: int) -> None:
    views.planes.fill_(pattern_value(producer, index))
    views.token_ids.fill_(index)
    views.token_ids[0] = producer
    views.loss_mask.fill_(1)
    views.seq_lens.fill_(views.token_ids.numel())


def verify_pattern(views, producer: int, index: int) -> bool:
    v = pattern_value(producer, index)
    ok = bool(torch.all(views.planes == v))
    ok &= int(views.token_ids[0]) == producer
    if views.token_ids.numel() > 1:
        ok &= bool(torch.all(views.token_ids[1:] == index))
    return ok


@dataclass
class BenchArgs:
    backend: str = "cpu-shm"
    producers: int = 2
    consumers: int = 2
    slots: int = 4
    slot_mib: float = 64
    seconds: float = 5.0
    slow_consumer: int | None = None
    slow_ms: float = 0.0
    producer_device: str = "cpu"
    consumer_device: str = "cpu"
    max_outstanding: int = 2
    prefetch: int = 1


def process_arg_parser() -> argparse.ArgumentParser:
    """The arguments of both bench processes (procs/bench_producer.py, procs/bench_consumer.py), as
    :func:`run_ring` writes them; each process adds its own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--backend", default="cpu-shm")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    return ap


#: What a ring process imports at start, imported once by the fork server of a CPU-only bench.
RING_PRELOAD = ("torch", "zmq", "msgpack", "dflash_ipc.procs.bench_producer", "dflash_ipc.procs.bench_consumer")


def on_cpu_only(args: BenchArgs) -> bool:
    """Every process of the bench on the CPU: its processes fork from a preloaded server (as `up`'s do
    on such a topology, runtime.forkserver) instead of each a new Python importing torch; a CUDA device
    keeps exec, the path validated on GPUs."""
    return args.producer_device == "cpu" and args.consumer_device == "cpu"


def ring_launcher(args: BenchArgs) -> ForkServer | None:
    """A started fork server for the ring processes when :func:`on_cpu_only`, else None (exec). Close it."""
    return ForkServer.start(RING_PRELOAD, child_env()) if on_cpu_only(args) else None


def _spawn(launcher: ForkServer | None, module: str, argv: list[str], run_dir: Path, name: str) -> Any:
    with open(run_dir / "logs" / f"{name}.log", "w") as log:  # the child holds its own descriptor
        return popen_with(launcher, [sys.executable, "-m", module, *argv], stdout=log, stderr=subprocess.STDOUT, env=child_env())


def run_ring(args: BenchArgs, slot_bytes: int, seconds: float, launcher: ForkServer | None = None) -> dict:
    """One ring measurement with real processes (forked from ``launcher``, or from a server of its own
    when :func:`on_cpu_only`); returns the merged summaries."""
    own = ring_launcher(args) if launcher is None else None
    try:
        return _run_ring(args, slot_bytes, seconds, launcher or own)
    finally:
        if own is not None:
            own.close()


def _run_ring(args: BenchArgs, slot_bytes: int, seconds: float, launcher: ForkServer | None) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    os.chmod(run_dir, 0o700)
    (run_dir / "logs").mkdir()
    channels.prepare_socket_dir(run_dir)
    run_id = new_run_id()
    ctx = zmq.Context()
    router = channels.bind(ctx, zmq.ROUTER, channels.supervisor_endpoint(run_dir))
    procs: dict[tuple[str, int], Any] = {}
    finished = False  # on failure the run directory (its logs) stays for diagnosis
    common = ["--run-dir", str(run_dir), "--backend", args.backend, "--producers", str(args.producers), "--consumers", str(args.consumers)]
    try:
        for p in range(args.producers):
            procs[("producer", p)] = _spawn(
                launcher,
                "dflash_ipc.procs.bench_producer",
                common
                + [
                    "--rank",
                    str(p),
                    "--run-id",
                    run_id,
                    "--slots",
                    str(args.slots),
                    "--slot-bytes",
                    str(slot_bytes),
                    "--seconds",
                    str(seconds),
                    "--device",
                    args.producer_device,
                    "--max-outstanding",
                    str(args.max_outstanding),
                ],
                run_dir,
                f"producer-{p}",
            )
        for c in range(args.consumers):
            slow = args.slow_ms if args.slow_consumer == c else 0.0
            procs[("consumer", c)] = _spawn(
                launcher,
                "dflash_ipc.procs.bench_consumer",
                common + ["--rank", str(c), "--slow-ms", str(slow), "--device", args.consumer_device, "--prefetch", str(args.prefetch)],
                run_dir,
                f"consumer-{c}",
            )
        rejects = RejectCounter("bench")

        def dead() -> str | None:
            for (role, rank), pr in procs.items():
                if pr.poll() is not None:
                    return f"{role}-{rank} exited with {pr.returncode} (log: {run_dir}/logs/{role}-{rank}.log)"
            return None

        handshake.coordinate(router, list(procs), timeout_s=120, rejects=rejects, is_alive=dead, setting="bench start-up (120 s)")
        t0 = time.perf_counter()
        summaries: dict[tuple[str, int], Any] = {}
        deadline = time.monotonic() + seconds + 120
        while len(summaries) < len(procs):
            if time.monotonic() > deadline:
                raise RuntimeError("bench did not finish in time")
            if router.poll(200):
                ident, frame = router.recv_multipart()
                msg = channels.decode_or_reject(frame, rejects)
                if isinstance(msg, Done):
                    summaries[(msg.role, msg.rank)] = msg.summary
                elif isinstance(msg, protocol.Dead):
                    raise RuntimeError(f"{msg.role}-{msg.rank} died: {msg.error}")
            elif (d := dead()) and not all(k in summaries for k, p in procs.items() if p.poll() is not None):
                raise RuntimeError(d)
        wall = time.perf_counter() - t0
        for pr in procs.values():
            pr.wait(timeout=60)
        finished = True
        return {"summaries": summaries, "wall_s": wall}
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        router.close()
        ctx.term()
        sweep_run_shm(run_id)
        if finished:
            shutil.rmtree(run_dir, ignore_errors=True)


def _ring_result(res: dict, args: BenchArgs) -> dict:
    cons = [res["summaries"][("consumer", c)] for c in range(args.consumers)]
    bytes_total = sum(c.bytes for c in cons)
    active_s = max(c.active_s for c in cons)
    handoff = sorted(x for c in cons for x in c.handoff_ns)
    return {
        "gbps": bytes_total / active_s / 1e9 if active_s > 0 else 0.0,
        "slots_total": sum(c.slots for c in cons),
        "per_consumer_slots": [c.slots for c in cons],
        "verified": all(c.verified for c in cons) and sum(c.slots for c in cons) > 0,
        "rejected": sum(c.rejected for c in cons),
        "handoff_ns": handoff,
    }


def _percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


# --------------------------------------------------------------------------- baseline


def _baseline_producer(q, finished, rank: int, tokens: int, seconds: float, consumers: int, device: str):
    torch.set_num_threads(1)
    layout = bench_layout(tokens * BENCH_HIDDEN * 4)
    end = time.monotonic() + seconds
    index = 0
    while time.monotonic() < end:
        t = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=device)
        fill_pattern(layout.views(t, layout.max_tokens, 1), rank, index)
        if t.is_cuda:
            t = t.cpu()  # the naive GPU path stages through host memory
        q.put((rank, index, t))
        index += 1
    for _ in range(consumers):
        q.put(None)
    # torch shares each tensor through a file descriptor this process serves: stay until read.
    finished.wait(timeout=seconds + 300)


def _baseline_consumer(q, out, rank: int, tokens: int, producers: int, device: str):
    torch.set_num_threads(1)
    layout = bench_layout(tokens * BENCH_HIDDEN * 4)
    dst = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=device)
    n = 0
    ok = True
    nbytes = 0
    ends = 0
    t0 = None
    while ends < producers:
        item = q.get()
        if item is None:
            ends += 1
            continue
        if t0 is None:
            t0 = time.perf_counter()
        p, index, t = item
        dst.copy_(t)
        ok &= verify_pattern(layout.views(dst, layout.max_tokens, 1), p, index)
        nbytes += sum(b for _, b in layout.used_ranges(layout.max_tokens, 1))
        n += 1
        del t
    out.put({"rank": rank, "slots": n, "bytes": nbytes, "verified": ok, "active_s": time.perf_counter() - (t0 or time.perf_counter())})


def run_baseline(args: BenchArgs, slot_bytes: int, seconds: float) -> dict:
    import torch.multiprocessing as tmp

    # on_cpu_only: forked from multiprocessing's fork server, which imports torch once for all of them
    # (each a new Python importing torch costs seconds of CPU); the figure times the queue, not start-up
    if on_cpu_only(args):
        ctx = tmp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", __name__])
    else:
        ctx = tmp.get_context("spawn")
    q = ctx.Queue(maxsize=args.slots)
    out = ctx.Queue()
    finished = ctx.Event()
    tokens = bench_layout(slot_bytes).max_tokens
    prods = [
        ctx.Process(target=_baseline_producer, args=(q, finished, p, tokens, seconds, args.consumers, args.producer_device))
        for p in range(args.producers)
    ]
    cons = [
        ctx.Process(target=_baseline_consumer, args=(q, out, c, tokens, args.producers, args.consumer_device))
        for c in range(args.consumers)
    ]
    for pr in prods + cons:
        pr.start()
    results = []
    deadline = time.monotonic() + seconds + 300
    try:
        while len(results) < len(cons):
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                dead = [p for p in prods + cons if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"baseline processes failed (exit codes {[p.exitcode for p in prods + cons]})") from None
    finally:
        finished.set()
        for pr in prods + cons:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    bytes_total = sum(r["bytes"] for r in results)
    active = max(r["active_s"] for r in results)
    return {
        "gbps": bytes_total / active / 1e9 if active > 0 else 0.0,
        "verified": all(r["verified"] for r in results),
        "slots": sum(r["slots"] for r in results),
    }


# --------------------------------------------------------------------------- entry


def _handoff(args: BenchArgs, launcher: ForkServer | None, progress) -> dict:
    """Control-plane cost alone: one producer, one consumer, one slot in flight (a ping-pong), so
    the latency is send -> wake -> decode, not time spent queued behind other slots' copies."""
    tiny = BenchArgs(
        **{
            **args.__dict__,
            "slot_mib": 4 / 1024,
            "slow_consumer": None,
            "seconds": min(2.0, args.seconds),
            "producers": 1,
            "consumers": 1,
            "slots": 2,
            "max_outstanding": 1,
        }
    )
    progress("[bench] handoff: 4 KiB slots, one in flight")
    return _ring_result(run_ring(tiny, 4096, tiny.seconds, launcher), tiny)


def run_transport_bench(args: BenchArgs, progress=print) -> dict:
    slot_bytes = int(args.slot_mib * (1 << 20))
    layout = bench_layout(slot_bytes)
    progress(
        f"[bench] ring: backend={args.backend} producers={args.producers} consumers={args.consumers} slots={args.slots}"
        f" slot={layout.slot_bytes / 2**20:.1f} MiB, {args.seconds:g} s"
    )
    launcher = ring_launcher(args)  # one server for both ring measurements
    try:
        ring = _ring_result(run_ring(args, slot_bytes, args.seconds, launcher), args)
        progress(f"[bench] ring: {ring['gbps']:.2f} GB/s, per consumer {ring['per_consumer_slots']}, verified={ring['verified']}")
        progress(f"[bench] baseline: torch.multiprocessing queue, {args.seconds:g} s")
        base = run_baseline(args, slot_bytes, args.seconds)
        progress(f"[bench] baseline: {base['gbps']:.2f} GB/s, verified={base['verified']}")
        hand = _handoff(args, launcher, progress)
    finally:
        if launcher is not None:
            launcher.close()
    result = {
        "backend": args.backend,
        "producers": args.producers,
        "consumers": args.consumers,
        "slots": args.slots,
        "slot_bytes": layout.slot_bytes,
        "seconds": args.seconds,
        "gbps": round(ring["gbps"], 3),
        "baseline": "torch.multiprocessing.Queue of fresh tensors"
        + (" staged through host memory" if args.producer_device != "cpu" else ""),
        "baseline_gbps": round(base["gbps"], 3),
        "ratio": round(ring["gbps"] / base["gbps"], 3) if base["gbps"] > 0 else None,
        "handoff_us_p50": round(_percentile(hand["handoff_ns"], 50) / 1e3, 1),
        "handoff_us_p99": round(_percentile(hand["handoff_ns"], 99) / 1e3, 1),
        "handoff_slots": hand["slots_total"],
        "per_consumer_slots": ring["per_consumer_slots"],
        "slow_consumer": args.slow_consumer,
        "rejected_messages": ring["rejected"],
        "verified": bool(ring["verified"] and base["verified"] and hand["verified"]),
    }
    if BACKENDS[args.backend].devices != "cpu" and args.producer_device != "cpu" and torch.cuda.is_available():
        from dflash_ipc.bench.gpu_suite import measure_reference_gbps

        ref = measure_reference_gbps(args.producer_device, args.consumer_device, layout.planes_bytes)
        result["reference_gbps"] = round(ref, 3)
        result["ratio_to_reference"] = round(ring["gbps"] / ref, 4) if ref > 0 else None
    return result


def main_json(result: dict) -> str:
    return json.dumps(result, sort_keys=False)
