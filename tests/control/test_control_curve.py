"""CURVE on a TCP control plane: real ZeroMQ sockets on 127.0.0.1, the run's keys on disk.

A client holding the run's client key reaches the server; a client with no keys, with a key pair
of its own, or with the wrong server key is refused by the handshake, nothing of it is delivered,
and each refusal is counted as ``unauthenticated_peer`` in the server's RejectCounter.
"""

from __future__ import annotations

import stat
import time

import pytest
import zmq

from dflash_ipc.control import channels, curve
from dflash_ipc.control.protocol import Load, RejectCounter

pytestmark = pytest.mark.skipif(not curve.curve_available(), reason="libzmq without CURVE")


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_run_keys_are_private_files(tmp_path):
    keys = curve.write_run_keys(tmp_path)
    d = tmp_path / curve.KEYS_DIR
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = [p for p in d.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [(p, oct(p.stat().st_mode)) for p in files]
    again = curve.read_run_keys(tmp_path)
    assert again == keys and len(keys.client_public) == 40 and keys.client_secret != keys.server_secret
    # a new run draws new keys
    assert curve.write_run_keys(tmp_path).client_public != keys.client_public


def test_only_the_runs_clients_get_through_and_every_refusal_is_counted(tmp_path):
    keys = curve.write_run_keys(tmp_path)
    ctx = zmq.Context()
    rejects = RejectCounter("server")
    guard = curve.CurveGuard(ctx, keys, rejects)
    socks: list[zmq.Socket] = []
    try:
        server = guard.serve(ctx.socket(zmq.PULL))
        socks.append(server)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        addr = f"tcp://127.0.0.1:{port}"

        def push(setup) -> zmq.Socket:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            setup(s)
            s.connect(addr)
            socks.append(s)
            return s

        # three strangers: no CURVE at all, a key pair of their own, the right client key but a wrong server key
        stranger_pub, stranger_sec = zmq.curve_keypair()
        wrong_server_pub, _ = zmq.curve_keypair()

        def own_keys(s):
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = stranger_pub, stranger_sec, keys.server_public

        def wrong_server(s):
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = keys.client_public, keys.client_secret, wrong_server_pub

        strangers = [push(lambda s: None), push(own_keys), push(wrong_server)]
        for i, s in enumerate(strangers):
            s.send(channels.protocol.encode(Load(consumer=i, outstanding=0, received=[0])), zmq.NOBLOCK)
        _wait(lambda: guard.count_refusals() >= 0 and rejects.by_kind.get("unauthenticated_peer", 0) >= 3, "three refusals")
        assert set(rejects.by_kind) == {"unauthenticated_peer"}, rejects.by_kind

        member = push(guard.client)
        channels.send(member, Load(consumer=7, outstanding=1, received=[2]))
        got: list = []
        _wait(lambda: got.extend(channels.drain(server, rejects)) or got, "the member's message")
        # only the member's message arrived; the strangers' were never delivered
        assert got == [Load(consumer=7, outstanding=1, received=[2])]
        time.sleep(0.3)
        assert channels.drain(server, rejects) == []
        assert set(rejects.by_kind) == {"unauthenticated_peer"}
    finally:
        for s in socks:
            s.close(linger=0)
        guard.close()
        ctx.term()
