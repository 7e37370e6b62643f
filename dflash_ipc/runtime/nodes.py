"""Several nodes, one run: where this node sits, and the supervisors' liveness group.

Every node runs its own ``dflash-ipc up`` with the same config plus ``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port`` (or the torchrun-style NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT; an option wins over its variable). Targets feed the drafters of their own node (rings
stay host-local); global numbering makes the rest one run:

* drafter global rank = node_rank * drafters_per_node + local rank; WORLD_SIZE = nnodes * drafters_per_node;
  the drafters' torch.distributed group rendezvouses on MASTER_ADDR:MASTER_PORT (drafter rank 0 serves the store);
* target shard = node_rank * targets_per_node + local rank, of nnodes * targets_per_node shards, so no batch
  is planned on two nodes;
* checkpoints (with the batch ledger) and the exported drafter are written once, by global rank 0, under the
  shared root (``--shared-dir``, default the run dir: give every node a run dir on shared storage, or one
  shared dir), and ``--resume`` on every node reads them from there.

The supervisors form a second, tiny group (:class:`NodeGroup`): a TCPStore on MASTER_ADDR:MASTER_PORT+1 served
by node 0's supervisor. State machine of one node's membership::

    join: set cfg/<node> (config + plan digest), wait for every node's (run.handshake_timeout_s)
        │   a node with another digest ─▶ refused before any process starts
    WATCHING (a thread, every run.heartbeat_interval_s): add beat/<node>, publish step/<node>, read the others
        │   another node's beat still for run.heartbeat_timeout_s ─▶ failure "node N missed heartbeats"
        │   fail/<node> set by another node ─────────────────────────▶ failure "node N failed: ..."
        │   the store unreachable (node 0 died or hangs) ────────────▶ failure "lost node 0 ..."
    FAILED: this node sets fail/<node> (what failed here), tears down, exits 1
    FINISHED: set done/<node>; node 0 keeps serving until every node is done (run.heartbeat_timeout_s at most)

A node's own failure is found by its supervisor (a child exits, reports Dead, misses heartbeats); the other
nodes learn it from fail/<node> at once, or from the missing beats within run.heartbeat_timeout_s when the
whole node hangs or its supervisor was killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from dflash_ipc.control.status import NodeStatus
from dflash_ipc.control.wire import Struct, from_wire, to_wire

log = logging.getLogger(__name__)

NODE_FILE = "node.json"
MAX_NODES = 4096


class NodeOptionError(ValueError):
    """A bad --nnodes/--node-rank/--master-addr/--master-port (or its environment variable)."""


@dataclass(frozen=True)
class NodeSpec(Struct):
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


def _int_option(option: str, env_var: str, value: int | None, env: Mapping[str, str]) -> int | None:
    if value is not None:
        return value
    raw = env.get(env_var, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise NodeOptionError(f"{option}: environment variable {env_var}={raw!r} is not an integer") from None


def resolve_node_spec(
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    shared_dir: str | None,
    env: Mapping[str, str],
) -> NodeSpec:
    """The node options, each from its command-line option or else its torchrun-style variable.

    A single node (NNODES unset or 1) ignores MASTER_ADDR/MASTER_PORT from the environment: the
    supervisor keeps its drafters' rendezvous on loopback, whatever the launcher exported."""
    n = _int_option("--nnodes", "NNODES", nnodes, env)
    n = 1 if n is None else n
    rank = _int_option("--node-rank", "NODE_RANK", node_rank, env)
    rank = 0 if rank is None else rank
    addr = master_addr if master_addr is not None else (env.get("MASTER_ADDR", "").strip() if n != 1 else "")
    port = _int_option("--master-port", "MASTER_PORT", master_port, env) if (n != 1 or master_port is not None) else None
    shared = str(Path(shared_dir).resolve()) if shared_dir else ""
    return NodeSpec(nnodes=n, node_rank=rank, master_addr=addr, master_port=port or 0, shared_dir=shared)


def drafter_envs(spec: NodeSpec, per_node: int) -> list[dict[str, str]]:
    """The torch.distributed rendezvous variables of this node's drafters, by local rank.

    One node: a free loopback port (init_distributed then keeps the store and gloo on loopback).
    Several: MASTER_ADDR:MASTER_PORT, global ranks, WORLD_SIZE over every node's drafters."""
    if spec.multi:
        addr, port = spec.master_addr, spec.master_port
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            addr, port = "127.0.0.1", s.getsockname()[1]
    return [
        dict(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(spec.nnodes * per_node),
            RANK=str(spec.global_rank(local, per_node)),
            LOCAL_RANK=str(local),
        )
        for local in range(per_node)
    ]


