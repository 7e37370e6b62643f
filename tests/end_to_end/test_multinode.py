"""Two `dflash-ipc up` processes on localhost acting as two nodes (gloo): one run.

Each node: 1 target + 1 drafter (tiny CPU config, small data); the drafters form one group of two
global ranks over MASTER_ADDR=127.0.0.1. Checkpoints go to one --shared-dir. One process group
goes through the multi-node paths on real processes: kill -9 of node 1's drafter with
--max-restarts 1 restarts every node together; then node 1 hangs whole (SIGSTOP) and node 0 ends
non-zero within the heartbeat timeout, naming node 1; --resume on both nodes continues from the shared
checkpoint to the data's end: identical weights on both ranks (sha256 each rank writes of its own
weights), the shared ledger = the plan with no batch twice. Timeouts are safety nets.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.drafter.checkpoint.store import LEDGER_FILE, read_latest_pointer
from dflash_ipc.transport.shm_names import list_run_shm, sweep_run_shm

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "dflash_ipc.cli"]
RUN_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 4.0  # 8 of the 0.5 s intervals, as tests/faults/ give a child (4 s)


def free_port_pair() -> int:
    """A port p with p+1 free too (drafters on p, supervisors on p+1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65534:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
                    return p
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def write_config(path: Path, *, num_epochs: int = 1, **training) -> Path:
    raw = tiny_cpu_config(
        topology={"targets": ["cpu"], "drafters": ["cpu"]},
        data={"builtin_samples": 80, "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512, "num_epochs": num_epochs},
        # a drafter stuck in a collective with a hung or dead peer is only ever SIGKILLed, after the grace
        # twice (Shutdown, then SIGTERM): 1 s keeps that wait short; a healthy child leaves in milliseconds
        run={"teardown_grace_s": 1.0, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        training={"checkpoint_every": 0, "max_steps": 0, "warmup_steps": 1} | training,
    )
    return write_toml(path, raw)


class Node:
    """One node's `dflash-ipc up`, its output in a file."""

    def __init__(
        self,
        tmp: Path,
        config: Path,
        rank: int,
        port: int,
        shared: Path,
        *extra: str,
        tag: str = "",
        env_only: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.run_dir = tmp / f"node{rank}"
        self.out_path = tmp / f"node{rank}{tag}.out"
        env = dict(os.environ) | (env or {})
        argv = [*CLI, "up", "--config", str(config), "--run-dir", str(self.run_dir), "--shared-dir", str(shared), *extra]
        node_args = {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if env_only:  # the torchrun-style variables alone (as SLURM/Kubernetes launchers set them)
            env.update(node_args)
        else:
            argv += ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            env.update(NNODES="7", NODE_RANK="5")  # the options win over the environment
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, env=env)

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"node did not exit within {timeout} s; output:\n{self.output[-4000:]}")

    def drafter_pid(self) -> int:
        """The pid of the drafter this node started last (a restart starts a new one)."""
        pids = re.findall(r"drafter-0@\S+ pid (\d+)", self.output)
        assert pids, self.output
        return int(pids[-1])

    def status(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None


def run_both(
    tmp: Path,
    config: Path,
    shared: Path,
    *extra: str,
    tag: str = "",
    env_only: bool = False,
) -> tuple[Node, Node]:
    """Node 0 and node 1 (their children fork from the pytest worker's shared fork server, as every `up`
    of the suite does: hang_node finds them by pid)."""
    port = free_port_pair()
    return (
        Node(tmp, config, 0, port, shared, *extra, tag=tag, env_only=env_only),
        Node(tmp, config, 1, port, shared, *extra, tag=tag, env_only=env_only),
    )


def wait_training(nodes: tuple[Node, Node], shared: Path, min_step: int = 3, after: str | None = None) -> None:
    """Until both nodes report step ``min_step`` and the shared dir holds a checkpoint (newer than ``after``)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S

    def step(n: Node) -> int:
        return (n.status() or {}).get("totals", {}).get("step", 0)

    while read_latest_pointer(shared / "checkpoints") in (None, after) or min(map(step, nodes)) < min_step:
        assert all(n.proc.poll() is None for n in nodes), "".join(n.output[-3000:] for n in nodes)
        assert time.monotonic() < deadline, "training did not start in time"
        time.sleep(0.2)


MARGIN_S = 30.0  # detection + reporting + the teardown of a drafter stuck in a collective (run.teardown_grace_s twice)


def child_pids(node: Node) -> list[int]:
    """Every child the node's supervisor said it started (all attempts)."""
    return [int(p) for p in re.findall(r"@\S+ pid (\d+)", node.output)]


def node_processes(node: Node) -> list[psutil.Process]:
    """Every process of a node, its supervisor first: the supervisor's tree, and each child of its
    latest group with its own (forked from the pytest worker's shared fork server, they are that
    server's children, not in the supervisor's tree)."""
    sup = psutil.Process(node.proc.pid)
    procs = [sup, *sup.children(recursive=True)]
    latest = [line for line in node.output.splitlines() if line.startswith("[up] started")][-1]
    for pid in (int(p) for p in re.findall(r"@\S+ pid (\d+)", latest)):
        child = psutil.Process(pid)  # alive: the node trains
        procs += [p for p in (child, *child.children(recursive=True)) if p not in procs]
    return procs


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def hang_node(nodes: tuple[Node, Node], hung_rank: int) -> None:
    """SIGSTOP every process of one node (its supervisor first: it must not see its children stop);
    the other node must end non-zero within the heartbeat timeout naming the hung node ("node 1
    missed heartbeats", or "lost node 0" when the hung node serves the supervisors' store), with
    none of its processes and none of its shared memory left. Then the hung node is SIGKILLed,
    continued and reaped, its shared memory swept."""
    hung, other = nodes[hung_rank], nodes[1 - hung_rank]
    tree: list[psutil.Process] = []
    try:
        tree = node_processes(hung)
        told = len(other.output)  # what it said before the hang (an earlier failure, say) is not read as the report
        for p in tree:
            p.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        detected = None
        while other.proc.poll() is None and time.monotonic() - stopped < HEARTBEAT_TIMEOUT_S + MARGIN_S:
            if detected is None and "failure detected" in other.output[told:]:
                detected = time.monotonic() - stopped
            time.sleep(0.1)
        code = other.wait(timeout=5)
        exited = time.monotonic() - stopped
        out = other.output[told:]
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


def rank_records(*nodes: Node) -> list[dict]:
    return [json.loads(p.read_text()) for n in nodes for p in sorted((n.run_dir / "ranks").glob("rank-*.json"))]


@pytest.mark.timeout(900)  # the safety nets of the three tests it holds (300 s each, pyproject)
def test_nodes_restart_together_then_a_hung_node_ends_the_run_then_resume_to_the_plan(tmp_path: Path) -> None:
    """One two-node run through the multi-node paths (the hang of node 0, the store's, is
    tests/faults/test_multinode_faults.py): --max-restarts 1, kill -9 of node 1's drafter: both nodes vote
    and restart from the shared checkpoint (generation 1); then all of node 1 hangs (SIGSTOP): no
    restart left, node 0 ends non-zero within the heartbeat timeout naming node 1 (hang_node), node 1
    is killed; `up --resume` on both nodes (launched by the torchrun-style variables alone)
    continues from the shared checkpoint to the data's end: identical weights on both ranks, no batch of the checkpoint
    trained again, the final ledger = the plan (every epoch, each shard's batches once)."""
    # 2 epochs (20 steps): the kill (about step 3) and the hang (about step 7) land far from the data's end
    epochs = 2
    config = write_config(tmp_path / "two-nodes.toml", num_epochs=epochs, checkpoint_every=2)
    shared = tmp_path / "shared"
    n0, n1 = nodes = run_both(tmp_path, config, shared, "--max-restarts", "1")
    try:
        wait_training(nodes, shared)
        first_victim = n1.drafter_pid()
        os.kill(first_victim, signal.SIGKILL)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all("(generation 1)" in n.output for n in nodes) or n1.drafter_pid() == first_victim:
            assert all(n.proc.poll() is None for n in nodes), n0.output[-3000:] + n1.output[-3000:]
            assert time.monotonic() < deadline, "no restart in time"
            time.sleep(0.2)
        restarted_from = read_latest_pointer(shared / "checkpoints")
        wait_training(nodes, shared, after=restarted_from)  # the restarted group trains and checkpoints
    except BaseException:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
        raise
    # the second failure: all of node 1 hangs (no restart left); node 0 ends (and node 1 is killed)
    hang_node(nodes, 1)
    for n in nodes:
        rank = n.run_dir.name[-1]
        assert "SIGKILL" in n.output and "node 1/2: drafter-0" in n.output, n.output[-3000:]
        assert f"[up] node {rank}/2: restarting the group from the last checkpoint (1/1), every node together (generation 1)" in n.output
        assert len(re.findall(r"\[up\] started \d+ processes", n.output)) == 2  # no third group
        log = (n.run_dir / "logs" / "drafter-0.log").read_text()
        assert re.search(rf"resumed from \S*/shared/checkpoints/{restarted_from}: step \d+,", log), log[-2000:]

    ckpt = read_latest_pointer(shared / "checkpoints")
    ckpt_step = json.loads((shared / "checkpoints" / ckpt / "meta.json").read_text())["step"]
    before = json.loads((shared / "checkpoints" / ckpt / LEDGER_FILE).read_text())["ids"]  # retention may remove it later
    r0, r1 = run_both(tmp_path, config, shared, "--resume", tag=".resume", env_only=True)
    assert r0.wait() == 0, r0.output[-4000:]
    assert r1.wait() == 0, r1.output[-4000:]
    assert "node 0/2: all nodes joined" in r0.output and "node 1/2: all nodes joined" in r1.output
    recs = rank_records(r0, r1)
    assert sorted(r["rank"] for r in recs) == [0, 1]  # one drafter per node, global ranks 0 and 1
    assert len({r["weights_sha256"] for r in recs}) == 1, recs
    assert len({r["step"] for r in recs}) == 1
    for n in (r0, r1):
        log = (n.run_dir / "logs" / "drafter-0.log").read_text()
        assert re.search(rf"resumed from \S*/shared/checkpoints/{ckpt}: step {ckpt_step},", log), log[-2000:]

    plan = json.loads((r0.run_dir / "plan.json").read_text())
    assert plan == json.loads((r1.run_dir / "plan.json").read_text())
    assert len(plan["n_batches_per_shard"]) == 2  # one global shard per target of every node
    trained_now = [tuple(b) for r in recs for b in r["batch_ids"]]
    assert len(trained_now) == len(set(trained_now)), "a batch was trained twice"
    assert not {tuple(b) for b in before} & set(trained_now), "a batch of the checkpoint was trained again"
    # Written once, by global rank 0, in the shared dir: node-local checkpoint dirs stay empty.
    final = read_latest_pointer(shared / "checkpoints")
    ledger = [tuple(b) for b in json.loads((shared / "checkpoints" / final / LEDGER_FILE).read_text())["ids"]]
    assert len(ledger) == len(set(ledger)), "a batch was trained twice"
    assert set(ledger) == {tuple(b) for b in before} | set(trained_now)
    # = the plan: per target shard, each epoch's batches 0..k-1, as many in all as the plan holds
    per_epoch_shard: dict[tuple[int, int], set[int]] = defaultdict(set)
    for epoch, shard, index in ledger:
        per_epoch_shard[(epoch, shard)].add(index)
    assert set(per_epoch_shard) == {(e, s) for e in range(epochs) for s in range(2)}
    assert all(ix == set(range(len(ix))) for ix in per_epoch_shard.values())
    assert [sum(len(ix) for (e, s), ix in per_epoch_shard.items() if s == shard) for shard in range(2)] == plan["n_batches_per_shard"]
    assert [p for n in (r0, r1) for p in (n.run_dir / "checkpoints").glob("step-*")] == []
    assert (shared / "export" / "drafter" / "model.safetensors").exists()
    # status on node 1: its own processes (one target, one drafter) and the group's step
    snap = r1.status()
    assert snap["node"]["node_rank"] == 1 and snap["node"]["nnodes"] == 2
    assert sorted((p["role"], p["rank"]) for p in snap["processes"]) == [("drafter", 0), ("target", 0)]
    assert snap["totals"]["step"] == recs[0]["step"]
