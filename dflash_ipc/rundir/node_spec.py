"""This node's place in a run (``node.json`` in the run directory): a leaf both roles read.

The supervisor writes it (``runtime/nodes.py`` resolves it from the command line and the
environment); the targets read it for their data shard, the drafters for the shared root their
checkpoints go to. One node of one is the default: a run directory without the file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ipc.rundir import bounded_json
from dflash_ipc.rundir.fsutil import write_text_atomic

NODE_FILE = "node.json"
MAX_NODES = 4096


class NodeOptionError(ValueError):
    """A bad --nnodes/--node-rank/--master-addr/--master-port (or its environment variable)."""


@dataclass(frozen=True)
class NodeSpec:
    """This node's place in the run (``node.json`` in the run dir; the children read it)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""  # empty: single node (the supervisor picks a loopback port for the drafters)
    master_port: int = 0
    shared_dir: str = ""  # empty: the run dir

    def __post_init__(self) -> None:
        if not 1 <= self.nnodes <= MAX_NODES:
            raise NodeOptionError(f"--nnodes (NNODES) must be in [1, {MAX_NODES}] (got {self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodeOptionError(
                f"--node-rank (NODE_RANK) must be in [0, {self.nnodes}) for --nnodes {self.nnodes} (got {self.node_rank})"
            )
        if self.nnodes > 1:
            if not self.master_addr:
                raise NodeOptionError(
                    "--master-addr (MASTER_ADDR) is required with --nnodes > 1: the host of node 0, reachable from every node"
                )
            if not 1 <= self.master_port <= 65534:
                raise NodeOptionError(
                    f"--master-port (MASTER_PORT) must be in [1, 65534] with --nnodes > 1 (got {self.master_port}); "
                    "the supervisors use MASTER_PORT+1 too"
                )

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    def shared_root(self, run_dir: Path) -> Path:
        """Where global rank 0 writes checkpoints and the export, and every node reads them on --resume."""
        return Path(self.shared_dir) if self.shared_dir else run_dir

    def checkpoint_root(self, run_dir: Path) -> Path:
        return self.shared_root(run_dir) / "checkpoints"

    def global_rank(self, local_rank: int, per_node: int) -> int:
        return self.node_rank * per_node + local_rank

    def label(self) -> str:
        return f"node {self.node_rank}/{self.nnodes}"

    @classmethod
    def from_json(cls, value: Any, where: str = NODE_FILE) -> NodeSpec:
        """``node.json``'s object, each key a field of its exact type (``bool`` is no ``int``) and a missing
        one at its default: a damaged file is refused naming the key, never read back as another node."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        kinds = {f.name: type(f.default) for f in dataclasses.fields(cls)}
        for key, item in value.items():
            if key not in kinds:
                raise ValueError(f"{where}: unknown key {key!r}")
            if type(item) is not kinds[key]:
                raise ValueError(f"{where}.{key}: expected {kinds[key].__name__}, got {type(item).__name__}")
        return cls(**value)


def write_node_spec(run_dir: Path, spec: NodeSpec) -> None:
    write_text_atomic(run_dir / NODE_FILE, json.dumps(dataclasses.asdict(spec)) + "\n")


def read_node_spec(run_dir: Path) -> NodeSpec:
    """This node's spec as `up` wrote it; a run dir without one (single-node runs before) is node 0 of 1."""
    path = run_dir / NODE_FILE
    if not path.exists():
        return NodeSpec()
    return NodeSpec.from_json(bounded_json.read(path))
