"""ZeroMQ endpoints of one run: ``ipc://`` sockets in a private (0700) directory (the default;
``run.control = "tcp"`` binds the same sockets on tcp:// with CURVE: :mod:`dflash_ipc.control.plane`).

Topology (all sockets carry msgpack frames from :mod:`dflash_ipc.control.protocol`)::

    supervisor  ROUTER bind  sock/sup           <- every child's DEALER (identity role-rank)
    supervisor  REP    bind  sock/status        <- `dflash-ipc status` (read-only snapshot)
    target r    PULL   bind  sock/t<r>          <- drafters' PUSH (SlotFree, Load)
    drafter r   PULL   bind  sock/d<r>          <- targets' PUSH (SlotReady, EndOfData)

A producer holds one PUSH per drafter, so it addresses the drafter the router chose.
Every receive path reads whole multi-part messages (``recv_multipart``) and checks the number of
parts, so a peer that sends more or fewer parts than expected is rejected and counted
(``bad_frame_count``), never unpacked into a crash.

Authentication (:class:`PeerAuth`): the supervisor draws a random key for each attempt of a
run and hands it to every child it spawns through an inherited pipe (never argv, env or a file).
Every frame a child sends (to the supervisor or to a peer) is an envelope
``[sender identity, counter (8 bytes), body, HMAC-SHA256(key, sender|counter|body)[:16]]``; the
receiver checks the tag, that the sender is a member it expects, and that the counter grows
per sender (a replayed frame is refused). A process without the key (a stray tool, a child
of an earlier attempt) cannot make a frame any member accepts. The routing identity of a
child's DEALER is derived from the key too (:meth:`PeerAuth.route`, ``target-0.<16 hex>``): a
process without the key cannot occupy a member's identity on the supervisor's ROUTER (ZeroMQ
keeps the first connection under an identity) and so cannot lock the member out.

Unix socket paths are limited to ~107 bytes: when the run directory is deeper than that,
the sockets live in a private temporary directory and ``RUN_DIR/sock`` is a symlink to it
(:func:`prepare_socket_dir`: followed only to a directory of this user no one else can enter).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

import zmq

from dflash_ipc.control import protocol
from dflash_ipc.control.protocol import Message, ProtocolError, RejectCounter
from dflash_ipc.rundir import fsutil

log = logging.getLogger(__name__)

_MAX_SOCK_PATH = 100


def is_own_private_dir(path: Path) -> bool:
    """``path`` is a directory (not a link) of this user that no other user can enter: a temp directory
    this run made, not one another user made at the same name after /tmp was cleaned."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def prepare_socket_dir(run_dir: Path) -> Path:
    """Create RUN_DIR/sock (0700), or a short private temp dir linked from there.

    A link left by an earlier run is followed only to a directory of this user, mode 0700; else (gone,
    or made again by someone else after a /tmp clean-up) the link gets a new temp dir of its own
    (``mkdtemp``: unique, 0700 whatever the umask), and the directory it named is left alone."""
    link = run_dir / "sock"
    if link.is_symlink():
        target = Path(os.readlink(link))
        if target.is_absolute() and is_own_private_dir(target):
            return target
        link.unlink()
    if len(str(link.resolve() if link.exists() else link.absolute())) + 8 <= _MAX_SOCK_PATH:
        return fsutil.make_private_dir(link, root=run_dir)
    short = Path(tempfile.mkdtemp(prefix="dfi-"))
    if link.exists():
        link.rmdir()
    link.symlink_to(short)
    return short


def socket_dir(run_dir: Path) -> Path:
    link = run_dir / "sock"
    return Path(os.readlink(link)) if link.is_symlink() else link


def remove_socket_files(run_dir: Path, n_targets: int, n_drafters: int) -> None:
    """The bound ipc socket files of a run (children killed by a signal leave theirs)."""
    sock_dir = socket_dir(run_dir)
    for name in ["sup", "status", *(f"t{r}" for r in range(n_targets)), *(f"d{r}" for r in range(n_drafters))]:
        (sock_dir / name).unlink(missing_ok=True)


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


def tune(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 10000)
    sock.setsockopt(zmq.RCVHWM, 10000)
    return sock


def bind(ctx: zmq.Context, kind: int, addr: str) -> zmq.Socket:
    sock = tune(ctx.socket(kind))
    sock.bind(addr)
    if addr.startswith("ipc://"):
        try:
            os.chmod(addr[len("ipc://") :], 0o600)
        except FileNotFoundError:
            pass
    return sock


