"""Where a run's control sockets live: ``ipc://`` files in the private run directory (the default),
or ``tcp://{run.control_host}:<ephemeral port>`` with every connection authenticated by CURVE
(``run.control = "tcp"``, :mod:`dflash_ipc.control.curve`).

::

    socket                 ipc (default)                    tcp
    ─────────────────────  ───────────────────────────────  ──────────────────────────────────────────
    supervisor ROUTER      bind ipc://RUN_DIR/sock/sup      bind tcp://HOST:0 (CURVE server, ZAP: the run's
    supervisor REP         bind ipc://RUN_DIR/sock/status     client key only); refused handshakes counted
    target/drafter PULL    bind ipc://RUN_DIR/sock/t<r>/d<r>  as ``unauthenticated_peer`` in the owner's
                                                                RejectCounter (status --json)
    DEALER, PUSH, REQ      connect                          connect with the run's client key pair

    how peers learn an endpoint         ipc                         tcp
    supervisor ROUTER -> children       derived from RUN_DIR        argv --supervisor-endpoint at spawn
    supervisor REP -> dflash-ipc status derived from RUN_DIR        RUN_DIR/control.json (0600, removed on exit)
    child PULL -> its peers             Hello.endpoint -> Start.*_endpoints (the same for both)

A tcp socket binds one address (``run.control_host``, validated: never a wildcard) and a port the
kernel picks, so two runs on a host never collide and nothing listens on every interface. The
ipc path is exactly :mod:`dflash_ipc.control.channels` as before.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from dflash_ipc.control import channels, curve
from dflash_ipc.control.protocol import RejectCounter
from dflash_ipc.rundir import bounded_json

CONTROL_FILE = "control.json"


def tcp_bind_address(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


def host_of(endpoint: str) -> str:
    """The host of ``tcp://HOST:PORT`` (brackets of an IPv6 address removed)."""
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


@dataclass(frozen=True)
class ControlSpec:
    """How one process joins the run's control plane. ``tcp_host`` empty: ipc in ``run_dir``;
    else tcp on that host with the CURVE keys under ``key_root`` (``key_root/keys``)."""

    run_dir: Path
    tcp_host: str = ""
    key_root: Path | None = None

    @property
    def is_tcp(self) -> bool:
        return bool(self.tcp_host)

    @classmethod
    def for_run(cls, run_dir: Path, control: str, host: str, key_root: Path) -> ControlSpec:
        """The supervisor's spec from ``run.control`` / ``run.control_host``."""
        return cls(run_dir, host, key_root) if control == "tcp" else cls(run_dir)


class ControlPlane:
    """One process's ZeroMQ context on the run's control plane: binds servers and connects clients
    the same way over ipc and tcp. Close the sockets first, then :meth:`close`."""

    def __init__(self, spec: ControlSpec, rejects: RejectCounter):
        self.spec = spec
        self.rejects = rejects
        self.ctx = zmq.Context()
        self.keys = curve.read_run_keys(spec.key_root) if spec.is_tcp else None
        self._guard: curve.CurveGuard | None = None
        self._ipc_files: list[str] = []  # removed by close(): a process that exits right after may beat libzmq to it

    def bind(self, kind: int, ipc_endpoint: str) -> tuple[zmq.Socket, str]:
        """A bound server socket and the endpoint peers connect to (``ipc_endpoint`` over ipc)."""
        if not self.spec.is_tcp:
            sock = channels.bind(self.ctx, kind, ipc_endpoint)
            self._ipc_files.append(ipc_endpoint[len("ipc://") :])
            return sock, ipc_endpoint
        if self._guard is None:  # the ZAP thread only where something is served
            self._guard = curve.CurveGuard(self.ctx, self.keys, self.rejects)
        sock = self._guard.serve(channels.tune(self.ctx.socket(kind)))
        host = self.spec.tcp_host
        sock.ipv6 = ":" in host
        try:
            port = sock.bind_to_random_port(tcp_bind_address(host))
        except zmq.ZMQError:
            sock.close()
            raise
        return sock, f"{tcp_bind_address(host)}:{port}"

    def connect(self, kind: int, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
        if not self.spec.is_tcp:
            return channels.connect(self.ctx, kind, endpoint, identity)
        sock = curve.curve_client(channels.tune(self.ctx.socket(kind)), self.keys)
        sock.ipv6 = endpoint.startswith("tcp://[")
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(endpoint)
        return sock

    def count_refusals(self) -> int:
        """Count the refused handshakes on this process's servers since the last call (never blocks)."""
        return self._guard.count_refusals() if self._guard is not None else 0

    def close(self) -> None:
        if self._guard is not None:
            self._guard.close()
            self._guard = None
        self.ctx.term()
        for path in self._ipc_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._ipc_files.clear()


def publish_endpoints(run_dir: Path, supervisor: str, status: str, key_root: Path) -> None:
    """RUN_DIR/control.json (0600): where `dflash-ipc status` finds a tcp run's status socket and keys."""
    path = run_dir / CONTROL_FILE
    tmp = run_dir / f".{CONTROL_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"control": "tcp", "supervisor": supervisor, "status": status, "key_root": str(key_root)}, f)
    os.replace(tmp, path)


def published_endpoints(run_dir: Path) -> dict | None:
    """What :func:`publish_endpoints` wrote (None: an ipc run, or no supervisor running)."""
    try:
        return bounded_json.read(run_dir / CONTROL_FILE)
    except FileNotFoundError:
        return None


def unpublish_endpoints(run_dir: Path) -> None:
    (run_dir / CONTROL_FILE).unlink(missing_ok=True)


@dataclass
class SupervisorSockets:
    """The supervisor's ROUTER (children) and REP (status), bound over ipc or tcp; ``child_argv``
    is what every child needs to find them (nothing over ipc: the run directory says it)."""

    plane: ControlPlane
    router: zmq.Socket
    status: zmq.Socket
    child_argv: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, spec: ControlSpec, rejects: RejectCounter) -> SupervisorSockets:
        plane = ControlPlane(spec, rejects)
        router, status = None, None
        try:
            router, router_ep = plane.bind(zmq.ROUTER, channels.supervisor_endpoint(spec.run_dir))
            status, status_ep = plane.bind(zmq.REP, channels.status_endpoint(spec.run_dir))
            argv: list[str] = []
            if spec.is_tcp:
                publish_endpoints(spec.run_dir, router_ep, status_ep, spec.key_root)
                argv = ["--supervisor-endpoint", router_ep, "--control-keys", str(spec.key_root)]
        except BaseException:
            for sock in (router, status):
                if sock is not None:
                    sock.close()
            plane.close()
            raise
        return cls(plane, router, status, argv)

    def close(self) -> None:
        self.router.close()
        self.status.close()
        self.plane.close()
        if self.plane.spec.is_tcp:
            unpublish_endpoints(self.plane.spec.run_dir)
