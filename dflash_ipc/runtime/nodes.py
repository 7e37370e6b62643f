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
by node 0's supervisor. State machine of one node's membership (g: the generation, the run's attempt number,
the same on every node)::

    join: set cfg/<node> (config + plan digest), wait for every node's (run.handshake_timeout_s)
        │   a node with another digest ─▶ refused before any process starts
    WATCHING (a thread, every run.heartbeat_interval_s, until the run ends; it beats through teardowns and votes):
        │   add beat/<node>, publish step/<node>, read the others
        │   another node's beat still for run.heartbeat_timeout_s ─▶ failure "node N missed heartbeats"
        │   g<g>/fail/<node> set by another node ───────────────────▶ failure "another node failed: ..."
        │   a store call unanswered for run.heartbeat_timeout_s,
        │   or the store gone (node 0 died or hangs) ───────────────▶ failure "lost node 0's supervisor store ..."
        │   a process here silent while a node's beats (or the store) are still for 3 beats: that node is blamed
    FAILED: tear down, set g<g>/fail/<node> (what failed here), then VOTE (runtime.restarts):
        │   set g<g>/vote/<node> = restart (restarts left, no stop asked) or stop; the first value written to
        │   g<g>/decision (compare_set) is every node's decision: restart once every node voted restart;
        │   stop if one voted stop, finished, went still for run.heartbeat_timeout_s, or did not vote within
        │   run.handshake_timeout_s + 2 x run.teardown_grace_s
        │   stop ─▶ exit 1          restart ─▶ g+1, every node restarts its group with --resume ─▶ WATCHING
    FINISHED: set done/<node>; node 0 keeps serving until every node is done (run.heartbeat_timeout_s at most)

Node 0's store lives in node 0's supervisor: if node 0 hangs (SIGSTOP), a client call to it blocks with no
timeout of its own, so every call is bounded: the watch thread's by the time since its last finished round,
the main thread's by :func:`bounded_call`.

A node's own failure is found by its supervisor (a child exits, reports Dead, misses heartbeats); the other
nodes learn it from g<g>/fail/<node> at once, or from the missing beats within run.heartbeat_timeout_s when
the whole node hangs or its supervisor was killed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

from dflash_ipc.control.status import NodeStatus
from dflash_ipc.rundir.node_spec import MAX_NODES, NODE_FILE, NodeOptionError, NodeSpec, read_node_spec, write_node_spec  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


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


def run_digest(config: dict, plan: dict) -> str:
    """What every node must agree on: the config (less run-dir-local keys) and the data plan."""
    run = {k: v for k, v in config.get("run", {}).items() if k not in ("run_dir", "metrics_port")}
    cfg = {k: v for k, v in config.items() if k not in ("run", "source")} | {"run": run}
    # the data's content and plan, not each node's file times (data/fingerprint.py)
    fingerprint = plan.get("data_fingerprint")
    plan = plan | {"data_fingerprint": fingerprint.get("digest") if isinstance(fingerprint, dict) else fingerprint}
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

    def suspect(self) -> str | None:
        return None

    def agree_restart(self, want: bool, timeout_s: float) -> tuple[bool, str]:  # noqa: ARG002
        return want, ""

    def begin_generation(self) -> int:
        return 0


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


