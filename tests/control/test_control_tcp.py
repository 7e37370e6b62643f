"""`dflash-ipc up` with ``run.control = "tcp"``: the whole control plane over tcp:// with CURVE.

One real run (``transport.backend = "nccl"``, gloo on CPU: one target, two drafters) while this
test process, holding none of the run's keys, connects to every control socket of the run again and
again and sends frames: no CURVE at all, a key pair of its own, and the run's client key with a
wrong server key. Each is refused by the handshake, nothing it sends reaches a process (a
delivered frame would be rejected under another kind than ``unauthenticated_peer``: a bad frame
count, a failed seal), every planned batch is trained exactly once, and ``dflash-ipc status
--json``, asking the supervisor over tcp with the run's keys, shows the refusals counted. The same
run is checked for its footprint: no socket file in RUN_DIR/sock, nothing listening on a wildcard
address, the endpoints file gone after the run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.control import channels, curve, plane
from dflash_ipc.control.protocol import Hello, Load
from dflash_ipc.drafter.checkpoint.store import LEDGER_FILE, read_latest_pointer
from dflash_ipc.ops import status_client

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3
STRANGER_KINDS = ("no CURVE", "own key pair", "wrong server key")

pytestmark = [
    pytest.mark.skipif(not curve.curve_available(), reason="libzmq without CURVE"),
]


def _wait(pred, what: str, proc: subprocess.Popen, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert proc.poll() is None, f"`up` exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _pull_endpoints(run_dir: Path) -> dict[str, str]:
    """Each child's PULL endpoint, as its log announces it."""
    found = {}
    for log in (run_dir / "logs").glob("*.log"):
        m = re.search(r"this process's PULL (tcp://\S+)", log.read_text())
        if m:
            found[log.stem] = m.group(1)
    return found


def _stranger(ctx: zmq.Context, kind: int, endpoint: str, how: str, keys: curve.RunKeys) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if how == "own key pair":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = keys.server_public
    elif how == "wrong server key":
        sock.curve_publickey, sock.curve_secretkey = keys.client_public, keys.client_secret
        sock.curve_serverkey = zmq.curve_keypair()[0]
    if kind == zmq.DEALER:
        sock.setsockopt(zmq.IDENTITY, b"target-0")
    sock.connect(endpoint)
    return sock


def _frames(kind: int) -> list[list[bytes]]:
    if kind == zmq.REQ:
        return [[b"status"]]
    hello = channels.protocol.encode(Hello(role="target", rank=0, pid=1, device="cpu"))
    load = channels.protocol.encode(Load(consumer=0, outstanding=0, received=[0]))
    return [[hello], [b"target-0", (1).to_bytes(8, "big"), load, b"\0" * 16]]


