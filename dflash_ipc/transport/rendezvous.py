"""TCPStore rendezvous shared by the drafters' process group, the nodes' watch and the ``nccl`` ring pairs.

On a loopback host the store's server listens on that address only (torch's own store
listens on ``::``, every interface), and gloo binds the same address, so a single-host run
opens nothing beyond the host.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tcp_store(
    host: str, port: int, is_server: bool, timeout: timedelta, *, world_size: int | None = None, bind_only: bool = False
) -> dist.TCPStore:
    """A TCPStore client or (``is_server``) its server; on a loopback ``host``, or with ``bind_only``,
    the server listens on ``host`` only.

    ``port`` 0 with ``is_server``: a free port is picked (read it back from ``store.port``)."""
    listen_fd = None
    if is_server and (bind_only or is_loopback(host)):  # the store takes the bound socket over and closes it: detach it from Python
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        bind_host = "127.0.0.1" if host == "localhost" else host
        listen = socket.create_server((bind_host, port), family=family, backlog=max(128, world_size or 1))
        port = listen.getsockname()[1]
        listen_fd = listen.detach()
    return dist.TCPStore(
        host, port, world_size, is_server, timeout=timeout, master_listen_fd=listen_fd, wait_for_workers=world_size is not None
    )
