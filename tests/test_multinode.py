"""Two `dflash-ipc up` processes on localhost acting as two nodes (gloo): one run.

Each node: 1 target + 1 drafter (tiny CPU config, small data); the drafters form one group of two
global ranks over MASTER_ADDR=127.0.0.1. Checkpoints go to one --shared-dir. Checked on real
processes: identical weights on both ranks (sha256 each rank writes of its own weights), the union
of the two nodes' trained batches = the plan with no batch twice, the shared ledger = that union;
kill -9 of node 1's drafter ends node 0 non-zero within the heartbeat timeout, naming node 1 and
the drafter; --resume on both nodes continues from the shared checkpoint. Timeouts are safety nets.
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
        m = re.search(r"drafter-0@\S+ pid (\d+)", self.output)
        assert m, self.output
        return int(m.group(1))

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


def rank_records(*nodes: Node) -> list[dict]:
    return [json.loads(p.read_text()) for n in nodes for p in sorted((n.run_dir / "ranks").glob("rank-*.json"))]


def test_two_nodes_one_run(tmp_path: Path) -> None:
    config = write_config(tmp_path / "two-nodes.toml")
    shared = tmp_path / "shared"
    n0, n1 = run_both(tmp_path, config, shared, env_only=True)
    assert n0.wait() == 0, n0.output[-4000:]
    assert n1.wait() == 0, n1.output[-4000:]
    assert "node 0/2: all nodes joined" in n0.output and "node 1/2: all nodes joined" in n1.output

    recs = rank_records(n0, n1)
    assert sorted(r["rank"] for r in recs) == [0, 1]  # one drafter per node, global ranks 0 and 1
    assert len({r["weights_sha256"] for r in recs}) == 1, recs
    assert len({r["step"] for r in recs}) == 1

    plan = json.loads((n0.run_dir / "plan.json").read_text())
    assert plan == json.loads((n1.run_dir / "plan.json").read_text())
    assert len(plan["n_batches_per_shard"]) == 2  # one global shard per target of every node
    planned = {(0, shard, i) for shard, n in enumerate(plan["n_batches_per_shard"]) for i in range(n)}
    trained = [tuple(b) for r in recs for b in r["batch_ids"]]
    assert len(trained) == len(set(trained)), "a batch was trained twice"
    assert set(trained) == planned

    # Written once, by global rank 0, in the shared dir: node-local checkpoint dirs stay empty.
    latest = read_latest_pointer(shared / "checkpoints")
    ledger = json.loads((shared / "checkpoints" / latest / LEDGER_FILE).read_text())
    assert {tuple(b) for b in ledger["ids"]} == planned
    assert [p for n in (n0, n1) for p in (n.run_dir / "checkpoints").glob("step-*")] == []
    assert (shared / "export" / "drafter" / "model.safetensors").exists()
    # status on node 1: its own processes (one target, one drafter) and the group's step
    snap = n1.status()
    assert snap["node"]["node_rank"] == 1 and snap["node"]["nnodes"] == 2
    assert sorted((p["role"], p["rank"]) for p in snap["processes"]) == [("drafter", 0), ("target", 0)]
    assert snap["totals"]["step"] == recs[0]["step"]


def test_node_failure_ends_every_node_then_resume(tmp_path: Path) -> None:
    # Enough epochs that training is still running when the kill comes (one epoch is 10 steps,
    # about 3 s here: it could end before the first checkpoint was seen).
    config = write_config(tmp_path / "two-nodes.toml", num_epochs=40, checkpoint_every=2, max_steps=400)
    shared = tmp_path / "shared"
    n0, n1 = run_both(tmp_path, config, shared)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while read_latest_pointer(shared / "checkpoints") is None or ((n1.status() or {}).get("totals", {}).get("step", 0) < 3):
        assert n0.proc.poll() is None and n1.proc.poll() is None, n0.output[-3000:] + n1.output[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    os.kill(n1.drafter_pid(), signal.SIGKILL)
    killed = time.monotonic()
    code0 = n0.wait(timeout=HEARTBEAT_TIMEOUT_S + 30)
    ended_after = time.monotonic() - killed
    code1 = n1.wait(timeout=60)
    print(n0.output[-1500:], n1.output[-1500:], sep="\n----\n")  # the failure reports, for the record (pytest -s)
    assert code0 != 0 and code1 != 0
    assert ended_after < HEARTBEAT_TIMEOUT_S + 30  # safety net; the kill is usually seen in about a second
    assert "node 1/2: drafter-0" in n0.output and "SIGKILL" in n0.output, n0.output[-3000:]
    assert "node 1/2: drafter-0" in n1.output and "SIGKILL" in n1.output, n1.output[-3000:]

    ckpt = read_latest_pointer(shared / "checkpoints")
    ckpt_step = json.loads((shared / "checkpoints" / ckpt / "meta.json").read_text())["step"]
    before = json.loads((shared / "checkpoints" / ckpt / LEDGER_FILE).read_text())["ids"]  # retention may remove it later
    resumed_to = ckpt_step + 3
    r0, r1 = run_both(tmp_path, config, shared, "--resume", "--max-steps", str(resumed_to), tag=".resume")
    assert r0.wait() == 0, r0.output[-4000:]
    assert r1.wait() == 0, r1.output[-4000:]
    recs = rank_records(r0, r1)
    assert [r["step"] for r in recs] == [resumed_to, resumed_to]
    assert len({r["weights_sha256"] for r in recs}) == 1
    for n in (r0, r1):
        log = (n.run_dir / "logs" / "drafter-0.log").read_text()
        assert re.search(rf"resumed from \S*/shared/checkpoints/{ckpt}: step {ckpt_step},", log), log[-2000:]
    after = json.loads((shared / "checkpoints" / read_latest_pointer(shared / "checkpoints") / LEDGER_FILE).read_text())["ids"]
    trained_now = [tuple(b) for r in recs for b in r["batch_ids"]]
    assert not {tuple(b) for b in before} & set(trained_now), "a batch of the checkpoint was trained again"
    assert {tuple(b) for b in after} == {tuple(b) for b in before} | set(trained_now)
