"""Node options: options over torchrun-style variables, refusals naming the option, global numbering;
the supervisors' restart vote over a real TCPStore (two NodeGroups in threads)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from end_to_end.test_multinode import free_port_pair

from dflash_ipc.runtime.nodes import (
    NodeGroup,
    NodeOptionError,
    NodeSpec,
    bounded_call,
    drafter_envs,
    read_node_spec,
    resolve_node_spec,
    write_node_spec,
)

REPO = Path(__file__).resolve().parents[2]


def test_options_win_over_environment() -> None:
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert resolve_node_spec(None, None, None, None, None, env) == NodeSpec(4, 3, "10.0.0.1", 29500)
    assert resolve_node_spec(2, 1, "127.0.0.1", 4000, None, env) == NodeSpec(2, 1, "127.0.0.1", 4000)


def test_single_node_ignores_launcher_master_variables() -> None:
    # A launcher may export MASTER_ADDR for one node: the drafters stay on loopback then.
    spec = resolve_node_spec(None, None, None, None, None, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert spec == NodeSpec() and not spec.multi
    envs = drafter_envs(spec, 2)
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}


@pytest.mark.parametrize(
    "args, env, names",
    [
        ((2, 2, "h", 1000, None), {}, "--node-rank"),
        ((2, -1, "h", 1000, None), {}, "--node-rank"),
        ((0, 0, None, None, None), {}, "--nnodes"),
        ((2, 0, None, 1000, None), {}, "--master-addr"),
        ((2, 0, "h", None, None), {}, "--master-port"),
        ((2, 0, "h", 65535, None), {}, "--master-port"),
        ((None, None, None, None, None), {"NNODES": "two"}, "NNODES"),
        ((2, None, "h", None, None), {"MASTER_PORT": "x"}, "MASTER_PORT"),
    ],
)
def test_bad_node_options_name_themselves(args, env, names) -> None:
    with pytest.raises(NodeOptionError, match=names):
        resolve_node_spec(*args, env)


def test_global_ranks_and_shards(tmp_path: Path) -> None:
    spec = NodeSpec(3, 2, "10.0.0.1", 29500, str(tmp_path / "shared"))
    envs = drafter_envs(spec, 2)
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("4", "0", "6"), ("5", "1", "6")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("10.0.0.1", "29500")}
    assert spec.checkpoint_root(tmp_path / "run") == tmp_path / "shared" / "checkpoints"
    write_node_spec(tmp_path, spec)
    assert read_node_spec(tmp_path) == spec
    assert read_node_spec(tmp_path / "absent") == NodeSpec()


def test_up_refuses_bad_node_options_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ipc.cli",
            "up",
            "--config",
            str(REPO / "configs" / "tiny-cpu.toml"),
            "--run-dir",
            str(run_dir),
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "MASTER_PORT": ""},
    )
    assert r.returncode == 2, r.stderr
    assert "--master-port (MASTER_PORT)" in r.stderr
    assert not run_dir.exists()


def both(fn0, fn1) -> list:
    """fn0 and fn1 at once (each node's supervisor is its own process; here, a thread each)."""
    out: list = [None, None]
    threads = [threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())) for i, f in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_nodes_restart_only_when_every_node_votes_to() -> None:
    port = free_port_pair()
    g0, g1 = (
        NodeGroup(NodeSpec(nnodes=2, node_rank=r, master_addr="127.0.0.1", master_port=port), interval_s=0.1, heartbeat_timeout_s=2.0)
        for r in (0, 1)
    )
    try:
        both(lambda: g0.join("same", 10), lambda: g1.join("same", 10))
        # generation 0: both vote restart
        assert both(lambda: g0.agree_restart(True, 10), lambda: g1.agree_restart(True, 10)) == [(True, "restart")] * 2
        assert (g0.begin_generation(), g1.begin_generation()) == (1, 1)
        # generation 1: node 0 has no restart left: every node stops, told why
        votes = both(lambda: g0.agree_restart(False, 10), lambda: g1.agree_restart(True, 10))
        assert [v[0] for v in votes] == [False, False] and votes[0][1] == votes[1][1] and "node 0" in votes[0][1]
        g0.begin_generation()
        g1.begin_generation()
        # generation 2: node 1 never votes (hung, or still tearing down): node 0 stops after its timeout
        restart, why = g0.agree_restart(True, 0.5)
        assert not restart and "node(s) 1 did not vote within 0.5 s" in why
    finally:
        g1.close()
        g0.close()


def test_bounded_call_returns_raises_or_gives_up() -> None:
    assert bounded_call(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        bounded_call(lambda: {}["x"], 1.0)
    stuck = threading.Event()
    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        bounded_call(lambda: stuck.wait(30), 0.2)
    stuck.set()
