"""The drafters' rendezvous listens on loopback only in single-host runs (MASTER_ADDR 127.0.0.1).

Two real processes join a gloo group through ``init_distributed`` (what each drafter process
calls), all-reduce once, and wait; meanwhile every socket they listen on is read with psutil.
torch's own env:// store listens on ``::`` (every interface).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil

JOIN = """
import sys, torch, torch.distributed as dist
from dflash_ipc.drafter.training.distributed import destroy_distributed, init_distributed
info = init_distributed("gloo", timeout_s=60)
t = torch.ones(1)
dist.all_reduce(t)
print(f"joined {info.rank} {int(t.item())}", flush=True)
sys.stdin.readline()  # hold the group open while the test looks at our sockets
destroy_distributed()
"""

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_drafter_gloo_rendezvous_listens_on_loopback_only():
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env.pop("GLOO_SOCKET_IFNAME", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        lines = [p.stdout.readline().strip() for p in procs]
        assert lines == ["joined 0 2", "joined 1 2"], [p.stderr.read() for p in procs if p.poll() is not None]
        listening = {
            r: [c.laddr for c in psutil.Process(p.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            for r, p in enumerate(procs)
        }
        assert any(a.port == port for a in listening[0]), listening  # the store is rank 0's
        for rank, addrs in listening.items():
            assert addrs and all(a.ip in LOOPBACK for a in addrs), (rank, addrs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=60)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0, 0]
