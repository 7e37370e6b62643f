"""GPU transport measurements and the two-process ring harness used by the GPU tests.

* :func:`measure_reference_gbps` — raw ``copy_`` between two devices in one process (CUDA
  events, median of repeats): the ceiling a ring is compared with.
* :func:`measure_pinned_reference_gbps` — pinned D2H / H2D in one process (host-pinned ceiling).
* :func:`run_scenarios` — one producer process and one consumer process (``spawn``) run a list
  of ring scenarios over a ``multiprocessing.Pipe``: every message, the ring descriptor
  included, travels as msgpack bytes (``send_bytes``), never pickled. The producer fills
  slots with a pattern tied to the sequence number, the consumer copies them out with
  pipelined tickets, verifies on its GPU (every byte or samples), and returns each slot only
  once its ticket is done. Returns throughput, handoff latencies and error counts.
* :func:`measure_ring` — one throughput scenario; :func:`measure_handoff` — tiny slots, one
  in flight; :func:`run_sigkill_check` — a consumer killed with SIGKILL while holding the
  ring's mappings must not keep the producer from closing and releasing its GPU memory.

CLI: ``python -m dflash_ipc.bench.gpu_harness [--out results.json] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import sys
import time
import traceback
from collections import deque

import msgpack
import torch

from dflash_ipc.control.protocol import from_wire, to_wire
from dflash_ipc.control.ring_descriptor import RingDescriptor, SlotLayoutWire
from dflash_ipc.devices import as_device, cuda_device
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.ring import SlotStateError, SlotTable
from dflash_ipc.transport.shm import new_run_id, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

GIB = 1 << 30
MIB = 1 << 20


# --------------------------------------------------------------------------- wire


def _send(conn, msg: dict) -> None:
    conn.send_bytes(msgpack.packb(to_wire(msg), use_bin_type=True))


def _recv(conn, timeout: float | None = None) -> dict:
    if timeout is not None and not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    return msgpack.unpackb(conn.recv_bytes(), raw=False)


def _pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


# --------------------------------------------------------------------------- references


def measure_reference_gbps(src_dev, dst_dev, nbytes: int, *, repeats: int = 10, warmup: int = 3) -> float:
    """GB/s (1e9 bytes/s) of ``dst.copy_(src)`` of ``nbytes`` between two devices in one process.

    Timed with CUDA events on the copy's stream (the source device's current stream; host
    memory is pinned when one side is the CPU); median of ``repeats``."""
    src_dev, dst_dev = (cuda_device(d) if as_device(d).type == "cuda" else as_device(d) for d in (src_dev, dst_dev))
    nbytes = int(nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev, pin_memory=src_dev.type == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev, pin_memory=dst_dev.type == "cpu")
    src.fill_(7)
    timing_dev = src_dev if src_dev.type == "cuda" else dst_dev
    stream = torch.cuda.current_stream(timing_dev)
    times = []
    with torch.cuda.device(timing_dev):
        for r in range(warmup + repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            if r >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def measure_pinned_reference_gbps(dev, nbytes: int, *, repeats: int = 5) -> dict:
    """Pinned D2H and H2D GB/s of one device; ``min`` is the host-pinned ring's ceiling."""
    d2h = measure_reference_gbps(dev, "cpu", nbytes, repeats=repeats, warmup=1)
    h2d = measure_reference_gbps("cpu", dev, nbytes, repeats=repeats, warmup=1)
    return {"d2h": d2h, "h2d": h2d, "min": min(d2h, h2d)}


# --------------------------------------------------------------------------- layouts & patterns


