"""Every receive path takes any frame shape, and only run members' sealed frames.

Real ZeroMQ sockets in one process. Before: the handshake unpacked ``ident, frame =
recv_multipart()`` (a two-part message from a DEALER raised ValueError and ended the supervisor),
a Dead from any identity ended the handshake, and data-plane frames carried no sender at all.
"""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from dflash_ipc.control import channels, handshake, protocol
from dflash_ipc.control.channels import PeerAuth
from dflash_ipc.control.protocol import Dead, EndOfData, Hello, RejectCounter


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def test_sealed_frames_open_and_forged_replayed_or_misshapen_ones_are_counted(ctx, tmp_path):
    key = channels.new_run_key()
    ep = f"ipc://{tmp_path}/pull"
    pull = channels.bind(ctx, zmq.PULL, ep)
    target = PeerAuth(key, b"target-0")
    drafter = PeerAuth(key, b"drafter-0", peers={b"target-0"})
    push = channels.connect(ctx, zmq.PUSH, ep)
    try:
        body = protocol.encode(EndOfData(producer=0, batches_sent=3))
        genuine = target.seal(body)
        push.send_multipart(genuine)
        push.send_multipart(genuine)  # replayed
        push.send_multipart(PeerAuth(channels.new_run_key(), b"target-0").seal(body))  # another run's key
        push.send_multipart(PeerAuth(key, b"target-1").seal(body))  # a member, but not this receiver's peer
        push.send_multipart([b"a", b"b"])
        push.send_multipart([body])  # unsealed
        push.send_multipart(genuine[:3] + [os.urandom(16)])
        push.send_multipart(target.seal(b"\x93garbage"))  # sealed, but not a message
        push.send_multipart(target.seal(body))  # the next genuine one
        rejects = RejectCounter("drafter-0")
        got = []
        while len(got) + rejects.total < 9:
            pull.poll(2000)
            got += channels.drain_from(pull, drafter, rejects)
        assert [s for s, _ in got] == [b"target-0", b"target-0"]
        assert all(m == EndOfData(producer=0, batches_sent=3) for _, m in got)
        assert rejects.by_kind == {"replayed": 1, "bad_auth": 2, "unexpected_peer": 1, "bad_frame_count": 2, "undecodable": 1}
    finally:
        push.close()
        pull.close()


def test_handshake_survives_hostile_frames_and_refuses_orphans(ctx, tmp_path):
    """A two-part message, a forged Dead and a Hello from a pid that was not spawned, all before
    the members' Hellos: each is rejected and counted, and the handshake completes."""
    key = channels.new_run_key()
    ep = f"ipc://{tmp_path}/sup"
    router = channels.bind(ctx, zmq.ROUTER, ep)
    hostile = channels.connect(ctx, zmq.DEALER, ep, b"intruder")
    sup_auth = PeerAuth(key, b"supervisor")
    route = sup_auth.route(b"consumer-0")
    squatter = channels.connect(ctx, zmq.DEALER, ep, b"consumer-0")  # a member's name, without the key: cannot lock it out
    orphan = channels.connect(ctx, zmq.DEALER, ep, route + b"x")  # an earlier attempt's child, with the key
    member = None
    try:
        hostile.send_multipart([b"a", b"b"])
        hostile.send_multipart([protocol.encode(Dead(role="consumer", rank=0, error="forged"))])
        orphan_auth = PeerAuth(key, b"consumer-0")
        orphan.send_multipart(orphan_auth.seal(protocol.encode(Hello(role="consumer", rank=0, pid=1, device="cpu"))))
        orphan.send_multipart(orphan_auth.seal(protocol.encode(Dead(role="consumer", rank=1, error="not me"))))
        squatter.send_multipart([b"x"])
        router.poll(2000)

        def child():
            nonlocal member
            member = channels.connect(ctx, zmq.DEALER, ep, route)
            auth = PeerAuth(key, b"consumer-0")
            # sealed, from the member's connection, but a pid the coordinator did not spawn / another's name
            member.send_multipart(auth.seal(protocol.encode(Hello(role="consumer", rank=0, pid=1, device="cpu"))))
            member.send_multipart(auth.seal(protocol.encode(Dead(role="consumer", rank=1, error="not me"))))
            start = handshake.child_handshake(
                member, Hello(role="consumer", rank=0, pid=os.getpid(), device="cpu"), 30, RejectCounter("c"), auth=auth
            )
            assert isinstance(start, protocol.Start)
            handshake.send_ready(member, "consumer", 0, auth)

        t = threading.Thread(target=child)
        t.start()
        rejects = RejectCounter("sup")
        hellos = handshake.coordinate(router, [("consumer", 0)], 30, rejects, auth=sup_auth, pids={("consumer", 0): os.getpid()})
        t.join(30)
        assert hellos[("consumer", 0)].pid == os.getpid()
        assert rejects.by_kind == {"unexpected_peer": 5, "not_our_child": 1, "wrong_sender": 1}
    finally:
        for s in (hostile, squatter, orphan, member, router):
            if s is not None:
                s.close(linger=0)
