"""Two `dflash-ipc up` processes on localhost as two nodes (gloo): a whole node hangs.

A hang: every process of one node (its supervisor and each child of it) is SIGSTOPped mid-training.
The other node must end non-zero naming the hung node ("node 1 missed heartbeats", or "lost node 0"
when the hung node serves the supervisors' store), tear its own processes down and sweep its shared
memory. Then the stopped node is SIGKILLed, continued and reaped.

Nodes restarting together (--max-restarts) are tested in tests/test_multinode.py.
Helpers come from tests/test_multinode.py. Timeouts are safety nets; the measured detection times
are printed as ``NODES:`` lines (pytest -s).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from test_multinode import HEARTBEAT_TIMEOUT_S, Node, run_both, wait_training, write_config

from dflash_ipc.transport.shm_names import list_run_shm, sweep_run_shm

pytestmark = pytest.mark.slow

MARGIN_S = 30.0  # detection + reporting + the teardown of a drafter stuck in a collective (run.teardown_grace_s twice)


def child_pids(node: Node) -> list[int]:
    """Every child the node's supervisor said it started (all attempts)."""
    return [int(p) for p in re.findall(r"@\S+ pid (\d+)", node.output)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("hung_rank", [1, 0], ids=["node1-hangs", "node0-the-store-hangs"])
def test_a_hung_node_ends_the_run_on_the_other(tmp_path: Path, hung_rank: int) -> None:
    config = write_config(tmp_path / "two-nodes.toml", num_epochs=40, checkpoint_every=2, max_steps=400)
    shared = tmp_path / "shared"
    nodes = run_both(tmp_path, config, shared)
    hung, other = nodes[hung_rank], nodes[1 - hung_rank]
    tree: list[psutil.Process] = []
    try:
        wait_training(nodes, shared)
        sup = psutil.Process(hung.proc.pid)
        tree = [sup, *sup.children(recursive=True)]
        for p in tree:  # the supervisor first: it must not see its children stop
            p.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        detected = None
        while other.proc.poll() is None and time.monotonic() - stopped < HEARTBEAT_TIMEOUT_S + MARGIN_S:
            if detected is None and "failure detected" in other.output:
                detected = time.monotonic() - stopped
            time.sleep(0.1)
        code = other.wait(timeout=5)
        exited = time.monotonic() - stopped
        out = other.output
        print(
            f"NODES: node {hung_rank} SIGSTOPped (run.heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S:g}): node {1 - hung_rank} "
            f"detected it after {detected if detected is None else round(detected, 1)} s, exited {code} after {exited:.1f} s"
        )
        print(out[-1500:])
        assert code != 0, out[-3000:]
        assert detected is not None and detected < HEARTBEAT_TIMEOUT_S + MARGIN_S, out[-3000:]
        named = "lost node 0's supervisor store" if hung_rank == 0 else "node 1 missed heartbeats"
        assert re.search(rf"failure detected: .*{re.escape(named)}", out), out[-3000:]
        assert f"[up] FAILED: node {1 - hung_rank}/2: " in out and named in out
        # nothing left behind on the node that detected it
        assert all(gone(pid) for pid in child_pids(other)), [(p, psutil.Process(p).status()) for p in child_pids(other) if not gone(p)]
        assert list_run_shm((other.run_dir / "run_id").read_text().strip()) == []
    finally:
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
            n.proc.wait(timeout=30)
        psutil.wait_procs([p for p in tree if p.pid != hung.proc.pid], timeout=10)
        sweep_run_shm((hung.run_dir / "run_id").read_text().strip())
