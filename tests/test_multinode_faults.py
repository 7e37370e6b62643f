"""Two `dflash-ipc up` processes on localhost as two nodes (gloo): a whole node hangs; nodes restart together.

A hang: every process of one node (its supervisor and each child of it) is SIGSTOPped mid-training.
The other node must end non-zero naming the hung node ("node 1 missed heartbeats", or "lost node 0"
when the hung node serves the supervisors' store), tear its own processes down and sweep its shared
memory. Then the stopped node is SIGKILLed, continued and reaped.

--max-restarts 1: kill -9 of node 1's drafter once; both nodes vote, restart their groups from the
shared checkpoint, and finish: exit 0, the final ledger covers the plan with no batch twice.
Helpers come from tests/test_multinode.py. Timeouts are safety nets; the measured detection times
are printed as ``NODES:`` lines (pytest -s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import pytest
from test_multinode import HEARTBEAT_TIMEOUT_S, RUN_TIMEOUT_S, Node, rank_records, run_both, write_config

from dflash_ipc.drafter.checkpoint import LEDGER_FILE, read_latest_pointer
from dflash_ipc.transport.shm_names import list_run_shm, sweep_run_shm

pytestmark = pytest.mark.slow

MARGIN_S = 30.0  # detection + reporting + the teardown of a drafter stuck in a collective (run.teardown_grace_s twice)


def wait_training(nodes: tuple[Node, Node], shared: Path, min_step: int = 3) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S

    def step(n: Node) -> int:
        return (n.status() or {}).get("totals", {}).get("step", 0)

    while read_latest_pointer(shared / "checkpoints") is None or min(map(step, nodes)) < min_step:
        assert all(n.proc.poll() is None for n in nodes), "".join(n.output[-3000:] for n in nodes)
        assert time.monotonic() < deadline, "training did not start in time"
        time.sleep(0.2)


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


def test_max_restarts_restarts_every_node_together(tmp_path: Path) -> None:
    # 3 epochs (30 steps): the kill lands at step >= 3, far from the data's end
    epochs = 3
    config = write_config(tmp_path / "two-nodes.toml", num_epochs=epochs, checkpoint_every=2)
    shared = tmp_path / "shared"
    n0, n1 = nodes = run_both(tmp_path, config, shared, "--max-restarts", "1")
    try:
        wait_training(nodes, shared)
        os.kill(n1.drafter_pid(), signal.SIGKILL)
        killed = time.monotonic()
        codes = [n.wait() for n in nodes]
        print(f"NODES: kill -9 of node 1's drafter -> both nodes restarted and finished {time.monotonic() - killed:.1f} s later")
        print(n0.output[-2000:], n1.output[-2000:], sep="\n----\n")
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
    assert codes == [0, 0], n0.output[-3000:] + n1.output[-3000:]
    for n in nodes:
        rank = n.run_dir.name[-1]
        assert "SIGKILL" in n.output and "node 1/2: drafter-0" in n.output, n.output[-3000:]
        assert f"[up] node {rank}/2: restarting the group from the last checkpoint (1/1), every node together (generation 1)" in n.output
        assert len(re.findall(r"\[up\] started \d+ processes", n.output)) == 2
        log = (n.run_dir / "logs" / "drafter-0.log").read_text()
        assert re.search(r"resumed from \S*/shared/checkpoints/step-\d+: step \d+,", log), log[-2000:]

    recs = rank_records(n0, n1)
    assert len({r["weights_sha256"] for r in recs}) == 1 and len({r["step"] for r in recs}) == 1
    plan = json.loads((n0.run_dir / "plan.json").read_text())
    latest = shared / "checkpoints" / read_latest_pointer(shared / "checkpoints")
    ledger = [tuple(b) for b in json.loads((latest / LEDGER_FILE).read_text())["ids"]]
    assert [b for b, k in Counter(ledger).items() if k > 1] == [], "a batch was trained twice"
    # = the plan: per target shard, each epoch's batches 0..k-1, as many in all as the plan holds
    per_epoch_shard: dict[tuple[int, int], set[int]] = defaultdict(set)
    for epoch, shard, index in ledger:
        per_epoch_shard[(epoch, shard)].add(index)
    assert {k for k in per_epoch_shard} == {(e, s) for e in range(epochs) for s in range(2)}
    assert all(ix == set(range(len(ix))) for ix in per_epoch_shard.values())
    assert [sum(len(ix) for (e, s), ix in per_epoch_shard.items() if s == shard) for shard in range(2)] == plan["n_batches_per_shard"]
    trained_last = [tuple(b) for r in recs for b in r["batch_ids"]]
    assert set(trained_last) <= set(ledger) and len(trained_last) == len(set(trained_last))
