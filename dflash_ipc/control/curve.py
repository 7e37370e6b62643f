"""ZeroMQ CURVE for a control plane over TCP (``run.control = "tcp"``): per-run keys, servers that
accept only the run's clients, and every refused connection counted.

Over ``ipc://`` the 0700 run directory keeps strangers off the sockets; over ``tcp://`` anyone who
can reach the port can connect, so every connection must prove it holds the run's client key::

    supervisor at start-up (write_run_keys)          RUN_DIR/keys/ (0700; files 0600)
        server.key, server.key_secret                 every bound socket (ROUTER, REP, PULL)
        client.key, client.key_secret                 every connecting socket (DEALER, PUSH, REQ)
        clients/client.key                            the only public keys a server accepts

    peer connects ── CURVE handshake ──▶ ZAP handler (zmq.auth, one thread per context)
        its public key in clients/?  yes: connected, frames flow (and are still sealed by PeerAuth)
                                      no, no CURVE at all, or a wrong server key: refused, and the
                                      server socket's monitor reports a failed handshake, which
                                      :meth:`CurveGuard.count_refusals` turns into a counted
                                      ``unauthenticated_peer`` rejection (``status --json``)

Key files are written by the supervisor under umask 077 and chmod 0600, in its own run directory
(multi-node runs too: a node's control plane links only that node's processes, so each node draws
its own keys and nothing secret goes to the shared directory). :mod:`dflash_ipc.control.plane`
puts the guard on the run's sockets. Nothing here replaces :class:`~dflash_ipc.control.channels.PeerAuth`:
CURVE keeps strangers off the sockets and encrypts the link; the run key still seals each frame.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from dflash_ipc.control.protocol import RejectCounter

KEYS_DIR = "keys"
CLIENTS_DIR = "clients"
REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_EVENT_NAMES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (protocol: no CURVE, or a wrong server key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake refused (client key not of this run)",
}


def curve_available() -> bool:
    return bool(zmq.has("curve"))


@dataclass(frozen=True)
class RunKeys:
    """One run's CURVE keys (z85 bytes) and the directory of accepted client public keys."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    clients_dir: Path


def _private_file(path: Path) -> None:
    os.chmod(path, 0o600)


def write_run_keys(key_root: Path) -> RunKeys:
    """Draw a fresh server and client key pair into ``key_root/keys`` (0700 directory, 0600 files)."""
    if not curve_available():
        raise RuntimeError('this pyzmq/libzmq has no CURVE support: run.control = "tcp" cannot authenticate peers; use "ipc"')
    keys = key_root / KEYS_DIR
    if keys.exists():
        shutil.rmtree(keys)
    old_umask = os.umask(0o077)
    try:
        keys.mkdir(parents=True, mode=0o700)
        (keys / CLIENTS_DIR).mkdir(mode=0o700)
        for name in ("server", "client"):
            public, secret = zmq.auth.create_certificates(str(keys), name)
            _private_file(Path(public))
            _private_file(Path(secret))
        shutil.copy(keys / "client.key", keys / CLIENTS_DIR / "client.key")
        _private_file(keys / CLIENTS_DIR / "client.key")
    finally:
        os.umask(old_umask)
    return read_run_keys(key_root)


def read_run_keys(key_root: Path) -> RunKeys:
    keys = key_root / KEYS_DIR
    server_public, server_secret = zmq.auth.load_certificate(str(keys / "server.key_secret"))
    client_public, client_secret = zmq.auth.load_certificate(str(keys / "client.key_secret"))
    if server_secret is None or client_secret is None:
        raise RuntimeError(f"{keys}: a secret key file holds no secret key")
    return RunKeys(server_public, server_secret, client_public, client_secret, keys / CLIENTS_DIR)


def curve_client(sock: zmq.Socket, keys: RunKeys) -> zmq.Socket:
    """Make ``sock`` (not yet connected) a CURVE client holding the run's client key."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
    return sock


class CurveGuard:
    """One context's CURVE side: its ZAP handler, the server sockets it watches, and the count of
    refused connections. ``close`` before the context terminates."""

    def __init__(self, ctx: zmq.Context, keys: RunKeys, rejects: RejectCounter):
        self.ctx = ctx
        self.keys = keys
        self.rejects = rejects
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(keys.clients_dir))
        self._monitors: list[zmq.Socket] = []

    def serve(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` (not yet bound) a CURVE server of this run, its refusals watched."""
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.curve_server = True
        self._monitors.append(sock.get_monitor_socket(REFUSED_EVENTS))
        return sock

    def client(self, sock: zmq.Socket) -> zmq.Socket:
        return curve_client(sock, self.keys)

    def count_refusals(self) -> int:
        """Count every refused handshake reported since the last call (never blocks)."""
        n = 0
        for mon in self._monitors:
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                n += 1
                what = _EVENT_NAMES.get(event["event"], "handshake failed")
                self.rejects.reject("unauthenticated_peer", f"{what} on {event['endpoint']!r} (code {event['value']})")
        return n

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(linger=0)
        self._monitors = []
        self._auth.stop()