def write_node_spec(run_dir: Path, spec: NodeSpec) -> None:
    (run_dir / NODE_FILE).write_text(json.dumps(to_wire(spec)) + "\n")


def read_node_spec(run_dir: Path) -> NodeSpec:
    """This node's spec as `up` wrote it; a run dir without one (single-node runs before) is node 0 of 1."""
    path = run_dir / NODE_FILE
    if not path.exists():
        return NodeSpec()
    return from_wire(NodeSpec, json.loads(path.read_text()), NODE_FILE)


def run_digest(config: dict, plan: dict) -> str:
    """What every node must agree on: the config (less run-dir-local keys) and the data plan."""
    run = {k: v for k, v in config.get("run", {}).items() if k not in ("run_dir", "metrics_port")}
    cfg = {k: v for k, v in config.items() if k not in ("run", "source")} | {"run": run}
    return hashlib.sha256(json.dumps([cfg, plan], sort_keys=True, default=str).encode()).hexdigest()[:16]


class SingleNode:
    """The node group of a single-node run: nothing to meet, watch or tell."""

    def start_watch(self) -> None: ...
    def failure(self) -> str | None:
        return None

    def publish_step(self, step: int) -> None: ...
    def report_failure(self, text: str) -> str:
        return text

    def finish(self) -> None: ...
    def close(self) -> None: ...
    def status(self) -> NodeStatus | None:
        return None


def join_node_group(spec: NodeSpec, cfg, plan: dict, echo=print) -> NodeGroup | SingleNode:
    """Meet the other nodes' supervisors (RuntimeError naming the node that is missing or differs)."""
    if not spec.multi:
        return SingleNode()
    group = NodeGroup(spec, interval_s=cfg.run.heartbeat_interval_s, heartbeat_timeout_s=cfg.run.heartbeat_timeout_s)
    try:
        group.join(run_digest(cfg.to_dict(), plan), cfg.run.handshake_timeout_s)
    except BaseException:
        group.close()
        raise
    echo(f"[up] {spec.label()}: all nodes joined (supervisors on {group.where})")
    return group


