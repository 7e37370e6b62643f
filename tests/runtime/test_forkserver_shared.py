"""The fork server's shared mode (runtime/forkserver.py, DFLASH_IPC_SHARED_FORKSERVER) on real
processes and real sockets: two clients' children on one server, each exit reported to its owner
only, a SIGKILLed supervisor's children ended while the other's run on, bad requests rejected and
counted with the server still serving, and ``up``'s launcher falling back to a server of its own
when the shared one's preload read another environment.
A real ``up`` whose supervisor is SIGKILLed under a shared server: tests/faults/test_shared_forkserver.py."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import TINY_CPU
from test_forkserver import SLEEPER, _gone  # a child the way launch.main starts one

from dflash_ipc.config import load_config
from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV, ForkServer, launcher_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.own_forkserver  # its own shared servers, not the worker's

EXITER = """
import sys
raise SystemExit(int(sys.argv[1]))
"""

# A supervisor of the shared server: one sleeping child, then (on a line of stdin) a child that exits 7.
SUPERVISOR = """
import os, sys
from dflash_ipc.runtime.forkserver import ForkServer
server = ForkServer.connect(sys.argv[1], dict(os.environ))
child = server.popen([sys.executable, "-m", "fs_sleeper", str(server.pid)], stdout=open(sys.argv[2], "ab"))
print(server.pid, child.pid, flush=True)
sys.stdin.readline()
print(server.popen([sys.executable, "-m", "fs_exiter", "7"]).wait(timeout=120), flush=True)
sys.stdin.readline()
"""


def _env(tmp_path: Path) -> dict[str, str]:
    """The test's modules as files; the environment of the server and of every client."""
    for name, text in {"fs_exiter": EXITER, "fs_sleeper": SLEEPER, "fs_supervisor": SUPERVISOR}.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


@contextlib.contextmanager
def shared_server(env: dict[str, str], preload: tuple[str, ...] = ()) -> Iterator[tuple[ForkServer, str]]:
    """A shared server owned by this test, listening in a fresh 0700 directory."""
    owner = ForkServer.start_shared(preload, env, prefix="dflash-fs-test-")
    try:
        yield owner, owner.listen_path
    finally:
        owner.close()


def _raw_client(path: str) -> tuple[socket.socket, dict]:
    """A client speaking the wire itself (JSON + SCM_RIGHTS): the connection and the server's hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return sock, json.loads(sock.recv(1 << 22))


def _next_message(sock: socket.socket, timeout_s: float) -> dict | None:
    """The next message on ``sock`` (None: none within ``timeout_s`` s, or the server hung up)."""
    if not select.select([sock], [], [], timeout_s)[0]:
        return None
    data = sock.recv(1 << 22)
    return json.loads(data) if data else None


def _until_exit(sock: socket.socket, timeout_s: float = 60.0) -> list[dict]:
    """The messages on ``sock`` up to and including the first exit report."""
    got: list[dict] = []
    while not got or "exit" not in got[-1]:
        msg = _next_message(sock, timeout_s)
        assert msg is not None, f"no exit report within {timeout_s} s after {got}"
        got.append(msg)
    return got


def _wait_for_clients(owner: ForkServer, n: int, timeout_s: float = 10.0) -> dict:
    """The server's status once it counts ``n`` clients (a hang-up is applied when the server reads it)."""
    deadline = time.monotonic() + timeout_s
    while (status := owner.server_status())["clients"] != n and time.monotonic() < deadline:
        time.sleep(0.05)
    return status


def _fork_request(argv: list[str], env: dict[str, str]) -> bytes:
    return json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "fds": [1, 2]}).encode()


