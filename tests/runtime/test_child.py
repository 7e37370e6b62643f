"""The child scaffold (run_child): real child processes, a real supervisor ROUTER socket.

A small role defined in a script here runs under :func:`dflash_ipc.runtime.child.run_child` the
way procs/target.py and procs/drafter.py do; the test plays the supervisor. Timeouts are safety
nets only.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dflash_ipc.control import channels, handshake, protocol
from dflash_ipc.control.protocol import Dead, Ready, Shutdown
from dflash_ipc.rundir.fsutil import make_private_dir
from dflash_ipc.runtime.forkserver import ForkServer
from dflash_ipc.runtime.launch import child_env

ROLE_SCRIPT = """
import sys
from pathlib import Path
from dflash_ipc.control import channels
from dflash_ipc.control.protocol import Ready
from dflash_ipc.runtime.child import Placement, run_child

def add_arguments(ap):
    ap.add_argument("--mode", choices=["raise", "loop", "loop-compile-threads"], required=True)

def place(args):
    return Placement("cpu", 1, "info", {"from": "place"}, compile_threads=3)

def main_fn(child):
    out = child.run_dir / "out"
    child.closing.callback(lambda: (out / "closed").open("a").write("first-registered\\n"))
    child.closing.callback(lambda: (out / "closed").open("a").write("last-registered\\n"))
    (out / "config").write_text(repr(child.config))
    if child.args.mode == "raise":
        raise RuntimeError("role failed on purpose")
    if child.args.mode == "loop-compile-threads":
        import os, subprocess, torch._inductor.config as inductor_config
        sub = subprocess.run([sys.executable, "-c", "import torch._inductor.config as c; print(c.compile_threads)"],
                             capture_output=True, text=True, check=True).stdout.strip()
        (out / "compile_threads").write_text(f"{inductor_config.compile_threads} {os.environ['TORCHINDUCTOR_COMPILE_THREADS']} {sub}")
    (out / "running").write_text("1")
    while not child.stop.requested:
        child.read_control(wait_ms=50)
    (out / "reason").write_text(child.stop.reason)
    # Any message will do: it shows the sockets still work after the stop request, before closing.
    child.socks.send_to_supervisor(Ready(role=child.role, rank=child.rank))
    return 0

