"""The start-up handshake between a coordinator (supervisor) and its children.

::

    coordinator                                  child (role, rank)
    ───────────                                  ──────────────────
    bind ROUTER sock/sup                         create ring (targets), bind its PULL
                           ◀── Hello ─────────── (role, rank, pid, device, protocol, ring, endpoint)
    wait for every child   (run.handshake_timeout_s; a missing child is named in the error)
                           ─── Start ──────────▶ (all ring descriptors, all endpoints)
                                                 import rings once, connect PUSH sockets
                           ◀── Ready ───────────
    all Ready: RUNNING (systemd READY=1)

A child that dies during the handshake is reported by the coordinator's sentinel check
(``is_alive``), not by the timeout, so the error names it at once.
"""

from __future__ import annotations

import time
from typing import Callable

import zmq

from dflash_ipc.control import protocol
from dflash_ipc.control.channels import decode_or_reject
from dflash_ipc.control.protocol import Dead, Hello, Ready, RejectCounter, Start


class HandshakeError(RuntimeError):
    pass


def identity(role: str, rank: int) -> bytes:
    return f"{role}-{rank}".encode()


def _wait_for(
    router: zmq.Socket,
    expected: set[bytes],
    want: type,
    timeout_s: float,
    setting: str,
    rejects: RejectCounter,
    is_alive: Callable[[], str | None],
    phase: str,
    on_other: Callable[[bytes, protocol.Message], None] | None = None,
) -> dict[bytes, protocol.Message]:
    got: dict[bytes, protocol.Message] = {}
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while set(got) != expected:
        dead = is_alive()
        if dead:
            raise HandshakeError(f"{dead} during the handshake ({phase})")
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(k.decode() for k in expected - set(got))
            raise HandshakeError(
                f"handshake timed out after {timeout_s:g} s waiting for {phase} from {', '.join(missing)}; "
                f"raise {setting} if start-up is just slow (large models load for minutes)"
            )
        if not poller.poll(min(left, 0.2) * 1000):
            continue
        ident, frame = router.recv_multipart()
        msg = decode_or_reject(frame, rejects)
        if msg is None:
            continue
        if isinstance(msg, Dead):
            raise HandshakeError(f"{msg.role}-{msg.rank} failed during the handshake: {msg.error}")
        if ident not in expected:
            rejects.reject("unexpected_peer", f"{ident!r} is not part of this run")
            continue
        if isinstance(msg, want):
            if isinstance(msg, Hello) and msg.protocol != protocol.PROTOCOL_VERSION:
                raise HandshakeError(f"{ident.decode()} speaks protocol {msg.protocol}, expected {protocol.PROTOCOL_VERSION}")
            got[ident] = msg
        elif on_other is not None:
            # A fast child may already heartbeat, or even finish, before the slowest is Ready.
            on_other(ident, msg)
    return got


def coordinate(
    router: zmq.Socket,
    expected: list[tuple[str, int]],
    timeout_s: float,
    rejects: RejectCounter,
    is_alive: Callable[[], str | None] = lambda: None,
    setting: str = "run.handshake_timeout_s",
    on_other: Callable[[bytes, protocol.Message], None] | None = None,
) -> dict[tuple[str, int], Hello]:
    """Run the whole handshake; returns the Hellos keyed by (role, rank)."""
    idents = {identity(r, k): (r, k) for r, k in expected}
    hellos = _wait_for(router, set(idents), Hello, timeout_s, setting, rejects, is_alive, "Hello")
    by_key = {idents[i]: m for i, m in hellos.items()}
    targets = sorted(k for k in by_key if k[0] in ("target", "producer"))
    drafters = sorted(k for k in by_key if k[0] in ("drafter", "consumer"))
    info = by_key[drafters[0]].info if drafters else None
    resume = info.resume if info is not None else None
    start = Start(
        rings=[by_key[k].ring for k in targets],
        target_endpoints=[by_key[k].endpoint for k in targets],
        drafter_endpoints=[by_key[k].endpoint for k in drafters],
        resume=resume,
    )
    frame = protocol.encode(start)
    for ident in idents:
        router.send_multipart([ident, frame])
    _wait_for(router, set(idents), Ready, timeout_s, setting, rejects, is_alive, "Ready", on_other)
    return by_key


def child_handshake(dealer: zmq.Socket, hello: Hello, timeout_s: float, rejects: RejectCounter, should_stop: Callable[[], bool] = lambda: False) -> Start:
    """Send Hello, wait for Start (the caller sends Ready once it has connected)."""
    dealer.send(protocol.encode(hello))
    deadline = time.monotonic() + timeout_s
    while True:
        if should_stop():
            raise HandshakeError("stopped during the handshake")
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError(f"no Start from the supervisor within {timeout_s:g} s (run.handshake_timeout_s)")
        if not dealer.poll(min(left, 0.2) * 1000):
            continue
        msg = decode_or_reject(dealer.recv(), rejects)
        if isinstance(msg, Start):
            return msg
        if isinstance(msg, protocol.Shutdown):
            raise HandshakeError(f"shut down during the handshake: {msg.reason}")


def send_ready(dealer: zmq.Socket, role: str, rank: int) -> None:
    dealer.send(protocol.encode(Ready(role=role, rank=rank)))
