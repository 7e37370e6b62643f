"""Real processes over real ZeroMQ ipc sockets and real shared memory.

* ``bench_transport.run_ring`` and the ``dflash-ipc bench transport --json`` CLI;
* the start-up handshake (``handshake.coordinate``) against real child processes;
* malformed frames sent over a real socket into running bench producer/consumer processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from dflash_ipc.bench import transport as bench_transport
from dflash_ipc.control import channels, handshake, protocol
from dflash_ipc.control.handshake import HandshakeError
from dflash_ipc.control.protocol import Done, EndOfData, RejectCounter, SlotFree, SlotReady
from dflash_ipc.runtime.forkserver import ForkedProcess, ForkServer
from dflash_ipc.transport.shm_names import list_run_shm, new_run_id, sweep_run_shm

REPO = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {
    "backend",
    "producers",
    "consumers",
    "slots",
    "slot_bytes",
    "gbps",
    "baseline",
    "baseline_gbps",
    "ratio",
    "handoff_us_p50",
    "handoff_us_p99",
    "per_consumer_slots",
    "verified",
}


@pytest.fixture
def short_tmp(monkeypatch):
    """A short private temp dir (ipc socket paths are limited to ~107 bytes), removed afterwards."""
    d = tempfile.mkdtemp(prefix="dfit-")
    monkeypatch.setattr(tempfile, "tempdir", d)  # run_ring's run directories land here too
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def run_ids(monkeypatch):
    """Record the run ids run_ring draws, to check exactly those runs' segments afterwards."""
    seen: list[str] = []

    def recording_new_run_id() -> str:
        rid = new_run_id()
        seen.append(rid)
        return rid

    monkeypatch.setattr(bench_transport, "new_run_id", recording_new_run_id)
    yield seen
    for rid in seen:
        sweep_run_shm(rid)


# --------------------------------------------------------------------------- bench: run_ring


@pytest.fixture(scope="module")
def bench_launcher() -> Iterator[ForkServer]:
    """The fork server bench transport forks its CPU ring processes from (preloaded once for the
    module: run_ring starts one of its own without it, as the CLI test's bench does)."""
    launcher = bench_transport.ring_launcher(bench_transport.BenchArgs())
    assert launcher is not None
    yield launcher
    launcher.close()


def test_run_ring_two_by_two_verified_and_routed_least_busy(short_tmp, run_ids, bench_launcher):
    args = bench_transport.BenchArgs(backend="cpu-shm", producers=2, consumers=2, slots=4, slot_mib=1, seconds=1.5)
    res = bench_transport.run_ring(args, 1 << 20, args.seconds, bench_launcher)
    assert len(run_ids) == 1
    assert list_run_shm(run_ids[0]) == []  # no segment of this run survives
    summ = res["summaries"]
    assert set(summ) == {("producer", 0), ("producer", 1), ("consumer", 0), ("consumer", 1)}
    ring = bench_transport._ring_result(res, args)
    assert ring["verified"] is True
    per = ring["per_consumer_slots"]
    assert all(n > 0 for n in per), per  # ties go round-robin, so both consumers get work
    assert ring["rejected"] == 0
    for p in range(2):
        ps = summ[("producer", p)]
        assert ps.rejected == 0
        # every slot came back: nothing left READY or queued at exit
        slots = ps.plane.slots
        assert slots.ready == 0 and slots.queued == 0 and slots.free == args.slots
        # every batch a producer sent was received and verified by exactly one consumer
        assert ps.batches == sum(summ[("consumer", c)].per_producer[p] for c in range(2)) > 0
        # Least-busy with credits, judged on the producer's own view when it decided (how much each
        # consumer gets depends on how the OS schedules them, so shares are not compared): every
        # slot went to a consumer with credit left and no more outstanding work than any other.
        routing = ps.routing
        assert len(routing.decisions) == min(ps.batches, 4096) and routing.max_outstanding == args.max_outstanding
        for d in routing.decisions:
            assert len(d.loads) == 2 and d.loads[d.consumer] < routing.max_outstanding, d
            assert d.loads[d.consumer] == min(d.loads), d
    assert sum(summ[("consumer", c)].slots for c in range(2)) == sum(summ[("producer", p)].batches for p in range(2))