def connect(ctx: zmq.Context, kind: int, addr: str, identity: bytes | None = None) -> zmq.Socket:
    sock = tune(ctx.socket(kind))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


RUN_KEY_BYTES = 32
_TAG_BYTES = 16
_COUNTER_BYTES = 8


def new_run_key() -> bytes:
    return secrets.token_bytes(RUN_KEY_BYTES)


class PeerAuth:
    """Seals this process's outgoing frames and opens incoming ones (see the module docstring).

    ``key=None`` (the transport benchmark and unit tests): no envelope, one part per message, and
    no sender is known. ``peers``: the identities whose frames are accepted (None: any member)."""

    def __init__(self, key: bytes | None, me: bytes = b"", peers: set[bytes] | None = None):
        if key is not None and len(key) < 16:
            raise ValueError(f"run key of {len(key)} bytes; expected {RUN_KEY_BYTES}")
        self.key = key
        self.me = me
        self.peers = peers
        self._counter = 0
        self._last_seen: dict[bytes, int] = {}

    def _tag(self, sender: bytes, counter: bytes, body: bytes) -> bytes:
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        mac.update(len(sender).to_bytes(2, "big") + sender + counter)
        mac.update(body)
        return mac.digest()[:_TAG_BYTES]

    def route(self, name: bytes) -> bytes:
        """The ROUTER identity of member ``name`` for this key (``name`` itself without a key)."""
        if self.key is None:
            return name
        return name + b"." + hmac.new(self.key, b"route|" + name, hashlib.sha256).hexdigest()[:16].encode()

    def seal(self, body: bytes) -> list[bytes]:
        if self.key is None:
            return [body]
        self._counter += 1
        counter = self._counter.to_bytes(_COUNTER_BYTES, "big")
        return [self.me, counter, body, self._tag(self.me, counter, body)]

    def open(self, parts: list[bytes], rejects: RejectCounter) -> tuple[bytes | None, Message] | None:
        """The sender and message of one multi-part message; None (rejected, counted) otherwise."""
        if self.key is None:
            if len(parts) != 1:
                rejects.reject("bad_frame_count", f"{len(parts)} parts, expected 1")
                return None
            msg = decode_or_reject(parts[0], rejects)
            return None if msg is None else (None, msg)
        if len(parts) != 4:
            rejects.reject("bad_frame_count", f"{len(parts)} parts, expected 4 (sender, counter, body, tag)")
            return None
        sender, counter, body, tag = parts
        if len(counter) != _COUNTER_BYTES or len(tag) != _TAG_BYTES or not hmac.compare_digest(self._tag(sender, counter, body), tag):
            rejects.reject("bad_auth", f"frame claiming to be from {sender[:40]!r} fails authentication")
            return None
        if self.peers is not None and sender not in self.peers:
            rejects.reject("unexpected_peer", f"{sender[:40]!r} is not a peer of {self.me.decode(errors='replace')}")
            return None
        n = int.from_bytes(counter, "big")
        if n <= self._last_seen.get(sender, 0):
            rejects.reject("replayed", f"frame {n} from {sender.decode(errors='replace')} after {self._last_seen.get(sender, 0)}")
            return None
        msg = decode_or_reject(body, rejects)
        if msg is None:
            return None
        self._last_seen[sender] = n
        return sender, msg


def send(sock: zmq.Socket, msg: Message, auth: PeerAuth | None = None, flags: int = 0) -> None:
    body = protocol.encode(msg)
    sock.send_multipart(auth.seal(body) if auth is not None else [body], flags)


def decode_or_reject(frame: bytes, rejects: RejectCounter) -> Message | None:
    try:
        return protocol.decode(frame)
    except ProtocolError as e:
        rejects.reject(e.kind, e.detail)
        return None


def recv_parts(sock: zmq.Socket, limit: int = 1000) -> list[list[bytes]]:
    """Up to ``limit`` whole multi-part messages waiting on ``sock``, without blocking."""
    out = []
    for _ in range(limit):
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


def drain_from(sock: zmq.Socket, auth: PeerAuth | None, rejects: RejectCounter, limit: int = 1000) -> list[tuple[bytes | None, Message]]:
    """Every waiting message that opens, with its sender; the rest rejected and counted."""
    auth = auth if auth is not None else PeerAuth(None)
    out = []
    for parts in recv_parts(sock, limit):
        got = auth.open(parts, rejects)
        if got is not None:
            out.append(got)
    return out


def drain(sock: zmq.Socket, rejects: RejectCounter, limit: int = 1000, auth: PeerAuth | None = None) -> list[Message]:
    return [msg for _, msg in drain_from(sock, auth, rejects, limit)]
