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
(``is_alive``), not by the timeout, so the error names it at once. A Dead report ends the
handshake at once, or, with ``on_dead``, is handed to the coordinator, whose check then names
the first failure: a peer's Dead ("connection closed by peer") often follows another child's
SIGKILL before that exit shows. Only members count: a frame
of any shape, from an identity not expected, failing authentication (:class:`PeerAuth`), a Hello
whose pid is not the process the coordinator spawned under that identity, or a Dead that
names another process, is rejected and counted, never fatal. ``tick`` runs every 0.2 s (the
supervisor serves status and notices SIGTERM there).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from dflash_ipc.control import protocol
from dflash_ipc.control.channels import PeerAuth, drain_from, recv_parts
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
    auth: PeerAuth,
    pids: dict[bytes, int] | None,
    tick: Callable[[], None] | None,
    on_other: Callable[[bytes, protocol.Message], None] | None = None,
    on_dead: Callable[[bytes, Dead], None] | None = None,
) -> dict[bytes, protocol.Message]:
    got: dict[bytes, protocol.Message] = {}
    routes = {auth.route(name): name for name in expected}
    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while set(got) != expected:
        if tick is not None:
            tick()
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
        for parts in recv_parts(router, 100):
            got_msg = accept_member(parts, routes, auth, rejects)
            if got_msg is None:
                continue
            ident, msg = got_msg
            if isinstance(msg, Dead):
                if on_dead is None:
                    raise HandshakeError(f"{msg.role}-{msg.rank} failed during the handshake: {msg.error}")
                on_dead(ident, msg)
                continue
            if isinstance(msg, want):
                if isinstance(msg, Hello):
                    if pids is not None and msg.pid != pids.get(ident):
                        rejects.reject("not_our_child", f"Hello as {ident.decode()} from pid {msg.pid}; spawned pid {pids.get(ident)}")
                        continue
                    if msg.protocol != protocol.PROTOCOL_VERSION:
                        raise HandshakeError(f"{ident.decode()} speaks protocol {msg.protocol}, expected {protocol.PROTOCOL_VERSION}")
                got[ident] = msg
            elif on_other is not None:
                # A fast child may already heartbeat, or even finish, before the slowest is Ready.
                on_other(ident, msg)
            else:
                rejects.reject("unexpected_type", f"{type(msg).__name__} from {ident.decode()} while waiting for {phase}")
    return got


def accept_member(
    parts: list[bytes], routes: dict[bytes, bytes], auth: PeerAuth, rejects: RejectCounter
) -> tuple[bytes, protocol.Message] | None:
    """One ROUTER message ``[routing identity, *payload]`` from a member, opened; returns the
    member's name (``role-rank``) and the message, None if rejected. ``routes``: routing identity
    -> name (:meth:`PeerAuth.route`).

    With a key, the sender inside the authenticated envelope must be the member the routing
    identity belongs to (a peer chooses its routing identity; only the key proves it). Messages
    naming a role and rank (Hello, Ready, Heartbeat, Done, Dead) must name the sender."""
    if len(parts) < 2:
        rejects.reject("bad_frame_count", f"{len(parts)} parts on the router")
        return None
    ident = routes.get(parts[0])
    if ident is None:
        rejects.reject("unexpected_peer", f"{parts[0][:40]!r} is not part of this run")
        return None
    opened = auth.open(parts[1:], rejects)
    if opened is None:
        return None
    sender, msg = opened
    if sender is not None and sender != ident:
        rejects.reject("wrong_sender", f"envelope from {sender[:40]!r} on connection {ident!r}")
        return None
    role, rank = getattr(msg, "role", None), getattr(msg, "rank", None)
    if role is not None and identity(role, rank) != ident:
        rejects.reject("wrong_sender", f"{type(msg).__name__} for {role}-{rank} from {ident.decode()}")
        return None
    return ident, msg


def coordinate(
    router: zmq.Socket,
    expected: list[tuple[str, int]],
    timeout_s: float,
    rejects: RejectCounter,
    is_alive: Callable[[], str | None] = lambda: None,
    setting: str = "run.handshake_timeout_s",
    on_other: Callable[[bytes, protocol.Message], None] | None = None,
    auth: PeerAuth | None = None,
    pids: dict[tuple[str, int], int] | None = None,
    tick: Callable[[], None] | None = None,
    on_dead: Callable[[bytes, Dead], None] | None = None,
) -> dict[tuple[str, int], Hello]:
    """Run the whole handshake; returns the Hellos keyed by (role, rank). ``pids``: the process
    spawned for each (role, rank); a Hello from any other pid is refused (an orphan of an earlier
    attempt on the same run directory is never adopted). ``on_dead``: Dead reports go there,
    and ``is_alive`` says which failure ends the handshake; without it a Dead ends it at once."""
    idents = {identity(r, k): (r, k) for r, k in expected}
    auth = auth if auth is not None else PeerAuth(None)
    pid_by_ident = {identity(r, k): p for (r, k), p in pids.items()} if pids is not None else None
    hellos = _wait_for(
        router, set(idents), Hello, timeout_s, setting, rejects, is_alive, "Hello", auth, pid_by_ident, tick, on_dead=on_dead
    )
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
        router.send_multipart([auth.route(ident), frame])
    _wait_for(
        router, set(idents), Ready, timeout_s, setting, rejects, is_alive, "Ready", auth, None, tick, on_other=on_other, on_dead=on_dead
    )
    return by_key


def child_handshake(
    dealer: zmq.Socket,
    hello: Hello,
    timeout_s: float,
    rejects: RejectCounter,
    should_stop: Callable[[], bool] = lambda: False,
    auth: PeerAuth | None = None,
) -> Start:
    """Send Hello, wait for Start (the caller sends Ready once it has connected). The supervisor's
    frames are single-part and unsealed: only the supervisor binds the socket this DEALER
    connected to, in the run's private directory."""
    dealer.send_multipart(auth.seal(protocol.encode(hello)) if auth is not None else [protocol.encode(hello)])
    plain = PeerAuth(None)
    deadline = time.monotonic() + timeout_s
    while True:
        if should_stop():
            raise HandshakeError("stopped during the handshake")
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError(f"no Start from the supervisor within {timeout_s:g} s (run.handshake_timeout_s)")
        if not dealer.poll(min(left, 0.2) * 1000):
            continue
        for _, msg in drain_from(dealer, plain, rejects, 100):
            if isinstance(msg, Start):
                return msg
            if isinstance(msg, protocol.Shutdown):
                raise HandshakeError(f"shut down during the handshake: {msg.reason}")


def send_ready(dealer: zmq.Socket, role: str, rank: int, auth: PeerAuth | None = None) -> None:
    body = protocol.encode(Ready(role=role, rank=rank))
    dealer.send_multipart(auth.seal(body) if auth is not None else [body])