def test_run_ring_child_failure_is_named(short_tmp, run_ids, bench_launcher):
    args = bench_transport.BenchArgs(backend="carrier-pigeon", producers=1, consumers=1, slots=2, slot_mib=0.01, seconds=0.5)
    with pytest.raises(HandshakeError, match=r"producer-0 failed during the handshake: ValueError: unknown transport backend"):
        bench_transport.run_ring(args, 1 << 14, args.seconds, bench_launcher)
    assert list_run_shm(run_ids[0]) == []


# --------------------------------------------------------------------------- bench: CLI


# The real CLI entry point, plus a recorder of the run ids the bench draws (other runs may be
# using /dev/shm concurrently, so "no segment left" is checked for exactly this command's runs).
CLI_SHIM = textwrap.dedent(
    r"""
    import os, sys
    from dflash_ipc.bench import transport as bench_transport
    from dflash_ipc.transport.shm_names import new_run_id

    def recording_new_run_id():
        rid = new_run_id()
        with open(os.environ["DFIT_RUN_IDS"], "a") as f:
            f.write(rid + "\n")
        return rid

    bench_transport.new_run_id = recording_new_run_id
    from dflash_ipc.cli import main
    main(prog_name="dflash-ipc")
    """
)


def test_cli_bench_transport_json_slow_consumer():
    tmp = tempfile.mkdtemp(prefix="dfit-")
    ids_file = Path(tmp) / "run_ids"
    try:
        env = dict(os.environ, TMPDIR=tmp, DFIT_RUN_IDS=str(ids_file))
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                CLI_SHIM,
                "bench",
                "transport",
                "--backend",
                "cpu-shm",
                "--producers",
                "2",
                "--consumers",
                "2",
                "--slot-mib",
                "1",
                "--seconds",
                "1",
                "--slow-consumer",
                "1",
                "--slow-ms",
                "20",
                "--json",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        run_ids = ids_file.read_text().split() if ids_file.exists() else []
        leftover = [list_run_shm(rid) for rid in run_ids]  # looked at before anything cleans up
        for rid in run_ids:
            sweep_run_shm(rid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, proc.stderr[-2000:]
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    assert REQUIRED_KEYS <= set(result), REQUIRED_KEYS - set(result)
    assert result["backend"] == "cpu-shm" and result["producers"] == 2 and result["consumers"] == 2 and result["slots"] == 4
    assert result["slot_bytes"] >= 1 << 20
    assert result["verified"] is True
    assert result["gbps"] > 0 and result["baseline_gbps"] > 0 and result["ratio"] is not None
    assert isinstance(result["baseline"], str) and result["baseline"]
    assert result["handoff_us_p50"] <= result["handoff_us_p99"]
    fast, slow = result["per_consumer_slots"]
    assert slow > 0, result
    assert slow < 0.5 * fast, result  # least-busy routing sends the slow consumer clearly less
    # no segment of this command's runs (ring and handoff phases) remains
    assert len(run_ids) == 2, run_ids
    assert leftover == [[], []], leftover


# --------------------------------------------------------------------------- handshake

HELLO_CHILD = textwrap.dedent(
    r"""
    import os, sys, zmq
    from dflash_ipc.control import channels
    from dflash_ipc.control import handshake
    from dflash_ipc.control import protocol
    from dflash_ipc.control.protocol import Hello, RejectCounter
    from dflash_ipc.control.ring_descriptor import DESCRIPTOR_VERSION, RingDescriptor, ShmSegment, SlotLayoutWire
    endpoint, role, rank, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    ctx = zmq.Context()
    dealer = channels.connect(ctx, zmq.DEALER, endpoint, handshake.identity(role, rank))
    ring = None
    if role == "producer":  # a producer's Hello carries its ring's descriptor (these children never map it)
        layout = SlotLayoutWire(num_planes=1, hidden_size=8, max_tokens=8, max_seqs=1, plane_dtype="float32")
        ring = RingDescriptor(backend="cpu-shm", version=DESCRIPTOR_VERSION, run_id="0", producer_rank=rank, producer_pid=os.getpid(),
                              num_slots=2, slot_bytes=4096, layout=layout, shm=ShmSegment(name=f"dflash-ipc-0-target{rank}"))
    if mode == "dead":
        dealer.send(protocol.encode(protocol.Dead(role=role, rank=rank, error="RuntimeError: out of memory loading the model")))
    else:
        dealer.send(protocol.encode(Hello(role=role, rank=rank, pid=os.getpid(), device="cpu", endpoint=f"ipc://nowhere/{role}{rank}",
                                          ring=ring)))
    print("sent", flush=True)
    if mode == "die_after_start":
        start = handshake.child_handshake(dealer, Hello(role=role, rank=rank, pid=os.getpid(), device="cpu"), 60, RejectCounter("c"))
        os._exit(5)  # dies before sending Ready
    if mode == "full":
        msg = None
        while not isinstance(msg, protocol.Start):
            msg = protocol.decode(dealer.recv())
        handshake.send_ready(dealer, role, rank)
        print("ready", flush=True)
    sys.stdin.read()  # stay alive (socket open) until the test closes our stdin
    """
)


class Children:
    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, endpoint: str, role: str, rank: int, mode: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", HELLO_CHILD, endpoint, role, str(rank), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.procs[f"{role}-{rank}"] = p
        assert p.stdout.readline().strip() == "sent"
        return p

    def dead(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} (pid {p.pid}) exited with {p.returncode}"
        return None

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.stdin.close()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in (p.stdin, p.stdout):
                if f and not f.closed:
                    f.close()


@pytest.fixture
def coordinator(short_tmp):
    ctx = zmq.Context()
    channels.prepare_socket_dir(short_tmp)
    ep = channels.supervisor_endpoint(short_tmp)
    router = channels.bind(ctx, zmq.ROUTER, ep)
    kids = Children()
    yield router, ep, kids
    kids.stop()
    router.close()
    ctx.term()


def test_handshake_completes_with_real_children(coordinator):
    router, ep, kids = coordinator
    kids.start(ep, "producer", 0, "full")
    kids.start(ep, "consumer", 0, "full")
    rejects = RejectCounter("sup")
    hellos = handshake.coordinate(router, [("producer", 0), ("consumer", 0)], timeout_s=60, rejects=rejects, is_alive=kids.dead)
    assert set(hellos) == {("producer", 0), ("consumer", 0)}
    assert hellos[("producer", 0)].pid == kids.procs["producer-0"].pid
    assert rejects.total == 0
    for p in kids.procs.values():
        assert p.stdout.readline().strip() == "ready"


def test_handshake_timeout_names_setting_and_missing_child(coordinator):
    router, ep, kids = coordinator
    kids.start(ep, "producer", 0, "hello")  # this one says Hello; consumer-0 never connects
    with pytest.raises(HandshakeError) as ei:
        handshake.coordinate(router, [("producer", 0), ("consumer", 0)], timeout_s=2.0, rejects=RejectCounter("sup"), is_alive=kids.dead)
    msg = str(ei.value)
    assert "run.handshake_timeout_s" in msg, msg
    assert "consumer-0" in msg and "producer-0" not in msg, msg
    assert "timed out" in msg


def test_handshake_child_dying_silently_is_named(coordinator):
    router, ep, kids = coordinator
    kids.start(ep, "producer", 0, "hello")
    kids.start(ep, "consumer", 1, "die_after_start")  # says Hello, gets Start, exits before Ready
    with pytest.raises(HandshakeError) as ei:
        handshake.coordinate(router, [("producer", 0), ("consumer", 1)], timeout_s=120, rejects=RejectCounter("sup"), is_alive=kids.dead)
    msg = str(ei.value)
    assert "consumer-1" in msg and "exited with 5" in msg and "during the handshake" in msg, msg
    assert "Ready" in msg  # the phase it died in
    assert "timed out" not in msg


def test_handshake_child_reporting_dead_is_named(coordinator):
    router, ep, kids = coordinator
    kids.start(ep, "producer", 0, "hello")
    kids.start(ep, "consumer", 1, "dead")
    with pytest.raises(HandshakeError) as ei:
        handshake.coordinate(router, [("producer", 0), ("consumer", 1)], timeout_s=120, rejects=RejectCounter("sup"), is_alive=kids.dead)
    msg = str(ei.value)
    assert "consumer-1 failed during the handshake" in msg and "out of memory" in msg, msg


def test_handshake_hands_dead_reports_to_the_coordinator_whose_check_names_the_cause(coordinator):
    """With ``on_dead`` a Dead report does not end the handshake by itself: the coordinator records it, and
    its check names the failure to blame. Here a peer is SIGKILLed while the report is handled: a reporter's
    "connection closed by peer" often arrives before the SIGKILLed process is seen to exit."""
    router, ep, kids = coordinator
    producer = kids.start(ep, "producer", 0, "hello")
    kids.start(ep, "consumer", 1, "dead")
    reports = []
    rejects = RejectCounter("sup")

    def on_dead(ident: bytes, msg: protocol.Dead) -> None:
        reports.append((ident, msg.error))
        producer.kill()
        producer.wait(timeout=30)

    with pytest.raises(HandshakeError) as ei:
        handshake.coordinate(
            router, [("producer", 0), ("consumer", 1)], timeout_s=120, rejects=rejects, is_alive=kids.dead, on_dead=on_dead
        )
    assert reports == [(b"consumer-1", "RuntimeError: out of memory loading the model")]
    assert rejects.total == 0, rejects.by_kind  # the report is handed over once, not also refused as unexpected
    msg = str(ei.value)
    assert msg.startswith(f"producer-0 (pid {producer.pid}) exited with -9 during the handshake (Hello)"), msg


def test_handshake_ignores_garbage_and_strangers(coordinator):
    router, ep, kids = coordinator
    ctx = zmq.Context()
    stranger = channels.connect(ctx, zmq.DEALER, ep, handshake.identity("consumer", 9))
    try:
        stranger.send(b"\xc1 not msgpack")
        stranger.send(protocol.encode(protocol.Hello(role="consumer", rank=9, pid=1, device="cpu")))
        kids.start(ep, "producer", 0, "full")
        rejects = RejectCounter("sup")
        hellos = handshake.coordinate(router, [("producer", 0)], timeout_s=60, rejects=rejects, is_alive=kids.dead)
        assert set(hellos) == {("producer", 0)}
        # a stranger's frames are refused by identity before their bytes are parsed
        assert rejects.by_kind == {"unexpected_peer": 2}
    finally:
        stranger.close()
        ctx.term()


# --------------------------------------------------------------------------- malformed frames into running processes


def _spawn_bench(launcher: ForkServer, module: str, argv: list[str], log: Path) -> ForkedProcess:
    with open(log, "w") as f:
        return launcher.popen([sys.executable, "-m", module, *argv], stdout=f, stderr=subprocess.STDOUT)


def test_malformed_frames_into_running_processes_are_counted(short_tmp, bench_launcher):
    run_dir = short_tmp / "r"
    (run_dir / "logs").mkdir(parents=True)
    channels.prepare_socket_dir(run_dir)
    run_id = new_run_id()
    ctx = zmq.Context()
    router = channels.bind(ctx, zmq.ROUTER, channels.supervisor_endpoint(run_dir))
    common = ["--run-dir", str(run_dir), "--backend", "cpu-shm", "--producers", "1", "--consumers", "1", "--rank", "0"]
    procs = {
        ("producer", 0): _spawn_bench(
            bench_launcher,
            "dflash_ipc.procs.bench_producer",
            common + ["--run-id", run_id, "--slots", "3", "--slot-bytes", str(1 << 16), "--seconds", "2.5", "--max-outstanding", "2"],
            run_dir / "p0.out",
        ),
        ("consumer", 0): _spawn_bench(bench_launcher, "dflash_ipc.procs.bench_consumer", common, run_dir / "c0.out"),
    }
    push_c = push_p = None

    def dead() -> str | None:
        for (role, rank), p in procs.items():
            if p.poll() is not None:
                return f"{role}-{rank} exited with {p.returncode}"
        return None

    try:
        handshake.coordinate(router, list(procs), timeout_s=120, rejects=RejectCounter("sup"), is_alive=dead)
        # a stranger pushes into the running consumer's data-plane endpoint...
        push_c = channels.connect(ctx, zmq.PUSH, channels.drafter_endpoint(run_dir, 0))
        bad_for_consumer = [
            b"\xc1",
            b"random \x00\xff bytes",
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"v": 99, "t": "slot_ready"}),
            msgpack.packb({"v": 1, "t": "no_such_message"}),
            msgpack.packb({"v": 1, "t": "slot_ready", "producer": 0}),  # missing fields
            protocol.encode(SlotReady(producer=0, slot=3, batch_id=[0, 0, 0], bucket=0, n_tokens=1, n_seqs=1, seq=0)),  # slot == ring size
            protocol.encode(SlotReady(producer=4, slot=0, batch_id=[0, 0, 0], bucket=0, n_tokens=1, n_seqs=1, seq=0)),  # no such producer
            protocol.encode(EndOfData(producer=7, batches_sent=0)),
            b"\x00" * (protocol.MAX_FRAME_BYTES + 1),
        ]
        for f in bad_for_consumer:
            push_c.send(f)
        # ...and into the running producer's
        push_p = channels.connect(ctx, zmq.PUSH, channels.target_endpoint(run_dir, 0))
        bad_for_producer = [
            b"\xc1\xc1",
            protocol.encode(SlotFree(producer=0, slot=99, consumer=0, outstanding=0, received=0)),  # outside the ring
            protocol.encode(SlotFree(producer=0, slot=0, consumer=5, outstanding=0, received=0)),  # no such consumer
            protocol.encode(SlotFree(producer=2, slot=0, consumer=0, outstanding=0, received=0)),  # another producer's
        ]
        for f in bad_for_producer:
            push_p.send(f)

        summaries: dict[tuple[str, int], protocol.Struct] = {}
        deadline = time.monotonic() + 180
        while len(summaries) < 2 and time.monotonic() < deadline:
            if router.poll(200):
                ident, frame = router.recv_multipart()
                msg = protocol.decode(frame)
                assert not isinstance(msg, protocol.Dead), msg
                if isinstance(msg, Done):
                    summaries[(msg.role, msg.rank)] = msg.summary
            elif dead() and len(summaries) < 2 and all(p.poll() is not None for p in procs.values()):
                break
        assert set(summaries) == set(procs), (
            summaries,
            (run_dir / "logs").iterdir() and [(p.name, p.read_text()[-1500:]) for p in (run_dir / "logs").iterdir()],
        )
        for p in procs.values():
            assert p.wait(timeout=60) == 0
        assert list_run_shm(run_id) == []  # the producer unlinked its own segment on the way out
        cons, prod = summaries[("consumer", 0)], summaries[("producer", 0)]
        # every malformed frame was counted, and the processes kept going to a verified finish
        assert cons.rejected == len(bad_for_consumer), cons
        assert prod.rejected == len(bad_for_producer), prod
        assert cons.verified is True and cons.slots > 0
        assert cons.slots == prod.batches == cons.per_producer[0]
        assert prod.plane.slots.free == 3 and prod.plane.slots.ready == 0
        # each reject kind is logged once by the consumer
        log = (run_dir / "logs" / "consumer-0.log").read_text()
        assert log.count("(undecodable)") == 1 and "(too_large)" in log and "(out_of_range)" in log
    finally:
        for s in (push_c, push_p):
            if s is not None:
                s.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        router.close()
        ctx.term()
        sweep_run_shm(run_id)
