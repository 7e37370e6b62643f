"""Two `dflash-ipc up` processes on localhost acting as two nodes (gloo): one run.

Each node: 1 target + 1 drafter (tiny CPU config, small data); the drafters form one group of two
global ranks over MASTER_ADDR=127.0.0.1. Checkpoints go to one --shared-dir. One process group
goes through the multi-node paths on real processes: kill -9 of node 1's drafter with
--max-restarts 1 restarts every node together; a second kill -9 ends node 0 non-zero within the
heartbeat timeout, naming node 1 and the drafter; --resume on both nodes continues from the shared
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

import pytest
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.drafter.checkpoint import LEDGER_FILE, read_latest_pointer

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "dflash_ipc.cli"]
RUN_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 6.0


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
        run={"teardown_grace_s": 3.0, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        training={"checkpoint_every": 0, "max_steps": 0, "warmup_steps": 1} | training,
    )
    return write_toml(path, raw)


class Node:
    """One node's `dflash-ipc up`, its output in a file."""

    def __init__(self, tmp: Path, config: Path, rank: int, port: int, shared: Path, *extra: str, tag: str = "", env_only: bool = False):
        self.run_dir = tmp / f"node{rank}"
        self.out_path = tmp / f"node{rank}{tag}.out"
        env = dict(os.environ)
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


def run_both(tmp: Path, config: Path, shared: Path, *extra: str, tag: str = "", env_only: bool = False) -> tuple[Node, Node]:
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


def rank_records(*nodes: Node) -> list[dict]:
    return [json.loads(p.read_text()) for n in nodes for p in sorted((n.run_dir / "ranks").glob("rank-*.json"))]


def test_nodes_restart_together_then_end_together_then_resume_to_the_plan(tmp_path: Path) -> None:
    """One two-node run through every multi-node path but the hangs (tests/test_multinode_faults.py):
    --max-restarts 1, kill -9 of node 1's drafter: both nodes vote and restart from the shared
    checkpoint (generation 1); kill -9 of its new drafter: no restart left, node 0 ends non-zero
    within the heartbeat timeout naming node 1 and the drafter, and so does node 1; `up --resume`
    on both nodes (launched by the torchrun-style variables alone) continues from the shared
    checkpoint to the data's end: identical weights on both ranks, no batch of the checkpoint
    trained again, the final ledger = the plan (every epoch, each shard's batches once)."""
    # 4 epochs (40 steps): both kills land far from the data's end
    epochs = 4
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
        os.kill(n1.drafter_pid(), signal.SIGKILL)
        killed = time.monotonic()
        code0 = n0.wait(timeout=HEARTBEAT_TIMEOUT_S + 30)
        ended_after = time.monotonic() - killed
        code1 = n1.wait(timeout=60)
        print(n0.output[-2000:], n1.output[-2000:], sep="\n----\n")  # the failure reports, for the record (pytest -s)
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
    assert code0 != 0 and code1 != 0, n0.output[-3000:] + n1.output[-3000:]
    assert ended_after < HEARTBEAT_TIMEOUT_S + 30  # safety net; the kill is usually seen in about a second
    for n in nodes:
        rank = n.run_dir.name[-1]
        assert n.output.count("node 1/2: drafter-0") >= 2 and "SIGKILL" in n.output, n.output[-3000:]
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