def _attack(endpoints: dict[str, tuple[int, str]], keys: curve.RunKeys) -> int:
    """Every stranger at every endpoint, ROUNDS times, each sending frames; returns the attempts."""
    ctx = zmq.Context()
    attempts = 0
    try:
        for _ in range(ROUNDS):
            socks = []
            for kind, ep in endpoints.values():
                for how in STRANGER_KINDS:
                    s = _stranger(ctx, kind, ep, how, keys)
                    socks.append(s)
                    for frame in _frames(kind):
                        try:
                            s.send_multipart(frame, zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # no connection came up: nothing to send on (the point)
                    attempts += 1
            time.sleep(0.5)  # the handshakes fail meanwhile
            for s in socks:
                s.close(linger=0)
    finally:
        ctx.term()
    return attempts


def _status_cli(run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "dflash_ipc.cli", "status", "--run-dir", str(run_dir), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


class _ListenSampler:
    """Every listening inet socket of the machine with its pid, sampled from before the run binds anything until it
    ends: a child may bind after its first heartbeat, and a short run's children may exit before the refusals are
    all counted, so looks at the run's processes at chosen moments can miss sockets."""

    def __init__(self, period_s: float = 0.1):
        self.seen: set[tuple[int, str, int]] = set()
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _ListenSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            found = psutil.net_connections(kind="inet")
            self.seen.update((c.pid, c.laddr.ip, c.laddr.port) for c in found if c.pid and c.status == psutil.CONN_LISTEN)
            if self._stop.wait(self._period_s):
                return


def _ledger(run_dir: Path) -> list[tuple[int, ...]]:
    name = read_latest_pointer(run_dir / "checkpoints")
    assert name, f"no checkpoint under {run_dir}/checkpoints"
    return sorted(tuple(i) for i in json.loads((run_dir / "checkpoints" / name / LEDGER_FILE).read_text())["ids"])


@pytest.fixture(scope="module")
def tcp_run(tmp_path_factory):
    """One `up` over tcp, attacked while it runs; what was seen, for the tests below."""
    tmp = tmp_path_factory.mktemp("tcp")
    raw = tiny_cpu_config(
        run={"control": "tcp", "control_host": "127.0.0.1", "teardown_grace_s": 3.0},
        topology={"targets": ["cpu"], "drafters": ["cpu", "cpu"]},
        data={"builtin_samples": 120, "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512},
        transport={"backend": "nccl"},
        training={"checkpoint_every": 0, "max_steps": 0, "checkpoint_on_finish": True, "export_on_finish": False},
    )
    cfg = write_toml(tmp / "tcp.toml", raw)
    run_dir = tmp / "run"
    argv = [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(cfg), "--max-steps", "0", "--run-dir", str(run_dir)]
    with _ListenSampler() as sampler:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        seen = _attack_while_it_runs(proc, run_dir)
    # the run's processes: the supervisor's process tree, and its children by pid (forked from the worker's shared
    # fork server, they are that server's children) as the last status names them
    final = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {"processes": []}
    pids = {proc.pid} | seen.pop("tree") | {p["pid"] for p in final["processes"] if p["pid"]}
    seen["listening"] = {entry for entry in sampler.seen if entry[0] in pids}
    seen["rc"] = proc.returncode
    return seen


def _attack_while_it_runs(proc: subprocess.Popen, run_dir: Path) -> dict:
    """Strangers at every control socket, then status --json until it shows them refused; the run to its end."""
    seen: dict = {"run_dir": run_dir, "tree": set()}
    try:
        published = _wait(lambda: plane.published_endpoints(run_dir), "control.json", proc)
        keys = curve.read_run_keys(Path(published["key_root"]))
        pulls = _wait(lambda: (lambda found: found if len(found) == 3 else None)(_pull_endpoints(run_dir)), "the PULL endpoints", proc)
        endpoints = {"supervisor": (zmq.DEALER, published["supervisor"]), "status": (zmq.REQ, published["status"])}
        endpoints |= {name: (zmq.PUSH, ep) for name, ep in pulls.items()}
        seen["endpoints"] = endpoints
        seen["attempts"] = _attack(endpoints, keys)
        seen["sock_dir_exists"] = (run_dir / "sock").exists()

        def counted():
            # The supervisor counts its own refusals at once; children report theirs with their heartbeats.
            snap = _status_cli(run_dir)
            seen["tree"].update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            procs = {f"{p['role']}-{p['rank']}": p for p in snap["processes"]}
            ok = snap["supervisor_rejected_by_kind"].get("unauthenticated_peer", 0) >= 2 * ROUNDS * len(STRANGER_KINDS) and all(
                procs[name]["rejected_by_kind"].get("unauthenticated_peer", 0) >= ROUNDS for name in pulls
            )
            return snap if ok or snap["state"] not in ("starting", "running") else None

        seen["live_status"] = _wait(counted, "status --json to show the refusals", proc)
        live = status_client._live_endpoint(run_dir)
        seen["live_endpoint"] = (live[0], live[1] is not None) if live else None
        seen["out"], _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return seen


@pytest.mark.slow
def test_up_over_tcp_refuses_every_stranger_delivers_nothing_and_counts_the_refusals(tcp_run):
    run_dir, out = tcp_run["run_dir"], tcp_run["out"]
    assert tcp_run["rc"] == 0, out[-4000:]
    assert "finished (data exhausted)" in out, out[-2000:]
    # every planned batch trained exactly once, with strangers at every socket
    plan = json.loads((run_dir / "plan.json").read_text())
    planned = sorted((0, s, i) for s, n in enumerate(plan["n_batches_per_shard"]) for i in range(n))
    assert len(planned) > 4 and _ledger(run_dir) == planned
    # status --json over tcp, with the run's keys, while the run was live
    live = tcp_run["live_status"]
    assert live["state"] == "running", live["state"]
    assert tcp_run["live_endpoint"] == (tcp_run["endpoints"]["status"][1], True)
    sup = live["supervisor_rejected_by_kind"]
    # ROUTER and REP, each refused every stranger of every round; nothing else was ever seen
    assert sup.get("unauthenticated_peer", 0) >= 2 * ROUNDS * len(STRANGER_KINDS), sup
    assert set(sup) == {"unauthenticated_peer"}, sup
    final = json.loads((run_dir / "status.json").read_text())
    assert set(final["supervisor_rejected_by_kind"]) == {"unauthenticated_peer"}, final["supervisor_rejected_by_kind"]
    for p in final["processes"]:
        kinds = p["rejected_by_kind"]
        # each child's PULL refused each stranger of each round (a child may count one handshake
        # twice: a reconnect); no stranger's frame was ever delivered (no other kind)
        assert kinds.get("unauthenticated_peer", 0) >= ROUNDS, (p["role"], p["rank"], kinds)
        assert set(kinds) == {"unauthenticated_peer"}, (p["role"], p["rank"], kinds)


@pytest.mark.slow
def test_up_over_tcp_leaves_no_socket_file_and_listens_on_no_wildcard(tcp_run):
    run_dir = tcp_run["run_dir"]
    assert tcp_run["rc"] == 0, tcp_run["out"][-4000:]
    assert not tcp_run["sock_dir_exists"] and not (run_dir / "sock").exists()
    listening = tcp_run["listening"]
    ports = {int(ep.rsplit(":", 1)[1]) for _, ep in tcp_run["endpoints"].values()}
    # every control socket was listening on control_host itself (the children include the nccl/gloo rendezvous too)
    assert ports <= {port for _, _, port in listening}, (ports, listening)
    wildcard = [entry for entry in listening if entry[1] in ("0.0.0.0", "::")]
    assert not wildcard, wildcard
    assert all(ip == "127.0.0.1" for _, ip, _ in listening), listening
    # the endpoints file goes with the supervisor; the keys stay private
    assert not (run_dir / plane.CONTROL_FILE).exists()
    assert oct((run_dir / curve.KEYS_DIR).stat().st_mode & 0o777) == "0o700"