class NodeGroup:
    """The supervisors of every node, over a TCPStore on MASTER_ADDR:MASTER_PORT+1 (node 0 serves it)."""

    def __init__(self, spec: NodeSpec, *, interval_s: float, heartbeat_timeout_s: float):
        if not spec.multi:
            raise ValueError("NodeGroup is for runs of several nodes")
        self.spec = spec
        self.interval_s = interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.port = spec.master_port + 1
        self._store = None  # the main thread's connection (node 0: the server)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._step = 0
        self.group_step: int | None = None
        self.nodes_done: set[int] = set()

    @property
    def where(self) -> str:
        return f"{self.spec.master_addr}:{self.port}"

    def _connect(self, timeout_s: float):
        from dflash_ipc.transport.rendezvous import tcp_store

        return tcp_store(self.spec.master_addr, self.port, False, timedelta(seconds=timeout_s))

    def join(self, digest: str, timeout_s: float) -> None:
        """Meet every node's supervisor; refuse a node whose config or plan differs (before any process starts)."""
        from dflash_ipc.transport.rendezvous import tcp_store

        me, n = self.spec.node_rank, self.spec.nnodes
        try:
            if me == 0:
                self._store = tcp_store(self.spec.master_addr, self.port, True, timedelta(seconds=timeout_s))
            else:
                self._store = self._connect(timeout_s)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError/DistStoreError
            role = "serve" if me == 0 else "reach node 0's"
            raise RuntimeError(
                f"node {me}: cannot {role} supervisor store on {self.where} within {timeout_s:g} s ({e}); "
                "check --master-addr/--master-port (MASTER_PORT+1 is used too) and that node 0 is up"
            ) from None
        self._store.set(f"cfg/{me}", digest)
        deadline = time.monotonic() + timeout_s
        keys = [f"cfg/{r}" for r in range(n)]
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [r for r in range(n) if not self._store.check([f"cfg/{r}"])]
                raise RuntimeError(
                    f"node {me}: node(s) {', '.join(map(str, missing))} did not join within {timeout_s:g} s "
                    "(run.handshake_timeout_s); start `dflash-ipc up` on every node"
                )
            time.sleep(0.1)
        for r in range(n):
            theirs = self._store.get(f"cfg/{r}").decode()
            if theirs != digest:
                raise RuntimeError(
                    f"node {r} runs another config or data plan (digest {theirs}, node {me}: {digest}); "
                    "every node must run the same config on the same data"
                )

    def start_watch(self) -> None:
        self._stop.clear()
        self._failure = None
        self._thread = threading.Thread(target=self._watch, name="node-group", daemon=True)
        self._thread.start()

    def stop_watch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_timeout_s + 5)
            self._thread = None

    def failure(self) -> str | None:
        with self._lock:
            return self._failure

    def publish_step(self, step: int) -> None:
        self._step = step

    def status(self) -> NodeStatus:
        """This node in the status snapshot; the group's step is node 0's (every rank steps in lockstep)."""
        group_step = self._step if self.spec.node_rank == 0 else self.group_step
        return NodeStatus(self.spec.node_rank, self.spec.nnodes, f"{self.spec.master_addr}:{self.spec.master_port}", group_step)

    def _fail(self, text: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = text

    def _watch(self) -> None:
        me, n = self.spec.node_rank, self.spec.nnodes
        try:
            store = self._connect(self.heartbeat_timeout_s)
        except Exception as e:  # noqa: BLE001
            self._fail(f"lost node 0's supervisor store on {self.where} ({e})")
            return
        seen = {r: (-1, time.monotonic()) for r in range(n) if r != me}
        while not self._stop.wait(self.interval_s):
            try:
                store.add(f"beat/{me}", 1)
                store.set(f"step/{me}", str(self._step))
                now = time.monotonic()
                for r in seen:
                    if store.check([f"fail/{r}"]):
                        self._fail(f"another node failed: {store.get(f'fail/{r}').decode()}")
                        return
                    if store.check([f"done/{r}"]):
                        self.nodes_done.add(r)
                        continue
                    beats = store.add(f"beat/{r}", 0)
                    if beats != seen[r][0]:
                        seen[r] = (beats, now)
                    elif now - seen[r][1] > self.heartbeat_timeout_s:
                        self._fail(
                            f"node {r} missed heartbeats for {now - seen[r][1]:.0f} s (run.heartbeat_timeout_s = "
                            f"{self.heartbeat_timeout_s:g}): its supervisor hangs, was killed, or lost the network"
                        )
                        return
                if store.check(["step/0"]):
                    self.group_step = int(store.get("step/0").decode())
            except Exception as e:  # noqa: BLE001 - the store is gone or does not answer
                if not self._stop.is_set():
                    self._fail(f"lost node 0's supervisor store on {self.where} (node 0 died or hangs: {e})")
                return

    def report_failure(self, text: str) -> str:
        """Tell the other nodes what failed here (the first line names the process); returns the text naming this node."""
        me = self.spec.node_rank
        text = f"{self.spec.label()}: {text}"
        try:
            self._store.set(f"fail/{me}", text.splitlines()[0][:2000])
            # A failure here is often the echo of another node's (gloo: "connection closed by peer"):
            # name that node's own report too, if it arrives within two heartbeat intervals.
            others = [f"fail/{r}" for r in range(self.spec.nnodes) if r != me]
            deadline = time.monotonic() + 2 * self.interval_s
            while time.monotonic() < deadline and not any(self._store.check([k]) for k in others):
                time.sleep(0.05)
            for key in others:
                if self._store.check([key]):
                    text += f"\n  meanwhile {self._store.get(key).decode()}"
        except Exception as e:  # noqa: BLE001 - node 0 may be gone already: the others see its beats stop
            log.warning("could not report the failure to the other nodes: %s", e)
        return text

    def finish(self) -> None:
        """This node finished cleanly; node 0 serves the store until every node has said so."""
        me, n = self.spec.node_rank, self.spec.nnodes
        self.stop_watch()
        try:
            self._store.set(f"done/{me}", "1")
            if me == 0:
                keys = [f"done/{r}" for r in range(n)]
                deadline = time.monotonic() + self.heartbeat_timeout_s
                while not self._store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except Exception as e:  # noqa: BLE001
            log.warning("could not tell the other nodes this one finished: %s", e)

    def close(self) -> None:
        self.stop_watch()
        self._store = None  # the TCPStore closes its connection (node 0: its server) when released
