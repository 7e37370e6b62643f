"""The supervisor's side of `dflash-ipc status`: a REP socket answering snapshot requests."""

from __future__ import annotations

import json
from collections.abc import Callable

import zmq

from dflash_ipc.control.status import StatusSnapshot
from dflash_ipc.control.wire import RejectCounter, to_wire


def serve_status_requests(status_sock: zmq.Socket, snapshot: Callable[[], StatusSnapshot], rejects: RejectCounter) -> None:
    """Answer the requests waiting on the REP socket, without blocking. A request is exactly one
    part, b"status"; anything else gets an error reply (REP must answer every request it read)
    and is counted."""
    for _ in range(100):
        try:
            parts = status_sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if parts == [b"status"]:
            reply = json.dumps(to_wire(snapshot())).encode()
        else:
            rejects.reject("bad_status_request", f"{len(parts)} part(s), first {parts[0][:40]!r}")
            reply = json.dumps({"error": "a status request is one frame, b'status'"}).encode()
        try:
            status_sock.send(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            return