def layout_for_bytes(nbytes: int) -> SlotLayout:
    """A one-plane uint8 layout whose planes hold ``nbytes`` (token regions stay small)."""
    hidden = 65536 if nbytes >= 64 * MIB else 1024
    tokens = max(1, int(nbytes) // hidden)
    return SlotLayout(num_planes=1, hidden_size=hidden, max_tokens=tokens, max_seqs=1, plane_dtype="uint8")


def _device(index: int) -> torch.device:
    """Scenario devices: a CUDA index, or -1 for the CPU (cpu-shm; lets the harness run without a GPU)."""
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pattern_byte(seq: int) -> int:
    return (seq * 131 + 7) % 251 + 1  # never 0: fresh (zeroed) memory never passes


def _sizes(sc: dict, layout: SlotLayout, seq: int) -> tuple[int, int]:
    if sc.get("sizes", "full") == "full":
        return layout.max_tokens, layout.max_seqs
    rng = random.Random(int(sc.get("seed", 0)) * 1_000_003 + seq)
    if seq % 97 == 0:
        return layout.max_tokens, layout.max_seqs
    if seq % 89 == 0:
        return 0, 0
    return rng.randint(1, layout.max_tokens), rng.randint(1, layout.max_seqs)


def _fill(views, layout: SlotLayout, seq: int, base: torch.Tensor) -> None:
    n = views.token_ids.numel()
    b = views.seq_lens.numel()
    val = pattern_byte(seq)
    if n:
        pb = views.planes.view(torch.uint8) if views.planes.dtype != torch.uint8 else views.planes
        for p in range(layout.num_planes):
            pb[p].fill_((val + p) % 256)
        torch.add(base[:n], seq << 20, out=views.token_ids)
        views.loss_mask.copy_(torch.bitwise_and(base[:n] + seq, 1).to(torch.uint8))
    if b:
        views.seq_lens.copy_((base[:b] + seq).to(torch.int32))


def _verify(views, layout: SlotLayout, seq: int, base: torch.Tensor, err: torch.Tensor, mode: str, samples: int = 4096) -> None:
    """Accumulate mismatches into ``err`` on the GPU (no host sync)."""
    n = views.token_ids.numel()
    b = views.seq_lens.numel()
    val = pattern_byte(seq)
    if n:
        pb = views.planes.view(torch.uint8) if views.planes.dtype != torch.uint8 else views.planes
        if mode == "full":
            for p in range(layout.num_planes):
                err += (pb[p] != (val + p) % 256).sum()
        else:
            flat = pb.reshape(-1)
            per_plane = flat.numel() // layout.num_planes
            idx = torch.randint(0, flat.numel(), (samples,), device=flat.device)
            idx[0] = 0
            idx[1] = flat.numel() - 1
            exp = ((idx // per_plane) + val) % 256
            err += (flat[idx].to(torch.int64) != exp).sum()
        err += (views.token_ids != base[:n] + (seq << 20)).sum()
        err += (views.loss_mask != torch.bitwise_and(base[:n] + seq, 1).to(torch.uint8)).sum()
    if b:
        err += (views.seq_lens != (base[:b] + seq).to(torch.int32)).sum()


def scenario(
    name: str,
    backend: str,
    producer_device: int,
    consumer_device: int,
    layout: SlotLayout,
    *,
    num_slots: int = 4,
    iters: int = 100,
    warmup: int = 5,
    depth: int = 3,
    mode: str = "stream",
    sizes: str = "full",
    verify: str = "sample",
    early_return: bool = False,
    seed: int = 0,
    producer_delay_us: float = 0.0,
    fill: str = "pattern",
) -> dict:
    """A scenario for :func:`run_scenarios` (a plain dict).

    mode "stream": the producer keeps every free slot filled, the consumer keeps up to
    ``depth`` copies in flight and returns each slot as soon as its ticket is done.
    ``producer_delay_us`` makes the producer's stream sleep before each fill, so SlotReady
    arrives before the data is written (the consumer must order its copy on the GPU).
    ``fill="none"``: the producer writes nothing (and nothing is verified): transport alone.
    mode "lockstep": one slot in flight (handoff latency). ``early_return`` (a negative
    control) returns each slot right after enqueueing its copy: the verifier must see it."""
    return {
        "name": name,
        "backend": backend,
        "producer_device": int(producer_device),
        "consumer_device": int(consumer_device),
        "layout": to_wire(layout.to_wire()),
        "num_slots": int(num_slots),
        "iters": int(iters),
        "warmup": int(warmup),
        "depth": int(depth),
        "mode": mode,
        "sizes": sizes,
        "verify": verify,
        "early_return": bool(early_return),
        "seed": int(seed),
        "producer_delay_us": float(producer_delay_us),
        "fill": fill,
        **({"verify": "none"} if fill == "none" else {}),
    }


# --------------------------------------------------------------------------- producer side


def _produce(sc: dict, conn, rank: int) -> dict:
    dev = _device(sc["producer_device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = SlotLayout.from_wire(from_wire(SlotLayoutWire, sc["layout"]))
    run_id = new_run_id()
    t0 = time.perf_counter()
    ring = create_producer_ring(sc["backend"], layout, sc["num_slots"], run_id=run_id, producer_rank=rank, device=dev)
    try:
        create_s = time.perf_counter() - t0
        _send(conn, {"t": "ring", "desc": ring.descriptor()})
        m = _recv(conn, 120)
        if m["t"] != "opened":
            raise RuntimeError(f"expected opened, got {m}")
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        base = torch.arange(max(layout.max_tokens, layout.max_seqs), dtype=torch.int64, device=dev)
        table = SlotTable(ring.num_slots)
        iters = sc["iters"]
        max_out = 1 if sc["mode"] == "lockstep" else ring.num_slots
        delay_cycles = int(sc.get("producer_delay_us", 0) * 1500)  # >= 1.5 GHz SM clock
        fill = sc.get("fill", "pattern") != "none"
        sent_ns: dict[int, int] = {}
        rt_ns: list[int] = []
        commit_ns: list[int] = []
        stray = 0

        def take_free(m: dict) -> None:
            nonlocal stray
            if m["t"] != "free":
                raise RuntimeError(f"expected free, got {m}")
            try:
                table.release(m["slot"], 0)
            except SlotStateError:
                stray += 1
                return
            rt_ns.append(time.perf_counter_ns() - sent_ns.pop(m["seq"]))

        seq = 0
        while seq < iters or sent_ns:
            can_issue = seq < iters and len(sent_ns) < max_out
            slot = table.acquire() if can_issue else None
            if slot is None:
                take_free(_recv(conn, 120))
                continue
            n, b = _sizes(sc, layout, seq)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if delay_cycles and stream is not None:
                    torch.cuda._sleep(delay_cycles)  # the fill is still queued when SlotReady arrives
                views = ring.staging_views(slot, n, b)
                if fill:
                    _fill(views, layout, seq, base)
            c0 = time.perf_counter_ns()
            ring.commit(slot, n, b, stream)
            c1 = time.perf_counter_ns()
            commit_ns.append(c1 - c0)
            table.publish(slot, 0)
            sent_ns[seq] = c0
            _send(conn, {"t": "ready", "slot": slot, "seq": seq, "n": n, "b": b, "t0": c0})
            seq += 1
            # Take any SlotFree already here before filling the next slot.
            while conn.poll(0):
                take_free(_recv(conn))
        _send(conn, {"t": "end"})
        m = _recv(conn, 120)  # the consumer closed its ring: now the producer may free it
        if m["t"] != "closed":
            raise RuntimeError(f"expected closed, got {m}")
        consumer = m["result"]
    finally:
        ring.close()
        if sc["backend"] in ("host-pinned", "cpu-shm"):
            sweep_run_shm(run_id)
    return {
        "create_s": create_s,
        "stray_frees": stray,
        "commit_us_p50": (_pct(commit_ns, 50) or 0) / 1e3,
        "roundtrip_us_p50": (_pct(rt_ns, 50) or 0) / 1e3,
        "roundtrip_us_p99": (_pct(rt_ns, 99) or 0) / 1e3,
        **consumer,
    }


# --------------------------------------------------------------------------- consumer side


def _consume(sc: dict, conn) -> dict:
    m = _recv(conn, 120)
    if m["t"] != "ring":
        raise RuntimeError(f"expected ring, got {m}")
    dev = _device(sc["consumer_device"])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    ring = open_consumer_ring(from_wire(RingDescriptor, m["desc"]), dev)
    open_s = time.perf_counter() - t0
    layout = ring.layout
    depth = 1 if sc["mode"] == "lockstep" else max(1, sc["depth"])
    dsts = [torch.zeros(layout.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(depth)]
    dst_free: list[torch.cuda.Event | None] = [None] * depth
    vstream = torch.cuda.current_stream(dev) if cuda else None
    base = torch.arange(max(layout.max_tokens, layout.max_seqs), dtype=torch.int64, device=dev)
    err = torch.zeros((), dtype=torch.int64, device=dev)
    _sync(dev)
    _send(conn, {"t": "opened"})
    inflight: deque = deque()
    done_t: list[int] = []
    done_bytes: list[int] = []
    handoff_ns: list[int] = []
    issue_ns: list[int] = []
    count = 0
    end_seen = False
    early = sc["early_return"]
    verify = sc["verify"]

    def retire(item, wait: bool) -> None:
        ticket, slot, seq, nbytes, t_prod = item
        if wait:
            ticket.wait()
        now = time.perf_counter_ns()
        done_t.append(now)
        done_bytes.append(nbytes)
        handoff_ns.append(now - t_prod)
        if not early:
            _send(conn, {"t": "free", "slot": slot, "seq": seq})

    while True:
        while inflight and inflight[0][0].done():
            retire(inflight.popleft(), False)
        if end_seen and not inflight:
            break
        if len(inflight) >= depth or (end_seen and inflight):
            retire(inflight.popleft(), True)
            continue
        if inflight and not conn.poll(0):
            continue  # spin: poll the tickets and the pipe
        m = _recv(conn, 120)
        if m["t"] == "end":
            end_seen = True
            continue
        if m["t"] != "ready":
            raise RuntimeError(f"expected ready, got {m}")
        k = count % depth
        count += 1
        d = dsts[k]
        n, b = m["n"], m["b"]
        i0 = time.perf_counter_ns()
        if cuda:
            ticket = ring.copy_out(m["slot"], n, b, d, after=dst_free[k])
        else:
            ticket = ring.copy_out(m["slot"], n, b, d)
        issue_ns.append(time.perf_counter_ns() - i0)
        item = (ticket, m["slot"], m["seq"], sum(x for _, x in layout.used_ranges(n, b)), m["t0"])
        if sc["mode"] == "lockstep":
            retire(item, True)  # handoff: copy complete, SlotFree sent; verification follows
        else:
            inflight.append(item)
        if early:
            _send(conn, {"t": "free", "slot": m["slot"], "seq": m["seq"]})
        if verify != "none" and cuda:
            vstream.wait_event(ticket.event)
            with torch.cuda.stream(vstream):
                _verify(layout.views(d, n, b), layout, m["seq"], base, err, verify)
            ev = torch.cuda.Event()
            ev.record(vstream)
            dst_free[k] = ev
        elif verify != "none":
            _verify(layout.views(d, n, b), layout, m["seq"], base, err, verify)
    _sync(dev)
    errors = int(err.item())
    ring.close()
    del dsts, dst_free
    if cuda:
        torch.cuda.empty_cache()
    w = min(sc["warmup"], max(0, len(done_t) - 2))
    gbps = None
    if len(done_t) - w >= 2:
        dt = (done_t[-1] - done_t[w]) / 1e9
        gbps = sum(done_bytes[w + 1 :]) / dt / 1e9 if dt > 0 else None
    hand = handoff_ns[w:]
    result = {
        "copy_mode": getattr(ring, "copy_mode", ring.backend),
        "open_s": open_s,
        "slots": len(done_t),
        "bytes": sum(done_bytes),
        "errors": errors,
        "gbps": gbps,
        "handoff_us_p50": (_pct(hand, 50) or 0) / 1e3,
        "handoff_us_p99": (_pct(hand, 99) or 0) / 1e3,
        "copy_out_call_us_p50": (_pct(issue_ns, 50) or 0) / 1e3,
    }
    _send(conn, {"t": "closed", "result": result})
    return result


# --------------------------------------------------------------------------- processes


def _producer_main(peer, parent, scenarios_packed: bytes) -> None:
    try:
        scenarios = msgpack.unpackb(scenarios_packed, raw=False)
        results = []
        for k, sc in enumerate(scenarios):
            r = _produce(sc, peer, rank=k)
            results.append(r)
        _send(parent, {"ok": True, "results": results})
    except BaseException:
        _send(parent, {"ok": False, "error": traceback.format_exc()})
        raise


def _consumer_main(peer, parent, scenarios_packed: bytes) -> None:
    try:
        scenarios = msgpack.unpackb(scenarios_packed, raw=False)
        for sc in scenarios:
            _consume(sc, peer)
        _send(parent, {"ok": True})
    except BaseException:
        _send(parent, {"ok": False, "error": traceback.format_exc()})
        raise


@contextlib.contextmanager
def _environ(env: dict | None):
    """Temporarily set environment variables (inherited by processes spawned inside)."""
    old = {}
    try:
        for k, v in (env or {}).items():
            old[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _mp():
    import torch.multiprocessing as tmp

    return tmp.get_context("spawn")


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=30)


def run_scenarios(scenarios: list[dict], *, env: dict | None = None, timeout: float = 300.0) -> list[dict]:
    """Run scenarios in one spawned producer process and one spawned consumer process.

    Returns one merged result dict per scenario (producer and consumer figures). Raises
    RuntimeError with the child's traceback if either side fails, TimeoutError past timeout."""
    ctx = _mp()
    a, b = ctx.Pipe(duplex=True)
    pp, pc = ctx.Pipe(duplex=True)
    cp, cc = ctx.Pipe(duplex=True)
    packed = msgpack.packb(scenarios, use_bin_type=True)
    prod = ctx.Process(target=_producer_main, args=(a, pc, packed), daemon=True, name="ring-producer")
    cons = ctx.Process(target=_consumer_main, args=(b, cc, packed), daemon=True, name="ring-consumer")
    with _environ(env):
        prod.start()
        cons.start()
    deadline = time.monotonic() + timeout
    got: dict[str, dict] = {}
    try:
        while len(got) < 2:
            for name, conn, proc in (("producer", pp, prod), ("consumer", cp, cons)):
                if name in got:
                    continue
                if conn.poll(0.05):
                    msg = _recv(conn)
                    if not msg["ok"]:
                        raise RuntimeError(f"ring {name} failed:\n{msg['error']}")
                    got[name] = msg
                elif not proc.is_alive() and not conn.poll(0):
                    raise RuntimeError(f"ring {name} exited with {proc.exitcode} without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ring scenarios did not finish in {timeout} s (done: {sorted(got)})")
        prod.join(timeout=60)
        cons.join(timeout=60)
    finally:
        _stop([prod, cons])
    out = []
    for sc, r in zip(scenarios, got["producer"]["results"]):
        out.append({"name": sc["name"], "backend": sc["backend"], "producer_device": sc["producer_device"],
                    "consumer_device": sc["consumer_device"], "slot_bytes": SlotLayout.from_wire(from_wire(SlotLayoutWire, sc["layout"])).slot_bytes,
                    "num_slots": sc["num_slots"], "iters": sc["iters"], "depth": sc["depth"], "mode": sc["mode"], **r})
    return out


def measure_ring(backend: str, producer_device: int, consumer_device: int, slot_bytes: int, *, num_slots: int = 4,
                 iters: int = 100, warmup: int = 10, depth: int = 3, env: dict | None = None) -> dict:
    """Two-process ring throughput (GB/s over the steady-state slots) with sampled verification."""
    sc = scenario(f"{backend} {slot_bytes >> 20} MiB cuda:{producer_device}->cuda:{consumer_device}", backend,
                  producer_device, consumer_device, layout_for_bytes(slot_bytes), num_slots=num_slots, iters=iters,
                  warmup=warmup, depth=depth)
    return run_scenarios([sc], env=env)[0]


def measure_handoff(backend: str, producer_device: int, consumer_device: int, *, iters: int = 2000, env: dict | None = None) -> dict:
    """Tiny (4 KiB) slots, one in flight: commit -> copy complete at the consumer, and round trip."""
    sc = handoff_scenario(backend, producer_device, consumer_device, iters=iters)
    return run_scenarios([sc], env=env)[0]


def handoff_scenario(backend: str, producer_device: int, consumer_device: int, *, iters: int = 2000) -> dict:
    return scenario(f"handoff {backend} cuda:{producer_device}->cuda:{consumer_device}", backend, producer_device,
                    consumer_device, SlotLayout(1, 1024, 4, 1, "uint8"), num_slots=2, iters=iters, warmup=50,
                    mode="lockstep", verify="full")


# --------------------------------------------------------------------------- SIGKILL check


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
        _send(peer, {"t": "ring", "desc": ring.descriptor()})
        base = torch.arange(layout.max_tokens, dtype=torch.int64, device=dev)
        stream = torch.cuda.Stream(dev)
        for slot in range(num_slots):
            with torch.cuda.stream(stream):
                _fill(ring.staging_views(slot, layout.max_tokens, 1), layout, slot, base)
            ring.commit(slot, layout.max_tokens, 1, stream)
            _send(peer, {"t": "ready", "slot": slot, "seq": slot, "n": layout.max_tokens, "b": 1})
        m = _recv(peer, 120)
        if m["t"] != "copied":
            raise RuntimeError(f"expected copied, got {m}")
        _send(parent, {"t": "holding", "free0": free0, "free1": free1, "ring_bytes": ring_bytes, "consumer_errors": m["errors"]})
        m = _recv(parent, 300)
        if m["t"] != "close":
            raise RuntimeError(f"expected close, got {m}")
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
        _send(parent, {"t": "closed", "free_before_close": free2, "free_after_close": free3, "close_s": close_s,
                       "released_bytes": free3 - free2})
    except BaseException:
        _send(parent, {"t": "error", "error": traceback.format_exc()})
        raise


def _kill_consumer_main(peer, parent, device: int) -> None:
    try:
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)
        m = _recv(peer, 120)
        ring = open_consumer_ring(from_wire(RingDescriptor, m["desc"]), dev)
        layout = ring.layout
        err = torch.zeros((), dtype=torch.int64, device=dev)
        base = torch.arange(layout.max_tokens, dtype=torch.int64, device=dev)
        dsts, tickets = [], []
        for _ in range(ring.num_slots):
            m = _recv(peer, 120)
            d = torch.empty(layout.slot_bytes, dtype=torch.uint8, device=dev)
            tickets.append(ring.copy_out(m["slot"], m["n"], m["b"], d))
            dsts.append((d, m))
        for t in tickets:
            t.wait()
        for d, m in dsts:
            _verify(layout.views(d, m["n"], m["b"]), layout, m["seq"], base, err, "full")
        errors = int(err.item())
        _send(peer, {"t": "copied", "errors": errors})
        _send(parent, {"t": "holding", "pid": os.getpid(), "errors": errors})
        # Hold the mappings (and a copy still queued on the ring stream) until SIGKILL.
        ring.copy_out(0, layout.max_tokens, 1, dsts[0][0])
        time.sleep(3600)
    except BaseException:
        _send(parent, {"t": "error", "error": traceback.format_exc()})
        raise


def run_sigkill_check(producer_device: int, consumer_device: int, *, slot_bytes: int = 256 * MIB, num_slots: int = 4,
                      env: dict | None = None, timeout: float = 180.0) -> dict:
    """Kill a consumer with SIGKILL while it holds the ring's mappings; then close the producer's
    ring. Returns the producer's free-memory readings, its exit code and the consumer's."""
    ctx = _mp()
    a, b = ctx.Pipe(duplex=True)
    pp, pc = ctx.Pipe(duplex=True)
    cp, cc = ctx.Pipe(duplex=True)
    prod = ctx.Process(target=_kill_producer_main, args=(a, pc, producer_device, slot_bytes, num_slots), daemon=True)
    cons = ctx.Process(target=_kill_consumer_main, args=(b, cc, consumer_device), daemon=True)
    with _environ(env):
        prod.start()
        cons.start()
    try:
        def expect(conn, what, proc):
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if conn.poll(0.1):
                    m = _recv(conn)
                    if m["t"] == "error":
                        raise RuntimeError(f"{what} failed:\n{m['error']}")
                    return m
                if not proc.is_alive():
                    raise RuntimeError(f"{what} exited with {proc.exitcode}")
            raise TimeoutError(f"no message from {what} in {timeout} s")

        c_hold = expect(cp, "consumer", cons)
        p_hold = expect(pp, "producer", prod)
        os.kill(c_hold["pid"], signal.SIGKILL)
        cons.join(timeout=30)
        time.sleep(0.5)
        _send(pp, {"t": "close"})
        closed = expect(pp, "producer", prod)
        prod.join(timeout=60)
        return {**p_hold, **closed, "consumer_copy_errors": c_hold["errors"], "consumer_exitcode": cons.exitcode,
                "producer_exitcode": prod.exitcode}
    finally:
        _stop([prod, cons])


# --------------------------------------------------------------------------- CLI


def run_bench(quick: bool = False, progress=print) -> dict:
    """Reference copies and ring throughput / handoff on this host (GPU 0 produces)."""
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("no CUDA device")
    other = 1 if n > 1 else 0
    out: dict = {"torch": torch.__version__, "devices": [torch.cuda.get_device_name(i) for i in range(n)],
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if n > 1:
        out["peer_access"] = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
        from dflash_ipc.transport.factory import choose_backend

        out["auto"] = list(choose_backend(0, [1]))
    ref = {}
    for size, label in ((GIB, "1GiB"), (256 * MIB, "256MiB")):
        ref[f"peer_{label}"] = measure_reference_gbps(0, other, size)
        ref[f"same_{label}"] = measure_reference_gbps(0, 0, size)
        progress(f"[ref] {label}: cuda:0->cuda:{other} {ref[f'peer_{label}']:.1f} GB/s, cuda:0->cuda:0 {ref[f'same_{label}']:.1f} GB/s")
    pin = measure_pinned_reference_gbps(0, 256 * MIB)
    pin1 = measure_pinned_reference_gbps(other, 256 * MIB)
    ref["pinned_256MiB"] = {"d2h_0": pin["d2h"], "h2d_0": pin["h2d"], "d2h_other": pin1["d2h"], "h2d_other": pin1["h2d"],
                            "min": min(pin["d2h"], pin1["h2d"])}
    progress(f"[ref] pinned 256 MiB: D2H {pin['d2h']:.1f}, H2D(other) {pin1['h2d']:.1f} GB/s")
    out["reference_gbps"] = ref
    it = (lambda x: max(20, x // 4)) if quick else (lambda x: x)
    scs = [
        scenario("cuda-ipc 1GiB other", "cuda-ipc", 0, other, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10),
        scenario("cuda-ipc 256MiB other", "cuda-ipc", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20),
        scenario("cuda-ipc 1GiB same", "cuda-ipc", 0, 0, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10),
        scenario("cuda-ipc 256MiB same", "cuda-ipc", 0, 0, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20),
        scenario("host-pinned 256MiB other", "host-pinned", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=it(60), warmup=5),
        scenario("cuda-ipc 256MiB other nofill", "cuda-ipc", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400),
                 warmup=20, fill="none"),
        scenario("cuda-ipc 1GiB same nofill", "cuda-ipc", 0, 0, layout_for_bytes(GIB), num_slots=4, iters=it(150), warmup=10, fill="none"),
        scenario("cuda-ipc 256MiB same nofill", "cuda-ipc", 0, 0, layout_for_bytes(256 * MIB), num_slots=4, iters=it(400), warmup=20,
                 fill="none"),
        handoff_scenario("cuda-ipc", 0, other, iters=it(2000)),
        handoff_scenario("cuda-ipc", 0, 0, iters=it(2000)),
        handoff_scenario("host-pinned", 0, other, iters=it(1000)),
    ]
    rings = run_scenarios(scs, timeout=500)
    for r in rings:
        if r["mode"] == "stream":
            label = "1GiB" if r["slot_bytes"] >= GIB else "256MiB"
            if r["backend"] == "cuda-ipc":
                refv = ref[("peer_" if r["consumer_device"] != r["producer_device"] else "same_") + label]
            else:
                refv = ref["pinned_256MiB"]["min"]
            r["reference_gbps"] = refv
            r["ratio"] = r["gbps"] / refv if r["gbps"] and refv else None
            progress(f"[ring] {r['name']} ({r['copy_mode']}): {r['gbps']:.1f} GB/s ({100 * (r['ratio'] or 0):.1f}% of {refv:.1f}), "
                     f"{r['slots']} slots, errors {r['errors']}, open {r['open_s'] * 1e3:.0f} ms")
        else:
            progress(f"[handoff] {r['name']} ({r['copy_mode']}): commit->copied p50 {r['handoff_us_p50']:.0f} us p99 {r['handoff_us_p99']:.0f} us, "
                     f"round trip p50 {r['roundtrip_us_p50']:.0f} us p99 {r['roundtrip_us_p99']:.0f} us, errors {r['errors']}")
    out["rings"] = rings
    if n > 1 and not quick:
        variants = {
            "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            "push": {"DFLASH_IPC_CUDA_COPY": "push"},
        }
        for key, env in variants.items():
            scs2 = [
                scenario(f"cuda-ipc 1GiB other {key}", "cuda-ipc", 0, other, layout_for_bytes(GIB), num_slots=4, iters=100, warmup=10),
                scenario(f"cuda-ipc 256MiB other {key}", "cuda-ipc", 0, other, layout_for_bytes(256 * MIB), num_slots=4, iters=300, warmup=20),
            ]
            if key == "push":
                scs2.append(handoff_scenario("cuda-ipc", 0, other, iters=1000))
            rs2 = run_scenarios(scs2, env=env, timeout=300)
            for r in rs2:
                if r["mode"] != "stream":
                    progress(f"[handoff] {r['name']} {key} ({r['copy_mode']}): commit->copied p50 {r['handoff_us_p50']:.0f} us "
                             f"p99 {r['handoff_us_p99']:.0f} us, errors {r['errors']}")
                    continue
                refv = ref["peer_1GiB" if r["slot_bytes"] >= GIB else "peer_256MiB"]
                r["reference_gbps"] = refv
                r["ratio"] = r["gbps"] / refv if r["gbps"] else None
                progress(f"[ring] {r['name']} ({r['copy_mode']}): {r['gbps']:.1f} GB/s ({100 * (r['ratio'] or 0):.1f}% of {refv:.1f}), "
                         f"errors {r['errors']}")
            out[f"rings_{key}"] = rs2
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    a = ap.parse_args(argv)
    res = run_bench(quick=a.quick)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
