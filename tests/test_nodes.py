"""Node options: options over torchrun-style variables, refusals naming the option, global numbering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ipc.runtime.nodes import NodeOptionError, NodeSpec, drafter_envs, read_node_spec, resolve_node_spec, write_node_spec

REPO = Path(__file__).resolve().parents[1]


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