def test_two_clients_fork_from_one_server_and_each_hears_only_of_its_own_children(tmp_path):
    env = _env(tmp_path)
    with shared_server(env) as (owner, path):
        client = ForkServer.connect(path, env)
        raw, hello = _raw_client(path)
        try:
            assert hello["pid"] == owner.pid == client.pid and hello["ready"] is True and hello["cuda_initialized"] is False
            socket.send_fds(raw, [_fork_request([sys.executable, "-m", "fs_exiter", "5"], env)], [1, 2])
            got = _until_exit(raw)
            pid = got[0]["pid"]
            assert got == [{"pid": pid}, {"exit": pid, "code": 5}]
            assert psutil.Process(owner.pid).children() == []  # reaped by the server
            mine = client.popen([sys.executable, "-m", "fs_exiter", "3"], env=env)
            assert mine.wait(timeout=60) == 3 and mine.pid != pid
            assert _next_message(raw, 1.0) is None  # the other client's child: not reported here
            assert client.server_status() == {"clients": 2, "children": 0, "rejected": 0}
        finally:
            raw.close()
            client.close()
        assert _wait_for_clients(owner, 0) == {"clients": 0, "children": 0, "rejected": 0}
        assert owner._proc.poll() is None  # clients leaving never end the server


def test_a_sigkilled_supervisors_children_end_and_the_other_supervisors_keep_running(tmp_path):
    env = _env(tmp_path)
    with shared_server(env) as (owner, path):
        sups, pids = [], []
        try:
            for name in ("a", "b"):
                argv = [sys.executable, "-m", "fs_supervisor", path, str(tmp_path / f"{name}.log")]
                sups.append(subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                server_pid, child_pid = map(int, sups[-1].stdout.readline().split())
                assert server_pid == owner.pid and psutil.Process(child_pid).ppid() == owner.pid
                pids.append(child_pid)
            deadline = time.monotonic() + 60  # both children passed their --supervisor-pid check (the server's pid)
            while not all((tmp_path / f"{n}.log").read_text().strip() for n in "ab") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [int((tmp_path / f"{n}.log").read_text()) for n in "ab"] == pids
            sups[0].kill()  # supervisor a: SIGKILL, nothing it could clean up itself
            sups[0].wait()
            assert _gone(pids[0], 20.0), "the dead supervisor's child still runs"
            assert psutil.Process(pids[1]).status() != psutil.STATUS_ZOMBIE  # b's child runs on
            sups[1].stdin.write("\n")
            sups[1].stdin.flush()
            assert sups[1].stdout.readline().strip() == "7"  # and b still forks and hears its exit codes
            assert owner.server_status() == {"clients": 1, "children": 1, "rejected": 0}
            sups[1].stdin.write("\n")  # b ends normally with its sleeper still running: the server ends it too
            sups[1].stdin.flush()
            assert sups[1].wait(timeout=60) == 0
            assert _gone(pids[1], 20.0)
        finally:
            for sup in sups:
                if sup.poll() is None:
                    sup.kill()
                    sup.wait()
        assert owner._proc.poll() is None


def test_a_bad_request_is_rejected_and_counted_and_the_server_goes_on(tmp_path):
    env = _env(tmp_path)
    exiter = [sys.executable, "-m", "fs_exiter", "4"]
    bad = [
        (b"not json", [1, 2]),
        (b"[1, 2]", []),
        (_fork_request([sys.executable, "-c", "print(1)"], env), [1, 2]),  # only `python -m MODULE`
        (json.dumps({"argv": exiter, "env": env, "cwd": os.getcwd(), "fds": [1, 2, 3]}).encode(), [1, 2]),  # 3 named, 2 sent
        (json.dumps({"argv": exiter, "env": {"A": 1}, "cwd": os.getcwd(), "fds": []}).encode(), []),
        (_fork_request(exiter, {**env, "OMP_NUM_THREADS": "13"}), [1, 2]),  # the preload read another value
    ]
    with shared_server(env) as (owner, path):
        raw, _ = _raw_client(path)
        try:
            for i, (data, fds) in enumerate(bad, 1):
                socket.send_fds(raw, [data], fds)
                answer = _next_message(raw, 30.0)
                assert answer is not None and answer["rejected"] == i and answer["error"], answer
            assert "OMP_NUM_THREADS" in answer["error"]
            socket.send_fds(raw, [_fork_request(exiter, env)], [1, 2])  # the same connection still forks
            got = _until_exit(raw)
            assert got == [{"pid": got[0]["pid"]}, {"exit": got[0]["pid"], "code": 4}]
        finally:
            raw.close()
        assert _wait_for_clients(owner, 0) == {"clients": 0, "children": 0, "rejected": len(bad)}
        assert owner.popen(exiter, env=env).wait(timeout=60) == 4


def test_a_client_refuses_a_server_whose_preload_read_another_environment_and_up_starts_its_own(tmp_path, monkeypatch):
    env = _env(tmp_path)
    with shared_server(env) as (owner, path):
        with pytest.raises(RuntimeError, match="its preload read another OMP_NUM_THREADS"):
            ForkServer.connect(path, {**env, "OMP_NUM_THREADS": "13"})
        with pytest.raises(RuntimeError, match="did not preload torch"):
            ForkServer.connect(path, env, ("torch",))
        cpus = os.sched_getaffinity(0)
        if len(cpus) > 1:  # a client on fewer CPUs: its children would run on the server's
            os.sched_setaffinity(0, {min(cpus)})
            try:
                with pytest.raises(RuntimeError, match="would get another CPU affinity"):
                    ForkServer.connect(path, env)
            finally:
                os.sched_setaffinity(0, cpus)
        os.chmod(os.path.dirname(path), 0o755)
        with pytest.raises(OSError, match="mode 0700"):
            ForkServer.connect(path, env)
        os.chmod(os.path.dirname(path), 0o700)
        # up's launcher: the shared server named, but its preload list lacks what up needs: its own, and the log says why
        cfg = load_config(TINY_CPU)
        lines: list[str] = []
        monkeypatch.setenv(SHARED_FORKSERVER_ENV, path)
        launcher = launcher_for(cfg, env, lines.append)
        try:
            assert launcher is not None and launcher.pid != owner.pid and launcher._proc is not None
            assert lines[0].startswith(f"[up] shared fork server {path} not used (it did not preload dflash_ipc.procs.drafter, "), lines
            assert lines[1].startswith("[up] fork server (run.launcher) ready after"), lines
        finally:
            launcher.close()
        assert owner.server_status()["rejected"] == 0


def test_a_server_refuses_to_listen_in_a_directory_others_can_enter(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(RuntimeError, match="refused to start: OSError: .* must be a directory of this user with mode 0700"):
        ForkServer.start([], dict(os.environ), listen=str(directory / "fs.sock"))
    assert not (directory / "fs.sock").exists()


def test_shared_servers_own_children_die_with_it(tmp_path):
    """The owner (a pytest worker) SIGKILLed: the server dies of its death signal, every client's child of its own."""
    env = _env(tmp_path)
    script = textwrap.dedent(
        """
        import os, sys, time
        from dflash_ipc.runtime.forkserver import ForkServer
        owner = ForkServer.start([], dict(os.environ), listen=sys.argv[1])
        client = ForkServer.connect(sys.argv[1], dict(os.environ))
        child = client.popen([sys.executable, "-m", "fs_sleeper", str(client.pid)], stdout=open(sys.argv[2], "ab"))
        print(owner.pid, child.pid, flush=True)
        time.sleep(600)
        """
    )
    directory = tempfile.mkdtemp(prefix="dflash-fs-test-")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, os.path.join(directory, "fs.sock"), str(tmp_path / "c.log")],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        server_pid, child_pid = map(int, proc.stdout.readline().split())
        deadline = time.monotonic() + 60
        while not (tmp_path / "c.log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _gone(server_pid, 20.0) and _gone(child_pid, 20.0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("unbuffered", [None, "0", "1"], ids=["caller-lacks-it", "caller-sets-0", "caller-sets-1"])
def test_the_probe_forks_from_a_shared_server_whatever_the_callers_environment(tmp_path, monkeypatch, unbuffered):
    """The server preloads with the children's environment (launch.child_env), which sets PYTHONUNBUFFERED
    whatever the caller's shell exported: the probe asks for that environment too, so a plain login shell
    (no PYTHONUNBUFFERED) and one that exports it are served alike."""
    from dflash_ipc.runtime.launch import child_env
    from dflash_ipc.runtime.probe import run_probe

    with shared_server({**child_env(), "PYTHONPATH": str(REPO)}) as (owner, path):
        if unbuffered is None:
            monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
        else:
            monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)
        monkeypatch.setenv("PYTHONPATH", str(REPO))
        client = ForkServer.connect(path, child_env())
        try:
            assert run_probe(load_config(TINY_CPU), isolate=True, launcher=client) is None  # a check, no run dir: no plan
        finally:
            client.close()
        assert owner.server_status()["rejected"] == 0
