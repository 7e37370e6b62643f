"""The fork server's SERVING state (the diagram in :mod:`dflash_ipc.runtime.forkserver`), for its owner
and, in shared mode, any number of clients connected to its listening socket: each connection owns the
children it asked for, hears of their exits alone, and takes them down when it goes away.

What the wire carries is JSON (never pickle) with the descriptors in SCM_RIGHTS; every request is
checked here before anything forks (:func:`check_request`), and a bad one is answered, counted and
survived.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path
from typing import Any

from dflash_ipc.runtime.launch import remove_supervisor_sockets

MAX_MESSAGE = 1 << 22
#: Variables the preload reads at import (the interpreter's, the loader's and malloc's, the OpenMP/BLAS
#: thread pools, torch's, dynamo's and inductor's settings, transformers' and the hub's): a shared server's must match.
#: Not those read only at run time, in the child (TOKENIZERS_PARALLELISM, which transformers' generate sets).
PRELOAD_ENV_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "HF_",
    "TRANSFORMERS_",
)
#: How long the children of a shared server's client that went away have after SIGTERM, before SIGKILL.
ORPHAN_GRACE_S = 30.0


def preload_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` a preload reads (:data:`PRELOAD_ENV_PREFIXES`)."""
    return {k: v for k, v in env.items() if k.startswith(PRELOAD_ENV_PREFIXES)}


def preload_env_differences(server: dict[str, str], env: dict[str, str]) -> list[str]:
    """The preload-read variables on which ``env`` disagrees with a server's environment, sorted."""
    mine = preload_env(env)
    return sorted(k for k in server.keys() | mine.keys() if server.get(k) != mine.get(k))


def process_context() -> dict[str, Any]:
    """What a forked child inherits from its server rather than from its supervisor, beyond the
    environment: the namespaces (a client under ``unshare -m`` sees another /dev/shm) and the CPU affinity."""
    namespaces = {}
    for name in ("mnt", "ipc", "net", "pid", "uts", "user", "cgroup"):
        with contextlib.suppress(OSError):
            namespaces[f"{name} namespace"] = os.readlink(f"/proc/self/ns/{name}")
    return {**namespaces, "CPU affinity": sorted(os.sched_getaffinity(0))}


def context_differences(server: dict[str, Any]) -> list[str]:
    """Where this process's :func:`process_context` differs from a server's, sorted."""
    mine = process_context()
    return sorted(k for k in server.keys() | mine.keys() if server.get(k) != mine.get(k))


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED: pid, uid, gid)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def check_private_dir(path: str) -> None:
    """OSError unless the directory of socket ``path`` is this user's and 0700 (no one else may connect or swap it)."""
    directory = os.lstat(os.path.dirname(os.path.abspath(path)))
    if not stat.S_ISDIR(directory.st_mode) or directory.st_uid != os.getuid() or directory.st_mode & 0o077:
        raise OSError(f"{os.path.dirname(path)} must be a directory of this user with mode 0700")


