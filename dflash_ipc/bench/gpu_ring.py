"""The two-process GPU ring harness: one spawned producer process and one spawned consumer
process run a list of ring scenarios (:class:`~dflash_ipc.bench.gpu_wire.Scenario`).

The producer fills slots with a pattern tied to the sequence number, the consumer copies them
out with pipelined tickets, verifies on its device (every byte or samples), and returns each slot
only once its ticket is done. Every message, the ring descriptor included, is a typed struct sent
as msgpack bytes (:mod:`dflash_ipc.bench.gpu_wire`), never pickled. Returns throughput, handoff
latencies and error counts per scenario. Scenarios on device -1 use cpu-shm rings on the CPU,
so the harness itself runs (and is tested) without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
import traceback
from collections import deque

import torch

from dflash_ipc.bench.gpu_wire import (
    ChildFailed,
    ConsumerClosed,
    ConsumerDone,
    ConsumerFigures,
    EndOfSlots,
    HarnessError,
    ProducerDone,
    ProducerFigures,
    RingOpen,
    RingOpened,
    Scenario,
    ScenarioList,
    SlotFilled,
    SlotReturned,
    pack,
    recv,
    send,
    unpack,
)
from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.transport.factory import create_producer_ring, open_consumer_ring
from dflash_ipc.transport.ring import SlotStateError, SlotTable
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm
from dflash_ipc.transport.slots import SlotLayout

GIB = 1 << 30
MIB = 1 << 20


def _pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    s = sorted(vals)
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


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


def _sizes(sc: Scenario, layout: SlotLayout, seq: int) -> tuple[int, int]:
    if sc.sizes == "full":
        return layout.max_tokens, layout.max_seqs
    rng = random.Random(sc.seed * 1_000_003 + seq)
    if seq % 97 == 0:
        return layout.max_tokens, layout.max_seqs
    if seq % 89 == 0:
        return 0, 0
    return rng.randint(1, layout.max_tokens), rng.randint(1, layout.max_seqs)


def fill_slot(views, layout: SlotLayout, seq: int, base: torch.Tensor) -> None:
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


def verify_slot(views, layout: SlotLayout, seq: int, base: torch.Tensor, err: torch.Tensor, mode: str, samples: int = 4096) -> None:
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


def scenario(name: str, backend: str, producer_device: int, consumer_device: int, layout: SlotLayout, **options) -> Scenario:
    """A scenario for :func:`run_scenarios`; ``options``: the other fields of :class:`Scenario`
    (their defaults are there).

    mode "stream": the producer keeps every free slot filled, the consumer keeps up to
    ``depth`` copies in flight and returns each slot as soon as its ticket is done.
    ``producer_delay_us`` makes the producer's stream sleep before each fill, so SlotReady
    arrives before the data is written (the consumer must order its copy on the GPU).
    ``fill="none"``: the producer writes nothing (and nothing is verified): transport alone.
    mode "lockstep": one slot in flight (handoff latency). ``early_return`` (a negative
    control) returns each slot right after enqueueing its copy: the verifier must see it.
    ``in_place``: the consumer verifies each slot where it lies and returns it once an event
    after its reads completed (the drafter's same-GPU path, transport/dataplane.py)."""
    if options.get("fill") == "none":
        options["verify"] = "none"
    if "producer_delay_us" in options:
        options["producer_delay_us"] = float(options["producer_delay_us"])
    return Scenario(name, backend, producer_device, consumer_device, layout.to_wire(), **options)


def handoff_scenario(backend: str, producer_device: int, consumer_device: int, *, iters: int = 2000) -> Scenario:
    """Tiny (4 KiB) slots, one in flight: commit -> copy complete at the consumer, and round trip."""
    return scenario(
        f"handoff {backend} cuda:{producer_device}->cuda:{consumer_device}",
        backend,
        producer_device,
        consumer_device,
        SlotLayout(1, 1024, 4, 1, "uint8"),
        num_slots=2,
        iters=iters,
        warmup=50,
        mode="lockstep",
        verify="full",
    )


# --------------------------------------------------------------------------- producer side


def _produce(sc: Scenario, conn, rank: int) -> ProducerFigures:
    dev = _device(sc.producer_device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout = SlotLayout.from_wire(sc.layout)
    run_id = new_run_id()
    t0 = time.perf_counter()
    ring = create_producer_ring(sc.backend, layout, sc.num_slots, run_id=run_id, producer_rank=rank, device=dev)
    try:
        create_s = time.perf_counter() - t0
        ring.attach_consumers(1)
        send(conn, RingOpen(ring.descriptor()))
        recv(conn, RingOpened, timeout=120)
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        base = torch.arange(max(layout.max_tokens, layout.max_seqs), dtype=torch.int64, device=dev)
        table = SlotTable(ring.num_slots)
        iters = sc.iters
        max_out = 1 if sc.mode == "lockstep" else ring.num_slots
        delay_cycles = int(sc.producer_delay_us * 1500)  # >= 1.5 GHz SM clock
        fill = sc.fill != "none"
        sent_ns: dict[int, int] = {}
        rt_ns: list[int] = []
        commit_ns: list[int] = []
        stray = 0

        def take_free(m: SlotReturned) -> None:
            nonlocal stray
            try:
                table.release(m.slot, 0)
            except SlotStateError:
                stray += 1
                return
            ring.slot_returned(m.slot)
            rt_ns.append(time.perf_counter_ns() - sent_ns.pop(m.seq))

        seq = 0
        while seq < iters or sent_ns:
            can_issue = seq < iters and len(sent_ns) < max_out
            slot = table.acquire() if can_issue else None
            if slot is None:
                take_free(recv(conn, SlotReturned, timeout=120))
                continue
            n, b = _sizes(sc, layout, seq)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if delay_cycles and stream is not None:
                    torch.cuda._sleep(delay_cycles)  # the fill is still queued when SlotReady arrives
                views = ring.staging_views(slot, n, b)
                if fill:
                    fill_slot(views, layout, seq, base)
            c0 = time.perf_counter_ns()
            ring.commit(slot, n, b, stream)
            c1 = time.perf_counter_ns()
            commit_ns.append(c1 - c0)
            table.publish(slot, 0)
            sent_ns[seq] = c0
            send(conn, SlotFilled(slot=slot, seq=seq, n_tokens=n, n_seqs=b, committed_ns=c0))
            ring.hand_over(slot, 0, n, b)
            seq += 1
            # Take any SlotFree already here before filling the next slot.
            while conn.poll(0):
                take_free(recv(conn, SlotReturned))
        send(conn, EndOfSlots())
        consumer = recv(conn, ConsumerClosed, timeout=120).figures  # the consumer closed its ring: now the producer may free it
    finally:
        ring.close()
        if BACKENDS[sc.backend].ring_memory == "host":
            sweep_run_shm(run_id)
    return ProducerFigures(
        create_s=create_s,
        stray_frees=stray,
        commit_us_p50=(_pct(commit_ns, 50) or 0) / 1e3,
        roundtrip_us_p50=(_pct(rt_ns, 50) or 0) / 1e3,
        roundtrip_us_p99=(_pct(rt_ns, 99) or 0) / 1e3,
        consumer=consumer,
    )


# --------------------------------------------------------------------------- consumer side


def _consume(sc: Scenario, conn) -> None:
    opened = recv(conn, RingOpen, timeout=120)
    dev = _device(sc.consumer_device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    ring = open_consumer_ring(opened.descriptor, dev, consumer_rank=0)
    open_s = time.perf_counter() - t0
    layout = ring.layout
    depth = 1 if sc.mode == "lockstep" else sc.depth
    dsts = [torch.zeros(layout.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(depth)]
    dst_free: list[torch.cuda.Event | None] = [None] * depth
    vstream = torch.cuda.current_stream(dev) if cuda else None
    base = torch.arange(max(layout.max_tokens, layout.max_seqs), dtype=torch.int64, device=dev)
    err = torch.zeros((), dtype=torch.int64, device=dev)
    _sync(dev)
    send(conn, RingOpened())
    inflight: deque = deque()
    done_t: list[int] = []
    done_bytes: list[int] = []
    handoff_ns: list[int] = []
    issue_ns: list[int] = []
    count = 0
    end_seen = False
    early = sc.early_return
    verify = sc.verify

    def retire(item, wait: bool) -> None:
        ticket, slot, seq, nbytes, t_prod = item
        if wait:
            ticket.wait()
        now = time.perf_counter_ns()
        done_t.append(now)
        done_bytes.append(nbytes)
        handoff_ns.append(now - t_prod)
        if not early:
            send(conn, SlotReturned(slot=slot, seq=seq))

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
        m = recv(conn, SlotFilled, EndOfSlots, timeout=120)
        if isinstance(m, EndOfSlots):
            end_seen = True
            continue
        k = count % depth
        count += 1
        d = dsts[k]
        n, b = m.n_tokens, m.n_seqs
        i0 = time.perf_counter_ns()
        if sc.in_place:
            views = ring.read_in_place(m.slot, n, b)  # the current stream waits on the producer's event
            if verify != "none":
                verify_slot(views, layout, m.seq, base, err, verify)
            ticket = ring.reads_done(m.slot)  # the slot goes back once the reads above are done
            issue_ns.append(time.perf_counter_ns() - i0)
            item = (ticket, m.slot, m.seq, sum(x for _, x in layout.used_ranges(n, b)), m.committed_ns)
            inflight.append(item)
            continue
        if cuda and ring.backend != "nccl":
            ticket = ring.copy_out(m.slot, n, b, d, after=dst_free[k])
        else:
            ticket = ring.copy_out(m.slot, n, b, d)
        issue_ns.append(time.perf_counter_ns() - i0)
        item = (ticket, m.slot, m.seq, sum(x for _, x in layout.used_ranges(n, b)), m.committed_ns)
        if sc.mode == "lockstep":
            retire(item, True)  # handoff: copy complete, SlotFree sent; verification follows
        else:
            inflight.append(item)
        if early:
            send(conn, SlotReturned(slot=m.slot, seq=m.seq))
        if verify != "none" and cuda:
            ticket.stream_wait(vstream)
            with torch.cuda.stream(vstream):
                verify_slot(layout.views(d, n, b), layout, m.seq, base, err, verify)
            ev = torch.cuda.Event()
            ev.record(vstream)
            dst_free[k] = ev
        elif verify != "none":
            ticket.wait()  # host rings copy before copy_out returns; an nccl ring over gloo receives in the background
            verify_slot(layout.views(d, n, b), layout, m.seq, base, err, verify)
    _sync(dev)
    errors = int(err.item())
    ring.close()
    del dsts, dst_free
    if cuda:
        torch.cuda.empty_cache()
    copy_mode = getattr(ring, "copy_mode", ring.backend)
    send(conn, ConsumerClosed(_consumer_figures(sc, copy_mode, open_s, errors, done_t, done_bytes, handoff_ns, issue_ns)))


def _consumer_figures(
    sc: Scenario,
    copy_mode: str,
    open_s: float,
    errors: int,
    done_t: list[int],
    done_bytes: list[int],
    handoff_ns: list[int],
    issue_ns: list[int],
) -> ConsumerFigures:
    """The consumer's figures: throughput from the first slot done after ``sc.warmup`` to the last, and
    the handoff's percentiles past the warm-up."""
    w = min(sc.warmup, max(0, len(done_t) - 2))
    gbps = None
    if len(done_t) - w >= 2:
        dt = (done_t[-1] - done_t[w]) / 1e9
        gbps = sum(done_bytes[w + 1 :]) / dt / 1e9 if dt > 0 else None
    hand = handoff_ns[w:]
    return ConsumerFigures(
        copy_mode=copy_mode,
        open_s=open_s,
        slots=len(done_t),
        bytes=sum(done_bytes),
        errors=errors,
        gbps=gbps,
        handoff_us_p50=(_pct(hand, 50) or 0) / 1e3,
        handoff_us_p99=(_pct(hand, 99) or 0) / 1e3,
        copy_out_call_us_p50=(_pct(issue_ns, 50) or 0) / 1e3,
    )


# --------------------------------------------------------------------------- processes


def _producer_main(peer, parent, scenarios_packed: bytes) -> None:
    try:
        scenarios = unpack(scenarios_packed, ScenarioList).scenarios
        send(parent, ProducerDone([_produce(sc, peer, rank=k) for k, sc in enumerate(scenarios)]))
    except BaseException:
        send(parent, ChildFailed(traceback.format_exc()))
        raise


def _consumer_main(peer, parent, scenarios_packed: bytes) -> None:
    try:
        for sc in unpack(scenarios_packed, ScenarioList).scenarios:
            _consume(sc, peer)
        send(parent, ConsumerDone())
    except BaseException:
        send(parent, ChildFailed(traceback.format_exc()))
        raise


@contextlib.contextmanager
def environ(env: dict | None):
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


def spawn_context():
    import torch.multiprocessing as tmp

    return tmp.get_context("spawn")


def stop_processes(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=30)


def run_scenarios(scenarios: list[Scenario], *, env: dict | None = None, timeout: float = 300.0) -> list[dict]:
    """Run scenarios in one spawned producer process and one spawned consumer process.

    Returns one flat result dict per scenario (the scenario, producer and consumer figures).
    Raises HarnessError with the child's traceback if either side fails, TimeoutError past timeout."""
    ctx = spawn_context()
    a, b = ctx.Pipe(duplex=True)
    pp, pc = ctx.Pipe(duplex=True)
    cp, cc = ctx.Pipe(duplex=True)
    packed = pack(ScenarioList(list(scenarios)))
    prod = ctx.Process(target=_producer_main, args=(a, pc, packed), daemon=True, name="ring-producer")
    cons = ctx.Process(target=_consumer_main, args=(b, cc, packed), daemon=True, name="ring-consumer")
    with environ(env):
        prod.start()
        cons.start()
    deadline = time.monotonic() + timeout
    got: dict[str, ProducerDone | ConsumerDone] = {}
    try:
        while len(got) < 2:
            for name, conn, proc, want in (("producer", pp, prod, ProducerDone), ("consumer", cp, cons, ConsumerDone)):
                if name in got:
                    continue
                if conn.poll(0.05):
                    msg = recv(conn, want, ChildFailed)
                    if isinstance(msg, ChildFailed):
                        raise HarnessError(f"ring {name} failed:\n{msg.error}")
                    got[name] = msg
                elif not proc.is_alive() and not conn.poll(0):
                    raise HarnessError(f"ring {name} exited with {proc.exitcode} without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ring scenarios did not finish in {timeout} s (done: {sorted(got)})")
        prod.join(timeout=60)
        cons.join(timeout=60)
    finally:
        stop_processes([prod, cons])
    out = []
    for sc, r in zip(scenarios, got["producer"].results, strict=True):
        figures = dataclasses.asdict(r)
        consumer = figures.pop("consumer")
        out.append(
            {
                "name": sc.name,
                "backend": sc.backend,
                "producer_device": sc.producer_device,
                "consumer_device": sc.consumer_device,
                "slot_bytes": SlotLayout.from_wire(sc.layout).slot_bytes,
                "num_slots": sc.num_slots,
                "iters": sc.iters,
                "depth": sc.depth,
                "mode": sc.mode,
                **figures,
                **consumer,
            }
        )
    return out


def in_place_check(backend: str = "cuda-ipc", device: int = 0, timeout: float = 80.0) -> list[dict]:
    """Slots read in place on the producer's own device, every byte verified: two slots overwritten the
    instant either returns, then fills that land after their SlotReady. Returns the two results;
    ``ok`` says each kept every byte and returned every slot once."""
    layout = SlotLayout(num_planes=3, hidden_size=512, max_tokens=2048, max_seqs=16, plane_dtype="bfloat16")
    opts = dict(warmup=0, depth=2, sizes="random", verify="full", in_place=True)
    scenarios = [
        scenario("in-place race", backend, device, device, layout, num_slots=2, iters=300, **opts),
        scenario("in-place delayed", backend, device, device, layout, num_slots=3, iters=150, producer_delay_us=300, **opts),
    ]
    results = run_scenarios(scenarios, timeout=timeout)
    for r in results:
        r["ok"] = r["errors"] == 0 and r["stray_frees"] == 0 and r["slots"] == r["iters"]
    return results