sys.exit(run_child("demo", main_fn, place=place, pull_endpoint=channels.target_endpoint, add_arguments=add_arguments))
"""


class FakeSupervisor:
    def __init__(self, run_dir: Path):
        make_private_dir(run_dir)
        channels.prepare_socket_dir(run_dir)
        (run_dir / "out").mkdir()
        self.ctx = zmq.Context()
        self.router = channels.bind(self.ctx, zmq.ROUTER, channels.supervisor_endpoint(run_dir))

    def recv(self, timeout_s: float = 60.0) -> protocol.Message:
        assert self.router.poll(int(timeout_s * 1000)), "no message from the child"
        _, frame = self.router.recv_multipart()
        return protocol.decode(frame)

    def send(self, msg: protocol.Message) -> None:
        self.router.send_multipart([handshake.identity("demo", 0), protocol.encode(msg)])

    def close(self) -> None:
        self.router.close()
        self.ctx.term()


class ForkedRole:
    """A role process forked from the worker's shared fork server (``python -m demo_role``, from the
    script's directory), its output in a file: the ``subprocess.Popen`` subset these tests use."""

    def __init__(self, launcher: ForkServer, argv: list[str], out: Path):
        with out.open("w") as f, contextlib.chdir(out.parent):  # the child's sys.path[0] is the request's cwd
            self._proc = launcher.popen(argv, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
        self.pid, self.stdout = self._proc.pid, out.open()
        self.poll, self.wait, self.send_signal, self.kill = self._proc.poll, self._proc.wait, self._proc.send_signal, self._proc.kill


@contextlib.contextmanager
def role_processes(tmp_path: Path, script_text: str, shared_forkserver: str | None = None):
    """A role script under run_child, a FakeSupervisor, and ``start(*args)`` for child processes
    of it (killed, if still running, on the way out): forked from the worker's shared fork server
    where there is one (its preload spares each child the import of torch), else new Pythons."""
    script = tmp_path / "demo_role.py"
    script.write_text(script_text)
    run_dir = tmp_path / "run"
    sup = FakeSupervisor(run_dir)
    launcher = ForkServer.connect(shared_forkserver, child_env()) if shared_forkserver else None
    procs = []

    def start(*args: str) -> subprocess.Popen | ForkedRole:
        options = ["--run-dir", str(run_dir), "--rank", "0", *args]
        if launcher is not None:
            procs.append(ForkedRole(launcher, [sys.executable, "-m", "demo_role", *options], tmp_path / f"child-{len(procs)}.out"))
        else:
            procs.append(
                subprocess.Popen([sys.executable, str(script), *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        return procs[-1]

    try:
        yield start, sup, run_dir
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
        if launcher is not None:
            launcher.close()
        sup.close()


@pytest.fixture
def role(tmp_path, shared_forkserver):
    with role_processes(tmp_path, ROLE_SCRIPT, shared_forkserver) as (start, sup, run_dir):
        yield (lambda mode: start("--mode", mode)), sup, run_dir


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"child exited early: {proc.stdout.read()}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_exception_sends_dead_closes_resources_in_reverse_and_exits_1(role):
    start, sup, run_dir = role
    proc = start("raise")
    msg = sup.recv()
    assert isinstance(msg, Dead)
    assert (msg.role, msg.rank) == ("demo", 0)
    assert msg.error == "RuntimeError: role failed on purpose"
    assert proc.wait(timeout=60) == 1
    assert (run_dir / "out" / "closed").read_text().splitlines() == ["last-registered", "first-registered"]
    assert (run_dir / "out" / "config").read_text() == "{'from': 'place'}"
    log = (run_dir / "logs" / "demo-0.log").read_text()
    assert "Traceback" in log and "role failed on purpose" in log


@pytest.mark.parametrize("how", ["sigterm", "shutdown"])
def test_stop_request_leaves_through_main_and_closing_with_exit_0(role, how):
    """Also (once: it imports torch's inductor in the child and in a subprocess of it): the
    TorchInductor compile-worker cap is in effect in the child (inductor's config) and in a
    subprocess it starts (environment)."""
    start, sup, run_dir = role
    proc = start("loop-compile-threads" if how == "shutdown" else "loop")
    _wait_for(run_dir / "out" / "running", proc)
    if how == "shutdown":
        assert (run_dir / "out" / "compile_threads").read_text() == "3 3 3"
    assert "TorchInductor compile workers capped at 3" in (run_dir / "logs" / "demo-0.log").read_text()
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
        expected = "signal SIGTERM"
    else:
        sup.send(Shutdown(reason="training finished"))
        expected = "shutdown: training finished"
    msg = sup.recv()
    assert isinstance(msg, Ready) and (msg.role, msg.rank) == ("demo", 0)
    assert proc.wait(timeout=60) == 0
    assert (run_dir / "out" / "reason").read_text() == expected
    assert (run_dir / "out" / "closed").read_text().splitlines() == ["last-registered", "first-registered"]


def test_bad_arguments_exit_with_usage(role):
    start, _, _ = role
    proc = start("nonsense")
    assert proc.wait(timeout=60) == 2
    assert "--mode" in proc.stdout.read()


# A supervisor whose spawning thread ends while another of its threads lives on: how a SIGKILLed
# supervisor dies (the kernel sends the children's death signal as the spawning thread exits, and
# their parent reads as the supervisor's pid until its last thread is gone).
THREADED_SUPERVISOR = r"""
import os, subprocess, sys, threading, time
run_dir = sys.argv[1]

children = []

def spawn():
    argv = [sys.executable, "-m", "dflash_ipc.runtime.launch", "target",
            "--supervisor-pid", str(os.getpid()), "--run-dir", run_dir, "--rank", "0"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children.append(child)
    print(child.pid, flush=True)
    sys.stdin.readline()  # the test's word that the child has armed its death signal

spawner = threading.Thread(target=spawn)
spawner.start()
spawner.join()
print(children[0].wait(), flush=True)  # the process lives on: its main thread reaps the child
sys.stdin.readline()
"""


def test_the_death_signal_during_the_import_removes_the_supervisors_sockets_while_its_pid_lingers(tmp_path):
    """A child still importing its role when the thread that spawned it dies removes the
    supervisor's socket files and exits, although ``getppid()`` still names the supervisor then
    (a SIGTERM alone cannot tell the supervisor's death from its own teardown)."""
    import psutil

    run_dir = tmp_path / "run"
    sock_dir = run_dir / "sock"
    sock_dir.mkdir(parents=True)
    left = [sock_dir / "sup", sock_dir / "status", run_dir / "control.json"]
    for path in left:
        path.write_text("")
    sup = subprocess.Popen(
        [sys.executable, "-c", THREADED_SUPERVISOR, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        child = psutil.Process(int(sup.stdout.readline()))
        deadline = time.monotonic() + 60
        while not child.children():  # its sentinel starts right after the death signal is armed
            assert child.is_running() and time.monotonic() < deadline, "the child never armed its death signal"
            time.sleep(0.005)
        sup.stdin.write("\n")  # the spawning thread ends; the supervisor's process lives on
        sup.stdin.flush()
        code = int(sup.stdout.readline())  # its parent reaped it, so the parent ran all along
        assert code == -signal.SIGTERM, code
        assert [p.name for p in left if p.exists()] == []
    finally:
        sup.kill()
        sup.wait()