def listen_at(path: str) -> socket.socket:
    """The shared server's listening socket, at ``path`` in a private directory of this user."""
    check_private_dir(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    return listener


class _Connection:
    """One client of the server: the owner's socketpair (``owner``) or an accepted connection."""

    def __init__(self, sock: socket.socket, owner: bool):
        self.sock = sock
        self.owner = owner
        self.children: set[int] = set()
        self.run_dirs: set[str] = set()  # the --run-dir of its children: a dead supervisor's socket files


class Server:
    """SERVING (runtime.forkserver's diagram) for one owner and any number of clients."""

    def __init__(self, owner: socket.socket, listener: socket.socket | None, hello: dict):
        self.conns = {owner.fileno(): _Connection(owner, owner=True)}
        self.listener = listener
        self.hello = hello
        self.pidfds: dict[int, tuple[int, _Connection]] = {}  # pidfd -> (pid, its connection)
        self.orphans: dict[int, float] = {}  # pid of a gone client's child -> when it gets SIGKILL
        self.rejected = 0

    def serve(self) -> tuple[dict, list[int]] | None:
        """Fork on request until the owner's EOF; returns None in the server, the request in a forked child."""
        while True:
            watched = [*self.conns, *self.pidfds, *([self.listener] if self.listener is not None else [])]
            timeout = max(0.0, min(self.orphans.values()) - time.monotonic()) if self.orphans else None
            readable, _, _ = select.select(watched, [], [], timeout)
            # the objects, not their numbers: a connection hung up below frees its number for the next accept
            talking = [self.conns[fd] for fd in readable if fd in self.conns]
            self._kill_overdue_orphans()
            for pidfd in [fd for fd in readable if fd in self.pidfds]:
                self._reap(pidfd)
            if self.listener is not None and self.listener in readable:
                self._accept()
            for conn in talking:
                if conn.sock.fileno() < 0:  # hung up since select (a report to it failed)
                    continue
                data, fds, flags, _ = receive_request(conn.sock)
                if not data:
                    if conn.owner:
                        return None
                    self._hang_up(conn)
                    continue
                request = self._handle(conn, data, fds, flags)
                if request is not None:
                    return request

    def _handle(self, conn: _Connection, data: bytes, fds: list[int], flags: int) -> tuple[dict, list[int]] | None:
        try:
            request = json.loads(data)
            if isinstance(request, dict) and request.get("op") == "status":
                clients = len(self.conns) - 1
                children = len(self.pidfds)
                self._send(conn, {"status": {"clients": clients, "children": children, "rejected": self.rejected}})
                for fd in fds:
                    os.close(fd)
                return None
            check_request(request, fds, flags, self.hello["preload_env"] if self.listener is not None else None)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            for fd in fds:
                os.close(fd)
            self.rejected += 1
            self._send(conn, {"error": f"{type(e).__name__}: {e}", "rejected": self.rejected})
            return None
        if pid == 0:  # the descriptors are closed with every other one of the server in _run_child
            for other in self.conns.values():
                other.sock.detach()
            if self.listener is not None:
                self.listener.detach()
            return request, fds
        for fd in fds:
            os.close(fd)
        self.pidfds[os.pidfd_open(pid)] = (pid, conn)
        conn.children.add(pid)
        if "--run-dir" in request["argv"][:-1]:
            conn.run_dirs.add(request["argv"][request["argv"].index("--run-dir") + 1])
        self._send(conn, {"pid": pid})
        return None

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if peer_uid(sock) != os.getuid():
            self.rejected += 1
            sock.close()
            return
        conn = self.conns[sock.fileno()] = _Connection(sock, owner=False)
        self._send(conn, self.hello)

    def _send(self, conn: _Connection, msg: dict) -> None:
        if conn.sock.fileno() < 0:
            return  # hung up: nothing is reported to it any more
        try:
            conn.sock.send(json.dumps(msg).encode())
        except OSError:
            if conn.owner:
                raise
            self._hang_up(conn)

    def _hang_up(self, conn: _Connection) -> None:
        """A client gone (EOF): its live children get SIGTERM now, SIGKILL after ORPHAN_GRACE_S."""
        del self.conns[conn.sock.fileno()]
        conn.sock.close()
        for pid in conn.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # not reaped yet (its pidfd is watched): the pid is still this child's
            self.orphans[pid] = time.monotonic() + ORPHAN_GRACE_S

    def _kill_overdue_orphans(self) -> None:
        now = time.monotonic()
        for pid, deadline in self.orphans.items():
            if deadline <= now:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.orphans[pid] = float("inf")

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.pidfds.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        conn.children.discard(pid)
        if self.orphans.pop(pid, None) is None:
            self._send(conn, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        elif not conn.children:  # the dead supervisor's last child: what it would have removed on its way out
            for run_dir in conn.run_dirs:
                remove_supervisor_sockets(Path(run_dir))


def receive_request(sock: socket.socket) -> tuple[bytes, list[int], int, Any]:
    try:
        return socket.recv_fds(sock, MAX_MESSAGE, 64)
    except ConnectionResetError:
        return b"", [], 0, None


def check_request(request: Any, fds: list[int], flags: int, server_env: dict[str, str] | None) -> None:
    """ValueError/TypeError unless ``request`` is a fork request this server can serve."""
    if flags & socket.MSG_TRUNC or not isinstance(request, dict):
        raise ValueError("truncated request, or not a JSON object")
    argv, env, cwd, wanted = request["argv"], request["env"], request["cwd"], request["fds"]
    if not isinstance(argv, list) or len(argv) < 3 or argv[1] != "-m" or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be a `python -m MODULE ...` command line of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError("env must map strings to strings")
    if not isinstance(cwd, str) or not isinstance(wanted, list) or not all(type(fd) is int and fd >= 0 for fd in wanted):
        raise TypeError("cwd must be a string and fds a list of descriptor numbers")
    if len(fds) != len(wanted):
        raise ValueError(f"{len(wanted)} descriptors named, {len(fds)} sent")
    differ = preload_env_differences(server_env, env) if server_env is not None else []
    if differ:
        raise ValueError(f"the environment differs from this server's preload in {', '.join(differ)}")
