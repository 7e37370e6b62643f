"""Plumbing for the fault suite: a real `dflash-ipc up` (tiny CPU config), the pids it started,
what it left behind, and a hostile peer that speaks to every socket of a run.

Nothing here decides a test's outcome on timing; timeouts are safety nets. Figures the suite
reports (detection times, frames, RSS) are printed with ``FAULTS:`` so `pytest -s` shows them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import psutil
import zmq
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.control import channels, protocol
from dflash_ipc.control.protocol import Dead, EndOfData, Hello, Load, Ready, SlotFree, SlotReady
from dflash_ipc.transport.shm_names import list_run_shm

CLI = [sys.executable, "-m", "dflash_ipc.cli"]
RUN_TIMEOUT_S = 300  # safety net per `up`, never expected to be reached

# The full suite (docs/FAULTS.md): every kind of fault, more trials. CI runs a few of each.
FULL = bool(os.environ.get("DFLASH_IPC_FAULTS_FULL"))


def report(line: str) -> None:
    print(f"FAULTS: {line}", flush=True)


def write_config(path: Path, **sections: dict) -> Path:
    """configs/tiny-cpu.toml made small: 300 samples of <= 128 tokens in 512-token batches (69 batches
    over 2 target shards, ~35 steps; a step costs ~40% less CPU than with 256 and 1,024), plus
    ``section={key: value}`` overrides."""
    raw = tiny_cpu_config(
        data={"builtin_samples": 300, "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512},
        run={"teardown_grace_s": 3.0},
        training={"checkpoint_every": 0, "max_steps": 0},
    )
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return write_toml(path, raw)


class Up:
    """One `dflash-ipc up` supervisor; its output goes to a file (never blocks it). ``wrapper``: a command
    it runs under (``timeout``); ``own_group``: in a process group of its own, the one a group signal reaches."""

    def __init__(
        self,
        config: Path,
        run_dir: Path,
        *extra: str,
        name: str = "up",
        env: dict[str, str] | None = None,
        wrapper: tuple[str, ...] = (),
        own_group: bool = False,
    ):
        self.run_dir = run_dir
        self.own_group = own_group
        self.out_path = run_dir.parent / f"{run_dir.name}.{name}.out"
        self._out = open(self.out_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [*wrapper, *CLI, "up", "--config", str(config), "--run-dir", str(run_dir), *extra],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=run_dir.parent,
            env=env,
            start_new_session=own_group,
        )

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """The children of the latest group started, by name."""
        groups = self.groups_started()
        return groups[-1] if groups else {}

    def groups_started(self) -> list[dict[str, int]]:
        """Every group of children started (a restart starts a new one), each by name, in order."""
        return [
            {name: int(pid) for name, pid in re.findall(r"(\w+-\d+)@\S+ pid (\d+)", line)}
            for line in self.output.splitlines()
            if line.startswith("[up] started")
        ]

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"`up` did not exit within {timeout} s (safety net); output:\n{self.output[-4000:]}") from None

    def wait_until(self, pred, what: str, timeout: float = RUN_TIMEOUT_S, poll_s: float = 0.02) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None:
                raise AssertionError(f"`up` exited ({self.proc.returncode}) before {what}; output:\n{self.output[-4000:]}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"timed out waiting for {what}; output:\n{self.output[-4000:]}")
            time.sleep(poll_s)

    def steps_logged(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return sum(1 for x in path.read_text().splitlines() if x.strip()) if path.exists() else 0

    def kill_all(self) -> None:
        """Safety net for a failing test: this supervisor and the children it started, by pid (its own group whole)."""
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):  # the group outlives its reaped leader while a member runs
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.child_pids().values():
            if is_run_process(pid, self.run_dir):
                psutil.Process(pid).kill()

    def close(self) -> None:
        self.kill_all()
        self._out.close()


def lock_owner_pid(run_dir: Path) -> int | None:
    """The pid the run dir's lock file names (runtime.run_lock), whether or not it still holds it."""
    try:
        return json.loads((run_dir / "lock").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def is_run_process(pid: int, run_dir: Path) -> bool:
    """``pid`` is alive (not a zombie) and is a child of this run (its argv names the run dir).

    A live process whose argv reads empty (between fork and exec, or while exec swaps it) or cannot be read
    counts as this run's: "gone" must mean gone, or a check of what the run left could run before the
    process has left."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        argv = " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
    return not argv or str(run_dir) in argv


def leftovers(up: Up, pids: dict[str, int] | None = None) -> list[str]:
    """What the run left: live processes, shared-memory segments, socket files (empty: nothing)."""
    out = []
    for name, pid in (pids or up.child_pids()).items():
        if is_run_process(pid, up.run_dir):
            out.append(f"process {name} (pid {pid})")
    run_id = (up.run_dir / "run_id").read_text().strip() if (up.run_dir / "run_id").exists() else ""
    if run_id:
        out += [f"shm {s}" for s in list_run_shm(run_id)]
    sock_dir = channels.socket_dir(up.run_dir)
    if sock_dir.exists():
        out += [f"socket {p.name}" for p in sock_dir.iterdir()]
    return out


def wait_gone(up: Up, pids: dict[str, int], timeout: float) -> float | None:
    """Seconds until none of ``pids`` runs any more (None: still running after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(is_run_process(p, up.run_dir) for p in pids.values()):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def status_json(run_dir: Path) -> tuple[int, dict | None]:
    r = subprocess.run([*CLI, "status", "--run-dir", str(run_dir), "--json"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return r.returncode, None
    return 0, json.loads(r.stdout.splitlines()[-1])


def rejected_total(snap: dict) -> int:
    return sum(snap["supervisor_rejected_by_kind"].values()) + sum(p["rejected_messages"] for p in snap["processes"])


def proc_state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


# --------------------------------------------------------------------------- hostile peer


def _raw(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def hostile_frames(rng: random.Random) -> list[list[bytes]]:
    """One batch of bad multi-part messages, every shape a foreign process can make: extra and
    missing parts, garbage, truncated, wrong type, wrong version, well-formed messages of every
    type (forged: no run key), and envelopes with a made-up tag or a real member's name."""
    good = [
        protocol.encode(EndOfData(producer=0, batches_sent=0)),
        protocol.encode(EndOfData(producer=1, batches_sent=0)),
        protocol.encode(SlotReady(producer=0, slot=1, batch_id=[0, 0, 3], bucket=0, n_tokens=999, n_seqs=3, seq=0)),
        protocol.encode(SlotFree(producer=0, slot=0, consumer=0, outstanding=0, received=1)),
        protocol.encode(Load(consumer=0, outstanding=0, received=[100, 100])),
        protocol.encode(Dead(role="drafter", rank=0, error="forged")),
        protocol.encode(Ready(role="target", rank=0)),
        protocol.encode(Hello(role="target", rank=0, pid=os.getpid(), device="cpu")),
    ]
    body = rng.choice(good)
    cut = body[: rng.randrange(1, max(2, len(body)))]
    member = rng.choice([b"target-0", b"target-1", b"drafter-0", b"drafter-1"])
    return [
        [b"a", b"b"],
        [body, body],
        [cut],
        [os.urandom(rng.randrange(1, 64))],
        [_raw(v=1, t="slot_ready", producer="zero")],  # wrong field type
        [_raw(v=99, t="end_of_data", producer=0, batches_sent=0)],  # wrong version
        [_raw(v=1, t="no_such_type")],
        [body],  # forged, unsealed
        [member, (1).to_bytes(8, "big"), body, os.urandom(16)],  # sealed with a guessed tag
        [member, b"\x00" * 8, body, b"\x00" * 16, b"extra"],
        [b""],
    ]


class HostilePeer:
    """A process-local attacker without the run key: DEALERs to the supervisor (with and without
    a member's identity), REQ to the status socket, PUSH to every target and drafter."""

    def __init__(self, run_dir: Path, n_targets: int, n_drafters: int, seed: int):
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        self.run_dir = run_dir
        self.sent = 0
        self.n_targets, self.n_drafters = n_targets, n_drafters
        self.pushes = []
        self.dealers = []

    def connect(self) -> None:
        ep = channels.supervisor_endpoint(self.run_dir)
        for ident in (b"intruder", b"drafter-0", b"target-1"):
            # A member's identity while the member is connected: ZeroMQ keeps the first peer.
            self.dealers.append(channels.connect(self.ctx, zmq.DEALER, ep, ident))
        for r in range(self.n_targets):
            self.pushes.append(channels.connect(self.ctx, zmq.PUSH, channels.target_endpoint(self.run_dir, r)))
        for r in range(self.n_drafters):
            self.pushes.append(channels.connect(self.ctx, zmq.PUSH, channels.drafter_endpoint(self.run_dir, r)))

    def _send(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:
            pass

    def burst(self, include_data_plane: bool = True) -> None:
        socks = self.dealers + (self.pushes if include_data_plane else [])
        for sock in socks:
            for parts in hostile_frames(self.rng):
                self._send(sock, parts)

    def status_requests(self) -> int:
        """Bad requests to sock/status (a REQ sends one request, then must read the reply)."""
        answered = 0
        for parts in ([b"status", b"extra"], [b"give me everything"], [b""]):
            req = channels.connect(self.ctx, zmq.REQ, channels.status_endpoint(self.run_dir))
            try:
                req.send_multipart(parts)
                self.sent += 1
                if req.poll(3000):
                    req.recv_multipart()
                    answered += 1
            finally:
                req.close(linger=0)
        return answered

    def close(self) -> None:
        for s in self.dealers + self.pushes:
            s.close(linger=0)
        self.ctx.term()


def stop_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