def bounded_call(fn, timeout_s: float):
    """``fn()`` on a daemon thread, waited for at most ``timeout_s`` (TimeoutError after).

    A TCPStore client call to a server that is stopped (SIGSTOP, a hung host) waits for its answer
    with no timeout of its own; the thread left behind is a daemon and ends with the process."""
    box: dict = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, name="node-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


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
        self._store_lost = False  # a main-thread call timed out: the connection is busy for good
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._step = 0
        self.generation = 0  # attempts of the whole run so far; every node's is the same (agree_restart)
        self._seen: dict[int, tuple[int, float]] = {}  # other node -> (its beat count, when it last changed)
        self._round_at = 0.0  # when the watch thread last finished a round with the store
        self.group_step: int | None = None
        self.nodes_done: set[int] = set()

    @property
    def where(self) -> str:
        return f"{self.spec.master_addr}:{self.port}"

    def _connect(self, timeout_s: float):
        from dflash_ipc.transport.rendezvous import tcp_store

        return tcp_store(self.spec.master_addr, self.port, False, timedelta(seconds=timeout_s))

    def _call(self, fn):
        """A main-thread store call, bounded: node 0 may hang with the store in it."""
        if self._store_lost:
            raise TimeoutError("an earlier call to the supervisor store got no answer")
        try:
            return bounded_call(fn, max(2 * self.interval_s, 1.0))
        except TimeoutError:
            self._store_lost = True
            raise

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
        """Watch from now on (idempotent: the thread keeps beating through teardowns and restarts)."""
        with self._lock:
            self._failure = None
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._round_at = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="node-group", daemon=True)
        self._thread.start()

    def stop_watch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A healthy round ends within an interval; a thread stuck in a call to a hung store is left (a daemon).
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None

    def _store_silent_s(self) -> float:
        """How long the watch thread has waited on node 0's store (0 on node 0: the store is in this process)."""
        if self.spec.node_rank == 0 or self._thread is None or not self._thread.is_alive():
            return 0.0
        return max(0.0, time.monotonic() - self._round_at - self.interval_s)  # the next round starts an interval after

    def _lost_node0(self, silent_s: float) -> str:
        return (
            f"lost node 0's supervisor store on {self.where}: no answer for {silent_s:.0f} s "
            f"(run.heartbeat_timeout_s = {self.heartbeat_timeout_s:g}): node 0 hangs or the network is down"
        )

    def _missed(self, r: int, still_s: float) -> str:
        return (
            f"node {r} missed heartbeats for {still_s:.0f} s (run.heartbeat_timeout_s = "
            f"{self.heartbeat_timeout_s:g}): its supervisor hangs, was killed, or lost the network"
        )

    def failure(self) -> str | None:
        silent = self._store_silent_s()
        with self._lock:
            if self._failure is None and silent > self.heartbeat_timeout_s:
                self._failure = self._lost_node0(silent)
            return self._failure

    def suspect(self) -> str | None:
        """When a process here went silent: the node it likely waits for (a collective with a hung node
        blocks it), if one has been still for 3 beats; else None (the fault is local)."""
        return self._stalled(3 * self.interval_s)

    def _stalled(self, after_s: float) -> str | None:
        """Node 0's store silent, or another node's beats still, for more than ``after_s``."""
        silent = self._store_silent_s()
        if silent > after_s:
            return self._lost_node0(silent)
        now = time.monotonic()
        with self._lock:
            stale = [(now - since, r) for r, (_, since) in self._seen.items() if r not in self.nodes_done]
        still_s, r = max(stale, default=(0.0, -1))
        return self._missed(r, still_s) if still_s > after_s else None

    def publish_step(self, step: int) -> None:
        self._step = step

    def status(self) -> NodeStatus:
        """This node in the status snapshot; the group's step is node 0's (every rank steps in lockstep)."""
        group_step = self._step if self.spec.node_rank == 0 else self.group_step
        return NodeStatus(self.spec.node_rank, self.spec.nnodes, f"{self.spec.master_addr}:{self.spec.master_port}", group_step)

    def _fail(self, text: str, generation: int) -> None:
        with self._lock:
            if self._failure is None and generation == self.generation:
                self._failure = text

    def _watch(self) -> None:
        me, n = self.spec.node_rank, self.spec.nnodes
        try:
            store = self._connect(self.heartbeat_timeout_s)
        except Exception as e:  # noqa: BLE001
            self._fail(f"lost node 0's supervisor store on {self.where} ({e})", self.generation)
            return
        now = time.monotonic()
        with self._lock:
            self._seen = {r: (-1, now) for r in range(n) if r != me}
        while not self._stop.wait(self.interval_s):
            gen = self.generation
            try:
                store.add(f"beat/{me}", 1)
                store.set(f"step/{me}", str(self._step))
                for r in list(self._seen):
                    if store.check([f"g{gen}/fail/{r}"]):
                        self._fail(f"another node failed: {store.get(f'g{gen}/fail/{r}').decode()}", gen)
                    if r in self.nodes_done or store.check([f"done/{r}"]):
                        self.nodes_done.add(r)
                        continue
                    beats = store.add(f"beat/{r}", 0)
                    now = time.monotonic()
                    with self._lock:
                        if beats != self._seen[r][0]:
                            self._seen[r] = (beats, now)
                        still_s = now - self._seen[r][1]
                    if still_s > self.heartbeat_timeout_s:
                        self._fail(self._missed(r, still_s), gen)
                if store.check(["step/0"]):
                    self.group_step = int(store.get("step/0").decode())
                self._round_at = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store is gone or does not answer
                if not self._stop.is_set():
                    self._fail(f"lost node 0's supervisor store on {self.where} (node 0 died or hangs: {e})", gen)
                return

    def report_failure(self, text: str) -> str:
        """Tell the other nodes what failed here (the first line names the process); returns the text naming this node."""
        me, gen = self.spec.node_rank, self.generation
        text = f"{self.spec.label()}: {text}"
        try:
            self._call(lambda: self._store.set(f"g{gen}/fail/{me}", text.splitlines()[0][:2000]))
            # A failure here is often the echo of another node's (gloo: "connection closed by peer"):
            # name that node's own report too, if it arrives within two heartbeat intervals.
            others = [f"g{gen}/fail/{r}" for r in range(self.spec.nnodes) if r != me]
            deadline = time.monotonic() + 2 * self.interval_s
            while time.monotonic() < deadline and not any(self._call(lambda k=k: self._store.check([k])) for k in others):
                time.sleep(0.05)
            for key in others:
                if (theirs := self._read(key)) is not None:
                    text += f"\n  meanwhile {theirs}"
        except Exception as e:  # noqa: BLE001 - node 0 may be gone already: the others see its beats stop
            log.warning("could not report the failure to the other nodes: %s", e)
        return text

    def _read(self, key: str) -> str | None:
        """A key's value through the main thread's connection (bounded), None while it is unset."""
        return self._call(lambda: self._store.get(key)).decode() if self._call(lambda: self._store.check([key])) else None

    def agree_restart(self, want: bool, timeout_s: float) -> tuple[bool, str]:
        """After this node's teardown: do all nodes restart together? (decision, why).

        Each node votes; the first decision written to ``g<gen>/decision`` wins (compare_set), so every
        node acts alike: restart only when every node voted to; stop when one votes stop, finished,
        misses heartbeats, or has not voted within ``timeout_s``."""
        me, n, gen = self.spec.node_rank, self.spec.nnodes, self.generation
        key = f"g{gen}/decision"

        def decide(value: str) -> str:
            return self._call(lambda: self._store.compare_set(key, "", value)).decode()

        try:
            self._call(lambda: self._store.set(f"g{gen}/vote/{me}", "restart" if want else "stop"))
            decision = "" if want else decide(f"stop: node {me} has no restart left or was asked to stop")
            deadline = time.monotonic() + timeout_s
            while not decision:
                if decided := self._read(key):
                    decision = decided
                    break
                votes = {r: v for r in range(n) if (v := self._read(f"g{gen}/vote/{r}")) is not None}
                late = [r for r in range(n) if r not in votes]
                if not late:
                    stop = [r for r, v in votes.items() if v != "restart"]
                    decision = decide("restart" if not stop else f"stop: node {stop[0]} does not restart")
                elif self.nodes_done & set(late):
                    decision = decide(f"stop: node {min(self.nodes_done & set(late))} finished")
                elif (hung := self._stalled(self.heartbeat_timeout_s)) is not None:
                    decision = decide(f"stop: {hung}")
                elif time.monotonic() > deadline:
                    decision = decide(f"stop: node(s) {', '.join(map(str, late))} did not vote within {timeout_s:g} s")
                else:
                    time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - node 0 gone or hung: no restart can be agreed
            return False, f"cannot agree on a restart with the other nodes ({e or type(e).__name__})"
        return decision == "restart", decision

    def begin_generation(self) -> int:
        """Every node agreed to restart: the next attempt's failures are told under new keys."""
        with self._lock:
            self.generation += 1
            self._failure = None
        return self.generation

    def finish(self) -> None:
        """This node finished cleanly; node 0 serves the store until every node has said so."""
        me, n = self.spec.node_rank, self.spec.nnodes
        self.stop_watch()
        try:
            self._call(lambda: self._store.set(f"done/{me}", "1"))
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
