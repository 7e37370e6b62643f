"""`dflash-ipc up`: start one process per target and drafter, watch them, end them cleanly.

Run states (the supervisor's own state machine)::

    validate config ─▶ lock RUN_DIR (runtime.run_lock; held to exit) ─▶ PREPARING (status.json; refused: exit 2)
      ─▶ probe: check model/devices, tokenize + plan once ─▶ prepare RUN_DIR (0700) ─▶ STARTING
    STARTING: spawn children ─▶ handshake (run.handshake_timeout_s) ─▶ RUNNING (systemd READY=1)
    PREPARING, STARTING: a stop signal (runtime.stop_signals) ─▶ STOPPED, exit 0, nothing trained (a child or
                                       the probe that had the signal too ends at once: a stop, not a failure)
    RUNNING:
      every drafter Done            ─▶ Shutdown targets ─▶ FINISHED, exit 0
      SIGTERM / SIGINT / SIGHUP     ─▶ STOPPING: Shutdown(checkpoint) to drafters; they agree on
                                       a step boundary, checkpoint, Done ─▶ Shutdown targets ─▶ STOPPED, exit 0
      a child exits unexpectedly,
      sends Dead, misses heartbeats,
      or its loop stalls            ─▶ FAILED: teardown (runtime.children: Shutdown, SIGTERM, SIGKILL after
                                       run.teardown_grace_s), sweep shared memory, exit 1 naming the
                                       process, its exit code or signal, and the tail of its log;
                                       with --max-restarts K: restart the group from the last
                                       checkpoint (--resume semantics), at most K times
                                       (runtime.restarts; with several nodes, every node together).

The supervisor watches exit statuses (``Popen.poll``; ``runtime.forkserver`` with run.launcher) and heartbeats; it never trains
and never touches the rings, so it stays responsive. Each attempt draws a new run key; a child
gets it through an inherited pipe with the supervisor's pid in argv (``runtime.launch``), and
every frame it sends is sealed with it (``channels.PeerAuth``): a message that is not from the
child spawned under that identity (any shape, any key, an orphan of an earlier attempt, a
Hello from another pid) is rejected and counted (``supervisor_rejected_by_kind`` in status),
never fatal. When heartbeats stop, the process blamed is one that the kernel reports stopped
(SIGSTOP, ``T`` state) if any, else the one whose last heartbeat is oldest: a drafter waiting in
a collective for a stuck peer goes silent too, but later. Heartbeats come from a thread of the
child (``runtime.heartbeat``), so a long step never silences them; a child that beats while its
loop has not moved for run.stall_timeout_s is the stall rule's (``liveness.stalled_child``). Status is served from the moment the
children are spawned (state ``starting``), SIGTERM during the handshake stops the run at once
(exit 0, nothing trained), and the socket files are removed when the supervisor exits. It serves its status snapshot
read-only on ``sock/status`` (REP; over tcp: ``control.json`` names both endpoints, see
``control.plane``) and writes ``status.json`` every second; with
``run.metrics_port`` it also serves that snapshot as Prometheus metrics on 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import psutil
import zmq

from dflash_ipc.config import DFlashConfig, write_resolved_config
from dflash_ipc.control import channels, curve, handshake, protocol
from dflash_ipc.control.channels import PeerAuth
from dflash_ipc.control.handshake import HandshakeError
from dflash_ipc.control.plane import ControlSpec, SupervisorSockets
from dflash_ipc.control.protocol import Dead, Done, Heartbeat, RejectCounter, Shutdown, to_wire
from dflash_ipc.control.stats import DrafterStats, DrafterSummary
from dflash_ipc.control.status import ENDED_STATES, SCHEMA_VERSION, StatusSnapshot, Totals
from dflash_ipc.data.run_length import DataLength, run_length_text
from dflash_ipc.drafter.checkpoint.layout import latest_committed_step
from dflash_ipc.ops import sdnotify
from dflash_ipc.ops.prometheus import MetricsServer
from dflash_ipc.ops.status_server import serve_status_requests
from dflash_ipc.rundir.fsutil import make_private_dir, open_append, write_text_atomic
from dflash_ipc.runtime import liveness, progress, stop_signals
from dflash_ipc.runtime.children import Child, teardown
from dflash_ipc.runtime.forkserver import ForkServer, launcher_for, popen_with
from dflash_ipc.runtime.launch import child_argv, child_env, key_pipe
from dflash_ipc.runtime.nodes import NodeGroup, NodeSpec, SingleNode, drafter_envs, join_node_group, write_node_spec
from dflash_ipc.runtime.probe import run_probe
from dflash_ipc.runtime.progress import PlainProgress, RichProgress, eta_seconds, finished_summary, progress_display, progress_snapshot
from dflash_ipc.runtime.restarts import GroupFailed, run_with_restarts
from dflash_ipc.runtime.resume_check import check_resume_checkpoints, check_resume_config, check_resume_data
from dflash_ipc.runtime.run_lock import RunDirLock, lock_run_dirs
from dflash_ipc.transport.shm_names import new_run_id, sweep_run_shm

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1


class StoppedDuringStart(RuntimeError):
    pass


def run_end(stop_requested: str, summary: DrafterSummary | None) -> tuple[str, str | None]:
    """The state and end_reason of a run whose drafters all sent Done: "stopped" when a signal asked for
    it (the step it stopped at: resumable), else "finished" (their own end: max_steps, max_seconds, data exhausted)."""
    if stop_requested:
        return "stopped", f"{stop_requested} at step {summary.final.work.step if summary else 0}"
    return "finished", summary.reason if summary else None


class Supervisor:
    def __init__(
        self,
        cfg: DFlashConfig,
        run_dir: Path,
        *,
        resume: bool = False,
        replan: bool = False,
        max_restarts: int = 0,
        echo=print,
        forward_only: int = 0,
        bench_counters: bool = False,
        live_progress: bool = False,
        node: NodeSpec | None = None,
    ):
        self.cfg = cfg
        # This node's place in a run of several (runtime/nodes.py); a single node by default.
        self.node = node or NodeSpec()
        self.node_group: NodeGroup | SingleNode = SingleNode()
        self.run_dir = run_dir
        self.resume = resume
        self.replan = replan  # up --replan: a resumed run may re-plan changed data (runtime/resume_check.py)
        self.max_restarts = max_restarts
        self.echo = echo
        # True: a live progress bar on this process's stdout (a TTY); False: plain lines through echo.
        self.live_progress = live_progress
        self._progress_display: PlainProgress | RichProgress | None = None
        self.state = "preparing"
        self.children: list[Child] = []
        self.stop_requested = ""
        self.end_reason: str | None = None  # an ended run: why (status.json's end_reason)
        self.started_unix = time.time()
        self.rejects = RejectCounter("supervisor", log)
        self._auth = PeerAuth(None)  # a new key for each attempt (_run_group)
        self._control: SupervisorSockets | None = None  # the ROUTER and REP of the current attempt
        self._next_status = 0.0
        self._handshake_done = False
        self.run_id = ""
        self.plan: dict = {}
        self._summary: DrafterSummary | None = None
        # The snapshot status.json holds; /metrics (another thread) serves this one, never a half-built one.
        self._last_snapshot: StatusSnapshot | None = None
        # Benchmark ceiling: only targets, N batches each, slots released as soon as packed.
        self.forward_only = forward_only
        self.bench_counters = bench_counters  # a benchmark's figures from every target (bench/target_counters.py)
        self.dir_lock: RunDirLock = lock_run_dirs(run_dir, self.node)  # one supervisor per run dir: taken by prepare (or earlier)
        self.launcher: ForkServer | None = None  # run.launcher or one set before prepare: probe and children fork from it; closed at end

    # ------------------------------------------------------------------ prepare

    def finished_already(self) -> str | None:
        """With --resume: why there is nothing left to train (the committed checkpoint is at or past
        training.max_steps), else None. Read from ``latest`` and its meta.json, no process started:
        a finished run restarted (systemd's Restart=, a repeated command) exits at once."""
        max_steps = self.cfg.training.max_steps
        if not self.resume or max_steps <= 0:
            return None
        step = latest_committed_step(self.node.checkpoint_root(self.run_dir))
        if step is None or step < max_steps:
            return None
        return f"the checkpoint is at step {step}, training.max_steps is {max_steps}: nothing left to train"

    def prepare(self) -> None:
        """Everything that can fail on bad input happens here, before any process starts.

        The checks that need torch and transformers, tokenizing and planning run first, in the
        probe process (``runtime.probe``): a refused config leaves the run directory uncreated."""
        self.dir_lock.take()  # before anything there is touched, swept or spawned; `status` now says "preparing"
        self._write_status()
        run_dir = self.run_dir
        if not self.resume and (self.node.checkpoint_root(run_dir) / "latest").exists():
            raise GroupFailed(
                f"{self.node.shared_root(run_dir)} already holds checkpoints; pass --resume to continue that run, or use another --run-dir"
            )
        if self.resume:  # the shared checkpoint root of several nodes, too (the run dir's: validate_for_up)
            check_resume_config(self.cfg, self.node.checkpoint_root(run_dir), replan=self.replan)
        n_shards = self.node.nnodes * len(self.cfg.topology.targets)  # every target of every node: one global shard each
        try:
            self.launcher = self.launcher or launcher_for(self.cfg, child_env(), self.echo)  # says where its preload went
        except RuntimeError:
            if not self.stop_requested:  # else the server had the stop signal too, before it could ignore it
                raise
        if self.stop_requested:  # nothing to tokenize for: the caller stops
            return
        plan = run_probe(self.cfg, run_dir, n_shards, launcher=self.launcher)
        self.echo(f"[up] target: {plan.target}")
        self.echo(f"[up] data: {plan.summary} ({plan.seconds:.1f} s); plan: {plan.n_batches_total} batches over {n_shards} target shard(s)")
        data = DataLength(plan.n_batches_total, plan.samples, self.cfg.data.num_epochs, self.node.nnodes * len(self.cfg.topology.drafters))
        self.echo(f"[up] run length: {run_length_text(self.cfg.training.max_steps, self.cfg.training.max_seconds, data)}")
        replanned = self._check_resume_data(plan.plan_json()) if self.resume else False
        make_private_dir(run_dir)
        for sub in ("logs", "checkpoints", "data"):
            make_private_dir(run_dir / sub, root=run_dir)  # never through a link planted there
        if self.cfg.run.control == "tcp":
            # Per node, in its own run dir: a node's control plane links only its own processes.
            curve.write_run_keys(run_dir)
        else:
            channels.prepare_socket_dir(run_dir)
        if self.node.shared_dir:
            make_private_dir(self.node.checkpoint_root(run_dir), root=self.node.shared_root(run_dir))
        write_node_spec(run_dir, self.node)
        old_id = (run_dir / "run_id").read_text().strip() if (run_dir / "run_id").exists() else ""
        if old_id:
            self.dir_lock.own_fence().check("the sweep of the previous run's shared memory")
            swept = sweep_run_shm(old_id)
            if swept:
                self.echo(f"[up] swept {len(swept)} leftover shared-memory segment(s) of the previous run")
        if not self.resume and (run_dir / "metrics.jsonl").exists():
            (run_dir / "metrics.jsonl").unlink()
        self.run_id = new_run_id()
        write_text_atomic(run_dir / "run_id", self.run_id + "\n")
        write_resolved_config(self.cfg, run_dir)
        self.plan = plan.plan_json() | ({"replan": True} if replanned else {})
        write_text_atomic(run_dir / "plan.json", json.dumps(self.plan, indent=2))

    def _check_resume_data(self, plan: dict) -> bool:
        """Before anything is written: the checkpoint to resume from verified end to end (every sha256,
        its ledger against this plan), falling back past damaged ones with the reason printed, and
        its data against this data. True: changed data re-planned (``--replan``)."""
        choice = check_resume_checkpoints(self.cfg, self.node.checkpoint_root(self.run_dir), digests=True, plan=plan)
        for note in choice.notes:
            self.echo(f"[up] checkpoint: {note}")
        replanned, line = check_resume_data(self.cfg, choice, plan, replan=self.replan)
        if line:
            self.echo(f"[up] {line}")
        return replanned

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        metrics = None
        port = self.cfg.run.metrics_port
        if port:
            try:
                metrics = MetricsServer(port, lambda: self._last_snapshot)
            except OSError as e:
                self.echo(f"[up] error: cannot serve metrics on 127.0.0.1:{port} ({e}); choose a free run.metrics_port, or 0 for none")
                return EXIT_FAILED
            self.echo(f"[up] metrics: http://127.0.0.1:{metrics.port}/metrics")
        try:
            try:
                self.node_group = join_node_group(self.node, self.cfg, self.plan, self.echo)
            except RuntimeError as e:
                self.echo(f"[up] error: {e}")
                return EXIT_FAILED
            return self._run_with_restarts()
        finally:
            self.node_group.close()
            if metrics is not None:
                metrics.close()
            if self.launcher is not None:
                self.launcher.close()
            self.dir_lock.release()

    def abandon(self) -> None:
        """A refused start, or one a stop signal ended before any child started: status.json says failed
        (stopped), and what the lock made for this run goes again."""
        self.state = "stopped" if self.stop_requested else "failed"
        self.end_reason = f"{self.stop_requested} before training started" if self.stop_requested else None
        self._write_status()
        if self.launcher is not None:
            self.launcher.close()
        self.dir_lock.release(remove_created=True, written=("status.json",))

    def _run_with_restarts(self) -> int:
        def failed() -> None:
            self.state = "failed"
            self._write_status()

        def new_attempt() -> None:
            self.run_id = new_run_id()
            write_text_atomic(self.run_dir / "run_id", self.run_id + "\n")

        run = self.cfg.run
        return run_with_restarts(
            self._run_group,
            self.node_group,
            resume=self.resume,
            max_restarts=self.max_restarts,
            stop_requested=lambda: self.stop_requested,
            on_failed=failed,
            on_restart=new_attempt,
            vote_timeout_s=run.handshake_timeout_s + 2 * run.teardown_grace_s,
            echo=self.echo,
        )

    def _spawn(self, resume: bool) -> None:
        cfg = self.cfg
        base_env = child_env()
        self.children = [Child("target", r, d) for r, d in enumerate(cfg.topology.targets)]
        if not self.forward_only:
            self.children += [Child("drafter", r, d) for r, d in enumerate(cfg.topology.drafters)]
        rendezvous = drafter_envs(self.node, len(cfg.topology.drafters))
        cpu_shares = liveness.cpu_shares_for(len(self.children)) if (cfg.run.cpu_affinity == "auto" and cfg.topology.on_cuda) else None
        parent = self.launcher.pid if self.launcher else os.getpid()  # the process whose death ends a child
        for i, ch in enumerate(self.children):
            env = dict(base_env)
            key_fd = key_pipe(self._auth.key)
            argv = child_argv(ch.role, parent, key_fd) + ["--run-dir", str(self.run_dir), "--rank", str(ch.rank)]
            argv += ["--generation", self.dir_lock.own_fence().argv_value]  # its writes there are fenced (dflash_ipc.rundir.fence)
            argv += self._control.child_argv
            if self.forward_only:
                argv += ["--forward-only", str(self.forward_only)]
            if self.bench_counters and ch.role == "target":
                argv.append("--bench-counters")
            if cpu_shares:
                argv += ["--cpus", ",".join(map(str, cpu_shares[i]))]
            if ch.role == "drafter":
                env.update(rendezvous[ch.rank])
                if resume:
                    argv.append("--resume")
            out = open_append(self.run_dir / "logs" / f"{ch.name}.stdout", root=self.run_dir, text=False)
            try:
                ch.popen = popen_with(self.launcher, argv, stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=(key_fd,))
            finally:
                out.close()
                os.close(key_fd)
            ch.started = time.time()

    def _run_group(self, resume: bool) -> int:
        spec = ControlSpec.for_run(self.run_dir, self.cfg.run.control, self.cfg.run.control_host, key_root=self.run_dir)
        self._control = control = SupervisorSockets.open(spec, self.rejects)
        router, status_sock = control.router, control.status
        self.state = "starting"
        old_handlers = stop_signals.install(self.request_stop)
        self._auth = PeerAuth(channels.new_run_key(), b"supervisor")
        self._handshake_done = False
        try:
            self._spawn(resume)
            self.node_group.start_watch()
            self.echo(
                f"[up] started {len(self.children)} processes: "
                + ", ".join(f"{c.name}@{c.device} pid {c.popen.pid}" for c in self.children)
            )
            self._write_status()
            t0 = time.perf_counter()
            try:
                hellos = handshake.coordinate(
                    router,
                    [c.key for c in self.children],
                    self.cfg.run.handshake_timeout_s,
                    self.rejects,
                    # a stop signal first: the children still importing had it too, and died of it
                    lambda: self._raise_if_stopped() or self._failed_child_text(router) or self._node_failure(),
                    on_other=self._on_decoded,
                    on_dead=self._on_decoded,
                    auth=self._auth,
                    pids={c.key: c.popen.pid for c in self.children},
                    tick=lambda: self._starting_tick(status_sock),
                )
            except HandshakeError as e:
                raise GroupFailed(self._failure_text(str(e))) from None
            except StoppedDuringStart as e:
                self.state, self.end_reason = "stopped", f"{e} before training started"
                self.echo(f"[up] {e}: stopping before training started (nothing to checkpoint)")
                return EXIT_OK
            self.state = "running"
            self._handshake_done = True
            now = time.monotonic()
            for c in self.children:
                c.last_beat = now
            self.echo(progress.ready_text(len(self.children), time.perf_counter() - t0, hellos))
            sdnotify.notify_ready(f"running {len(self.children)} processes")
            self._progress_display = progress_display(self.live_progress, self.echo)
            return self._watch(router, status_sock)
        except GroupFailed as e:
            # said at once: the teardown below may wait run.teardown_grace_s for a stuck process
            self.end_reason = str(e).splitlines()[0] if str(e) else None
            self.echo(f"[up] failure detected: {str(e).splitlines()[0]}; tearing the group down")
            raise
        finally:
            self._close_progress()
            self._teardown(router)
            self._write_status()
            control.close()
            sweep_run_shm(self.run_id)
            channels.remove_socket_files(self.run_dir, len(self.cfg.topology.targets), len(self.cfg.topology.drafters))
            stop_signals.restore(old_handlers)

    def _raise_if_stopped(self) -> None:
        if self.stop_requested:
            raise StoppedDuringStart(self.stop_requested)

    def _node_failure(self) -> str | None:
        """Another node failed, or cannot be reached (runs of several nodes); publishes this node's step."""
        lead = self._lead_drafter()
        self.node_group.publish_step(lead.work.step if lead else 0)
        return self.node_group.failure()

    def _starting_tick(self, status_sock: zmq.Socket) -> None:
        """Runs every 0.2 s of the handshake: status stays served, and SIGTERM is honoured now."""
        self._raise_if_stopped()
        self._control.plane.count_refusals()
        if status_sock.poll(0):
            serve_status_requests(status_sock, self.snapshot, self.rejects)
        now = time.monotonic()
        if now >= self._next_status:
            self._next_status = now + 1.0
            self._write_status()

    def request_stop(self, why: str) -> None:
        """A stop signal's handler (runtime.stop_signals): the first one counts."""
        if not self.stop_requested:
            self.stop_requested = why

    def _send(self, router: zmq.Socket, ch: Child, msg: protocol.Message) -> None:
        try:
            router.send_multipart([self._auth.route(handshake.identity(ch.role, ch.rank)), protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _watch(self, router: zmq.Socket, status_sock: zmq.Socket) -> int:
        cfg = self.cfg
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(status_sock, zmq.POLLIN)
        drafters = [c for c in self.children if c.role == "drafter"]
        targets = [c for c in self.children if c.role == "target"]
        stop_sent = False
        targets_stopped = False
        next_status = 0.0
        watchdog = sdnotify.watchdog_interval_s()
        next_watchdog = 0.0
        while True:
            events = dict(poller.poll(100))
            self._control.plane.count_refusals()
            if router in events:
                self._drain_router(router)
            if status_sock in events:
                serve_status_requests(status_sock, self.snapshot, self.rejects)
            if self.stop_requested and not stop_sent:
                stop_sent = True
                self.state = "stopping"
                sdnotify.notify_stopping("checkpointing")
                self.echo(f"[up] {self.stop_requested}: asking drafters to checkpoint and stop")
                for ch in drafters:
                    self._send(router, ch, Shutdown(reason=self.stop_requested, checkpoint=True))
            culprit = self._failed_child(router, stop_sent or targets_stopped)
            if culprit is not None:
                raise GroupFailed(self._failure_text(liveness.failure_line(culprit), culprit))
            node_failure = self._node_failure() if not targets_stopped else None
            if node_failure:
                raise GroupFailed(node_failure)
            now = time.monotonic()
            silent = liveness.silent_child(self.children, now, cfg.run.heartbeat_timeout_s) if not targets_stopped else None
            stall_s = cfg.run.stall_timeout_s or 10 * cfg.run.heartbeat_timeout_s
            silent = silent or (liveness.stalled_child(self.children, now, stall_s) if not targets_stopped else None)
            if silent is not None:  # in a run of several nodes, likely waiting in a collective for a hung node
                hung = self.node_group.suspect()
                raise GroupFailed(f"{hung}; here {silent[1]}" if hung else self._failure_text(silent[1], silent[0]))
            if self.forward_only and all(c.done is not None for c in targets):
                for c in liveness.wait_for_exits(targets, max(5.0, cfg.run.teardown_grace_s)):
                    self.echo(f"[up] {c.name} sent Done but is still running after run.teardown_grace_s; stopping it")
                self.state = "finished"
                self._write_status()
                return EXIT_OK
            if drafters and all(c.done is not None for c in drafters) and not targets_stopped:
                targets_stopped = True
                for ch in targets:
                    self._send(router, ch, Shutdown(reason="training finished"))
            if targets_stopped:
                if all(c.popen.poll() is not None for c in targets):
                    bad = [c for c in targets if c.popen.returncode != 0]
                    if bad:
                        raise GroupFailed(
                            self._failure_text(f"{bad[0].name} {liveness.describe_exit(bad[0].popen.returncode)} while stopping", bad[0])
                        )
                    for c in liveness.wait_for_exits(drafters, max(5.0, cfg.run.teardown_grace_s)):
                        self.echo(f"[up] {c.name} finished but is still running after run.teardown_grace_s; stopping it")
                    self.state, self.end_reason = run_end(self.stop_requested, self._summary)
                    self._write_status()
                    self._close_progress()
                    self.echo(finished_summary(self.run_dir, self._summary, time.time() - self.started_unix, self.state == "stopped"))
                    return EXIT_OK
            if now >= next_status:
                next_status = now + 1.0
                self._write_status()
                self._progress()
            if watchdog and now >= next_watchdog and self._beats_fresh(now):
                next_watchdog = now + watchdog / 2
                sdnotify.notify_watchdog()

    def _failed_child(self, router: zmq.Socket, stopping: bool = False) -> Child | None:
        """The child to blame once one exited unexpectedly or reported Dead, else None."""
        # A child that exited is checked before Dead reports: a peer's Dead ("connection closed
        # by peer" from gloo) is usually the consequence of that exit, not its cause.
        ch = liveness.exited_child(self.children, stopping)
        if ch is not None and ch.popen.returncode == 0:
            # A clean exit usually follows its Done by microseconds: read what is in flight
            # before calling the exit unexpected.
            self._drain_router(router, wait_ms=500)
            ch = liveness.exited_child(self.children, stopping)
        if ch is None and not any(c.dead_error and c.done is None for c in self.children):
            return None
        # root_cause reads the Dead reports in flight: the peer that failed first (its disk full,
        # or SIGKILLed) may still be closing while the peers it took down have reported already.
        return liveness.root_cause(self.children, stopping, drain=lambda wait_ms: self._drain_router(router, wait_ms))

    def _failed_child_text(self, router: zmq.Socket) -> str | None:
        culprit = self._failed_child(router)
        return liveness.failure_line(culprit) if culprit is not None else None

    def _drain_router(self, router: zmq.Socket, wait_ms: int = 0) -> None:
        if wait_ms and not router.poll(wait_ms):
            return
        members = {self._auth.route(name): name for name in (handshake.identity(c.role, c.rank) for c in self.children)}
        for parts in channels.recv_parts(router, 1000):
            got = handshake.accept_member(parts, members, self._auth, self.rejects)
            if got is not None:
                self._on_decoded(*got)

    def _beats_fresh(self, now: float) -> bool:
        return all(
            c.done is not None or (c.last_beat is not None and now - c.last_beat < self.cfg.run.heartbeat_timeout_s) for c in self.children
        )

    def _on_decoded(self, ident: bytes, msg: protocol.Message) -> None:
        by_ident = {handshake.identity(c.role, c.rank): c for c in self.children}
        ch = by_ident.get(ident)
        if ch is None:
            self.rejects.reject("unexpected_peer", f"{ident!r}")
            return
        if isinstance(msg, (Heartbeat, Done)) and (msg.role, msg.rank) != ch.key:
            self.rejects.reject("wrong_sender", f"{type(msg).__name__} for {msg.role}-{msg.rank} from {ch.name}")
        elif isinstance(msg, Heartbeat):
            ch.last_beat = time.monotonic()
            ch.loop_age_s = msg.loop_age_s
            ch.stats = msg.stats
        elif isinstance(msg, Done):
            ch.done = msg
            summary = msg.summary
            # the final step/loss: the last heartbeat may predate them
            ch.stats = summary.final if isinstance(summary, DrafterSummary) else summary
            ch.last_beat = time.monotonic()
            if isinstance(summary, DrafterSummary) and ch.rank == 0:
                self._summary = summary
        elif isinstance(msg, Dead):
            if ch.dead_error is None:  # the first report is the failure; anything after is its aftermath
                ch.dead_error = msg.error
                ch.dead_at = msg.failed_unix or time.time()
        else:
            self.rejects.reject("unexpected_type", f"{type(msg).__name__} from {ch.name}")

    # ------------------------------------------------------------------ teardown

    def _teardown(self, router: zmq.Socket) -> None:
        def send_shutdown(ch: Child) -> None:
            self._send(router, ch, Shutdown(reason="teardown"))

        teardown(self.children, send_shutdown, self.cfg.run.teardown_grace_s, self._handshake_done, self.echo)

    def _failure_text(self, what: str, ch: Child | None = None) -> str:
        return liveness.failure_text(what, self.children, self.run_dir / "logs", ch)

    # ------------------------------------------------------------------ status

    def _lead_drafter(self) -> DrafterStats | None:
        """Drafter 0's latest figures: the step, loss and throughput of the whole run."""
        d0 = next((c for c in self.children if c.role == "drafter" and c.rank == 0), None)
        return d0.stats if d0 is not None and isinstance(d0.stats, DrafterStats) else None

    def snapshot(self) -> StatusSnapshot:
        now_m = time.monotonic()
        now = time.time()
        procs = [liveness.process_status(ch, now, now_m) for ch in self.children]
        rss_total = psutil.Process().memory_info().rss + sum(p.rss_bytes or 0 for p in procs)
        lead = self._lead_drafter()
        step = lead.work.step if lead else 0
        max_steps = self.cfg.training.max_steps or None
        eta = eta_seconds(step, max_steps, lead.work.train_elapsed_s, lead.work.recent_step_s) if lead else None
        totals = Totals(
            tokens_per_s=lead.work.tokens_per_s if lead else 0.0,
            step=step,
            max_steps=max_steps,
            loss=lead.work.loss if lead else None,
            pipeline_rss_bytes=rss_total,
            eta_s=eta,
        )
        return StatusSnapshot(
            schema=SCHEMA_VERSION,
            run_dir=str(self.run_dir),
            state=self.state,
            updated_unix=now,
            supervisor_pid=os.getpid(),
            config=self.cfg.source,
            started_unix=min(self.started_unix, now),
            totals=totals,
            processes=procs,
            node=self.node_group.status(),
            supervisor_rejected_by_kind=dict(self.rejects.by_kind),
            end_reason=self.end_reason if self.state in ENDED_STATES else None,
            drafter_tau=self._summary.drafter_tau if self._summary is not None and self.state in ENDED_STATES else None,
        )

    def _write_status(self) -> None:
        self._last_snapshot = snap = self.snapshot()
        try:
            write_text_atomic(self.run_dir / "status.json", json.dumps(to_wire(snap)))
        except OSError as e:
            log.warning("could not write status.json: %s", e)

    def _progress(self) -> None:
        lead = self._lead_drafter()
        snap = progress_snapshot(lead, self.children, lead.work.end_step or self.cfg.training.max_steps or None) if lead else None
        if snap is not None and self._progress_display is not None:
            self._progress_display.update(snap)

    def _close_progress(self) -> None:
        if self._progress_display is not None:
            self._progress_display.close()
            self._progress_display = None
