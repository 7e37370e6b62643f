"""ZeroMQ endpoints of one run: ``ipc://`` sockets in a private (0700) directory.

Topology (all sockets carry msgpack frames from :mod:`dflash_ipc.control.protocol`)::

    supervisor  ROUTER bind  sock/sup           <- every child's DEALER (identity role-rank)
    supervisor  REP    bind  sock/status        <- `dflash-ipc status` (read-only snapshot)
    target r    PULL   bind  sock/t<r>          <- drafters' PUSH (SlotFree, Load)
    drafter r   PULL   bind  sock/d<r>          <- targets' PUSH (SlotReady, EndOfData)

A producer holds one PUSH per drafter, so it addresses the drafter the router chose.
Unix socket paths are limited to ~107 bytes: when the run directory is deeper than that,
the sockets live in a private temporary directory and ``RUN_DIR/sock`` is a symlink to it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import zmq

from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import Message, ProtocolError, RejectCounter

log = logging.getLogger(__name__)

_MAX_SOCK_PATH = 100


def make_private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def prepare_socket_dir(run_dir: Path) -> Path:
    """Create RUN_DIR/sock (0700), or a short private temp dir linked from there."""
    link = run_dir / "sock"
    if link.is_symlink():
        target = Path(os.readlink(link))
        if target.is_dir():
            return target
        link.unlink()
    if len(str(link.resolve() if link.exists() else link.absolute())) + 8 <= _MAX_SOCK_PATH:
        return make_private_dir(link)
    short = Path(tempfile.mkdtemp(prefix="dfi-"))
    os.chmod(short, 0o700)
    if link.exists():
        link.rmdir()
    link.symlink_to(short)
    return short


def socket_dir(run_dir: Path) -> Path:
    link = run_dir / "sock"
    return Path(os.readlink(link)) if link.is_symlink() else link


def endpoint(run_dir: Path, name: str) -> str:
    return f"ipc://{socket_dir(run_dir) / name}"


def supervisor_endpoint(run_dir: Path) -> str:
    return endpoint(run_dir, "sup")


def status_endpoint(run_dir: Path) -> str:
    return endpoint(run_dir, "status")


def target_endpoint(run_dir: Path, rank: int) -> str:
    return endpoint(run_dir, f"t{rank}")


def drafter_endpoint(run_dir: Path, rank: int) -> str:
    return endpoint(run_dir, f"d{rank}")


def _tune(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    return sock


def bind(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = _tune(ctx.socket(kind))
    sock.bind(addr)
    if addr.startswith("ipc://"):
        try:
            os.chmod(addr[len("ipc://") :], 0o600)
        except FileNotFoundError:
            pass
    return sock


def connect(ctx: zmq.Context, kind: int, addr: str, identity: bytes | None = None) -> zmq.Socket:
    sock = _tune(ctx.socket(kind))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msg: Message, flags: int = 0) -> None:
    sock.send(protocol.encode(msg), flags)


def recv_decoded(sock: zmq.Socket, rejects: RejectCounter) -> Message | None:
    """Receive one frame without blocking; a malformed frame is counted and dropped."""
    try:
        frame = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    return decode_or_reject(frame, rejects)


def decode_or_reject(frame: bytes, rejects: RejectCounter) -> Message | None:
    try:
        return protocol.decode(frame)
    except ProtocolError as e:
        rejects.reject(e.kind, e.detail)
        return None


def drain(sock: zmq.Socket, rejects: RejectCounter, limit: int = 1000) -> list[Message]:
    out = []
    for _ in range(limit):
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            break
        msg = decode_or_reject(frame, rejects)
        if msg is not None:
            out.append(msg)
    return out
