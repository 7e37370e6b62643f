"""The child-process scaffold: what every process role of a run does around its own work.

:func:`run_child` parses ``--run-dir/--rank/--cpus`` (plus the role's own options), sets the
process title, logging to ``RUN_DIR/logs/<role>-<rank>.log``, faulthandler, the parent-death
signal and the stop signals (SIGTERM/SIGINT/SIGHUP), places the process on its device and CPU share, opens the
:class:`ChildSockets`, runs the role's ``main_fn(child)``, and always tears down in one order.
A role module in ``procs/`` is then a thin shell: ``run_<role>_process`` wires its core to this
scaffold, and ``if __name__ == "__main__"`` calls it.

Life of a child (drawn once here, used by every role)::

    parse argv ─▶ role's place(args): config, device ─▶ title, log file, faulthandler,
    PDEATHSIG=SIGTERM, SIGTERM/SIGINT/SIGHUP handlers ─▶ compile-worker cap ─▶ device + CPU share ─▶ ChildSockets
        │
        ▼
    RUNNING: main_fn(child) ── polls child.stop (child.read_control drains the DEALER); after its
        │    handshake a heartbeat thread beats on its own clock (start_heartbeats, runtime/heartbeat.py)
        │
        ├── Shutdown / SIGTERM / SIGINT / SIGHUP / parent died ─▶ STOPPING: stop.requested is set;
        │       main_fn finishes its step, checkpoints if it must, sends Done, returns ──▶ exit 0
        ├── main_fn returns on its own (work done)                                    ──▶ exit 0
        └── exception ──▶ log traceback, Dead(error) to the supervisor (best effort)  ──▶ exit 1
                 │
                 ▼  (every path)
    CLOSING: the role's resources, last opened first (child.closing: rings, core, process
             group) ─▶ ChildSockets (linger, so Done/Dead still leave) ─▶ log file ─▶ exit code

The supervisor spawns children through :mod:`dflash_ipc.runtime.launch`, which arms
``PR_SET_PDEATHSIG = SIGTERM`` before the role's imports, so a child never outlives a supervisor
killed with SIGKILL; SIGTERM only sets a flag that the role's main loop checks, so it always
leaves through CLOSING. The supervisor's pid comes in argv (``--supervisor-pid``): the child
compares its parent with it right after arming the signal, because ``getppid()`` read after
the parent died names the reaper, not the supervisor; a child whose supervisor is already gone
exits 1 at once. The run key comes through an inherited pipe (``--key-fd``) and seals every
frame the child sends (``channels.PeerAuth``). A failure before RUNNING (bad resolved config,
device missing) is printed to stderr (the child's ``.stdout`` log) and exits 1; the supervisor
then reports the exit code and the log tail.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import setproctitle

from dflash_ipc.rundir.fence import Fence, FencedOut
from dflash_ipc.rundir.fsutil import make_private_dir, open_append
from dflash_ipc.runtime import stop_signals
from dflash_ipc.runtime.heartbeat import HeartbeatSender
from dflash_ipc.runtime.launch import IMPORT_DEATH_SIGNAL, read_key, remove_supervisor_sockets, set_parent_death_signal


class StopFlag:
    """Set by a stop signal (SIGTERM/SIGINT/SIGHUP) or by a Shutdown message; polled by the main loop."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.requested:
            self.requested = True
            self.reason = reason


def _setup_process(role: str, rank: int, run_dir: Path, log_level: str, supervisor_pid: int = 0) -> tuple[logging.Logger, StopFlag, TextIO]:
    """Title, logging to RUN_DIR/logs/<role>-<rank>.log, faulthandler, signals; returns the open
    log file too, for the caller to close. ``supervisor_pid`` (0: unknown, the parent at entry)
    is the process whose death stops this one."""
    # the run dir in the title: `ps` tells which run a process belongs to (several runs on one host)
    setproctitle.setproctitle(f"dflash-ipc:{role}:{rank} {run_dir.resolve()}")
    parent = supervisor_pid or os.getppid()
    log_dir = run_dir / "logs"
    make_private_dir(log_dir, root=run_dir)
    # open for the process's life (closed in _close_process_logging); never through a link planted there
    log_file = open_append(log_dir / f"{role}-{rank}.log", root=run_dir, line_buffered=True)
    faulthandler.enable(file=log_file, all_threads=True)
    if os.environ.get("DFLASH_IPC_DEBUG_FAULTHANDLER_SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=log_file, all_threads=True)
    logger = logging.getLogger(f"dflash_ipc.{role}{rank}")
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(log_file)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {role}-{rank} %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(getattr(logging, log_level.upper()))
    stop = StopFlag()

    stop_signals.install(lambda name: stop.set(f"signal {name}"))
    # From here the parent's death is a SIGTERM like any other: the role leaves through CLOSING,
    # and its last step removes what a dead supervisor left (run_child).
    set_parent_death_signal(signal.SIGTERM)
    signal.signal(IMPORT_DEATH_SIGNAL, signal.SIG_DFL)
    if os.getppid() != parent:  # the supervisor died before the death signal was armed
        stop.set("parent died")
    return logger, stop, log_file


def _close_process_logging(log_file: TextIO) -> None:
    faulthandler.disable()
    if os.environ.get("DFLASH_IPC_DEBUG_FAULTHANDLER_SIGUSR1"):
        faulthandler.unregister(signal.SIGUSR1)
    logging.getLogger().handlers.clear()
    log_file.close()


def setup_child_process(role: str, rank: int, run_dir: Path, log_level: str = "info") -> tuple[logging.Logger, StopFlag]:
    """The set-up half of :func:`run_child`, for shells not yet on the scaffold (the bench
    producer/consumer); the log file stays open until the process exits."""
    logger, stop, _ = _setup_process(role, rank, run_dir, log_level)
    return logger, stop


def apply_cpu_share(cpus: str | None) -> int | None:
    """Pin this process (and what it spawns, e.g. compile workers) to its share of the cores;
    returns the number of cores, for torch's intra-op thread count."""
    if not cpus:
        return None
    cores = {int(c) for c in cpus.split(",") if c.strip()}
    os.sched_setaffinity(0, cores)
    return len(cores)


def cap_compile_workers(threads: int) -> None:
    """At most ``threads`` TorchInductor compile workers in this process (1: compile in-process, no
    worker pool); the environment variable carries the cap into any subprocess this one starts."""
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = threads


def use_deterministic_torch(device) -> None:
    """run.deterministic: torch's deterministic algorithms where it has them (a warning where it has
    none), before the first CUDA kernel: cuBLAS reads its workspace setting when it starts."""
    import torch

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def place_process(device_name: str, cpus: str | None, processes_on_host: int):
    """Bind this process to its device and its CPU share; returns the torch device."""
    import torch

    device = torch.device(device_name)
    n_cores = apply_cpu_share(cpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if n_cores:
            torch.set_num_threads(n_cores)
    else:
        # CPU runs share the host's cores among all processes of the run.
        torch.set_num_threads(n_cores or max(1, (os.cpu_count() or 1) // max(1, processes_on_host)))
    return device


class ChildSockets:
    """The sockets every child holds: a DEALER to the supervisor (identity role-rank), its own
    bound PULL for data-plane messages, and PUSH sockets to its peers. Closed explicitly.
    With the run key, every frame sent is sealed, and the PULL accepts only frames sealed by
    the peers given to :meth:`connect_peers` (``auth``).

    ``control`` (default: ipc in ``run_dir``): over tcp the PULL binds an ephemeral port on the
    control host (``pull_endpoint`` then names only the ipc address it would have had; the bound
    one is ``self.pull_endpoint``), every socket speaks CURVE, and refused handshakes on the PULL
    are counted in ``rejects`` (:mod:`dflash_ipc.control.plane`)."""

    def __init__(
        self,
        run_dir: Path,
        role: str,
        rank: int,
        pull_endpoint: str,
        key: bytes | None = None,
        *,
        control=None,
        supervisor_endpoint: str = "",
        rejects=None,
    ):
        import zmq

        from dflash_ipc.control import channels, handshake
        from dflash_ipc.control.plane import ControlPlane, ControlSpec
        from dflash_ipc.control.protocol import RejectCounter

        self.role, self.rank = role, rank
        self.auth = channels.PeerAuth(key, handshake.identity(role, rank), peers=set())
        self.plane = ControlPlane(control or ControlSpec(run_dir), rejects or RejectCounter(f"{role}-{rank}"))
        self.ctx = self.plane.ctx
        sup = supervisor_endpoint or channels.supervisor_endpoint(run_dir)
        self.dealer = self.plane.connect(zmq.DEALER, sup, self.auth.route(self.auth.me))
        try:
            self.pull, self.pull_endpoint = self.plane.bind(zmq.PULL, pull_endpoint)
        except BaseException:
            self.dealer.close()
            self.plane.close()
            raise
        self.pushes: list = []
        # The DEALER is shared with the heartbeat thread: every use of it holds this lock.
        self.dealer_lock = threading.Lock()

    def connect_peers(self, endpoints: list[str], peer_role: str) -> list:
        """PUSH sockets to peers 0..n-1 of ``peer_role``; from now on the PULL accepts their frames."""
        import zmq

        from dflash_ipc.control import handshake

        self.pushes = [self.plane.connect(zmq.PUSH, ep) for ep in endpoints]
        self.auth.peers = {handshake.identity(peer_role, i) for i in range(len(endpoints))}
        return self.pushes

    def send_to_peer(self, peer: int, msg) -> None:
        from dflash_ipc.control import channels

        channels.send(self.pushes[peer], msg, self.auth)

    def send_to_supervisor(self, msg, flags: int = 0) -> None:
        from dflash_ipc.control import channels

        with self.dealer_lock:
            channels.send(self.dealer, msg, self.auth, flags)

    def drain_peers(self, rejects) -> list[tuple[int | None, Any]]:
        """Data-plane messages waiting on the PULL, each with its sender's rank (None without a
        key: the sender is not known); anything else is rejected and counted."""
        from dflash_ipc.control import channels

        self.plane.count_refusals()
        out = []
        for sender, msg in channels.drain_from(self.pull, self.auth, rejects):
            out.append((None if sender is None else int(sender.rsplit(b"-", 1)[1]), msg))
        return out

    def report_dead(self, exc: BaseException, log: logging.Logger) -> None:
        """Log the traceback and tell the supervisor (best effort: it may be gone)."""
        import traceback

        import zmq

        from dflash_ipc.control.protocol import Dead

        failed_unix = time.time()
        log.error("%s-%d failed: %s", self.role, self.rank, traceback.format_exc())
        cause = type(exc).__name__
        try:
            self.send_to_supervisor(Dead(role=self.role, rank=self.rank, error=f"{cause}: {exc}", cause=cause, failed_unix=failed_unix))
        except zmq.ZMQError:
            pass

    def read_control(self, rejects, stop: StopFlag, parent_pid: int, wait_ms: int = 0) -> None:
        """Apply what the supervisor said (Shutdown -> stop) and notice a dead supervisor;
        ``wait_ms`` > 0 waits that long for a message first."""
        from dflash_ipc.control import channels
        from dflash_ipc.control.protocol import Shutdown

        with self.dealer_lock:
            if wait_ms:
                self.dealer.poll(wait_ms)
            msgs = channels.drain(self.dealer, rejects)
        for msg in msgs:
            if isinstance(msg, Shutdown):
                stop.set(f"shutdown: {msg.reason}")
        if os.getppid() != parent_pid:
            stop.set("supervisor died")

    def poller(self):
        import zmq

        p = zmq.Poller()
        p.register(self.pull, zmq.POLLIN)
        p.register(self.dealer, zmq.POLLIN)
        return p

    def wait(self, poller, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for a peer's or the supervisor's message (``poller()``)."""
        with self.dealer_lock:
            poller.poll(timeout_ms)

    def close(self, linger_ms: int = 1000) -> None:
        for s in self.pushes:
            s.close()
        self.pull.close()
        self.dealer.close(linger=linger_ms)
        self.plane.close()


@dataclass(frozen=True)
class Placement:
    """Where a child runs, decided by its role from its arguments (usually from its config)."""

    device: str  # "cpu" or "cuda:N"
    processes_on_host: int  # CPU runs split the host's cores among this many processes
    log_level: str = "info"
    config: Any = None  # what the role loaded to decide this (its DFlashConfig); handed to main_fn
    compile_threads: int = 1  # TorchInductor compile workers (run.compile_threads)


@dataclass
class ChildContext:
    """What :func:`run_child` hands the role's ``main_fn``: everything already set up."""

    role: str
    rank: int
    run_dir: Path
    args: argparse.Namespace
    config: Any
    log: logging.Logger
    stop: StopFlag
    parent_pid: int
    device: Any  # torch.device
    socks: ChildSockets
    rejects: Any  # protocol.RejectCounter
    # Every write to the run directory goes through fence.guard: refused once a newer `up` owns it.
    fence: Fence = field(default_factory=Fence.none)
    # The role's resources, closed last-registered first after main_fn returns or raises.
    closing: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    heartbeats: HeartbeatSender | None = None
    _poller: Any = field(default=None, repr=False)
    _proc: Any = field(default=None, repr=False)

    # -- what a role's loop needs (control.loop_io.LoopIO)
    def read_control(self, wait_ms: int = 0) -> None:
        """Apply the supervisor's Shutdown and notice a dead supervisor (sets ``stop``)."""
        self.socks.read_control(self.rejects, self.stop, self.parent_pid, wait_ms)

    def drain_peers(self) -> list:
        return self.socks.drain_peers(self.rejects)

    def wait(self, timeout_ms: int) -> None:
        if self._poller is None:
            self._poller = self.socks.poller()
        self.socks.wait(self._poller, timeout_ms)

    def start_heartbeats(self, interval_s: float) -> None:
        """Heartbeats from a thread of their own from now on (after the handshake), until Done."""
        import zmq

        self.heartbeats = HeartbeatSender(lambda beat: self.socks.send_to_supervisor(beat, zmq.NOBLOCK), interval_s)
        self.closing.callback(self.heartbeats.close)
        self.heartbeats.start()

    def report(self, beat) -> None:
        if self.heartbeats is not None:
            self.heartbeats.report(beat)

    def progressed(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.progressed()

    def send_to_supervisor(self, msg) -> None:
        """Done: the heartbeats stop first, so no beat follows the final report."""
        if self.heartbeats is not None:
            self.heartbeats.close()
        self.socks.send_to_supervisor(msg)

    def vitals(self, state: str, uptime_s: float):
        import psutil

        from dflash_ipc.control.stats import Vitals

        if self._proc is None:
            self._proc = psutil.Process()
        return Vitals.measure(state, uptime_s, self._proc, self.rejects)


def placement_from_config(role: str, args: argparse.Namespace) -> Placement:
    """A target's or drafter's placement: its device of the run's resolved config (RUN_DIR/config.resolved.toml)."""
    from dflash_ipc.config import load_resolved_config

    cfg = load_resolved_config(Path(args.run_dir))
    devices = cfg.topology.targets if role == "target" else cfg.topology.drafters
    on_host = len(cfg.topology.targets) + len(cfg.topology.drafters)
    return Placement(devices[args.rank], on_host, cfg.run.log_level, cfg, compile_threads=cfg.run.compile_threads)


def child_arg_parser(role: str, description: str = "") -> argparse.ArgumentParser:
    """The options every child takes; a role adds its own through ``add_arguments``."""
    ap = argparse.ArgumentParser(prog=f"dflash_ipc.procs.{role}", description=description or f"dflash-ipc {role} process")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--cpus", default=None, help="comma-separated CPU cores of this process (set by the supervisor)")
    ap.add_argument("--supervisor-pid", type=int, default=0, help="the supervisor that spawned this process (set by the supervisor)")
    ap.add_argument("--key-fd", type=int, default=-1, help="inherited pipe holding the run key (set by the supervisor)")
    ap.add_argument("--generation", default="", help="FILE:N:TOKEN: the run dir generation it writes under (set by the supervisor)")
    ap.add_argument("--supervisor-endpoint", default="", help="tcp://HOST:PORT of the supervisor (run.control = tcp)")
    ap.add_argument("--control-keys", default="", help="directory holding keys/, the run's CURVE keys (run.control = tcp)")
    return ap


def _control_spec(run_dir: Path, args: argparse.Namespace):
    """ipc in the run directory, unless the supervisor gave a tcp endpoint (and the keys' directory)."""
    from dflash_ipc.control.plane import ControlSpec, host_of

    endpoint = args.supervisor_endpoint
    if not endpoint.startswith("tcp://"):
        return ControlSpec(run_dir)
    if not args.control_keys:
        raise ValueError(f"--supervisor-endpoint {endpoint} needs --control-keys (the directory holding the run's CURVE keys)")
    return ControlSpec(run_dir, host_of(endpoint), Path(args.control_keys))


def run_child(
    role: str,
    main_fn: Callable[[ChildContext], int | None],
    *,
    place: Callable[[argparse.Namespace], Placement] | None = None,
    pull_endpoint: Callable[[Path, int], str],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: Sequence[str] | None = None,
    description: str = "",
    socket_linger_ms: int = 1000,
) -> int:
    """Run one child process of role ``role`` around ``main_fn``; returns the exit code.

    ``place(args)`` (default: :func:`placement_from_config`, the run's resolved config) loads
    what the role needs to know where it runs (before logging exists, so a bad run directory
    fails loudly on stderr); ``pull_endpoint(run_dir, rank)`` is the address
    of the child's own PULL socket. ``main_fn`` returns 0/None for a clean exit; an exception is
    logged and reported to the supervisor as Dead, and the exit code is 1."""
    from dflash_ipc.control.protocol import RejectCounter

    parser = child_arg_parser(role, description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    key = read_key(args.key_fd)
    run_dir = Path(args.run_dir)
    fence = Fence.of_argv(run_dir, args.generation)
    placement = place(args) if place is not None else placement_from_config(role, args)
    log, stop, log_file = _setup_process(role, args.rank, run_dir, placement.log_level, args.supervisor_pid)
    parent_pid = args.supervisor_pid or os.getppid()
    socks: ChildSockets | None = None
    failed_in_main = False
    if stop.requested:  # the supervisor died while this process started: nothing to report to
        log.error("%s-%d: supervisor (pid %d) is gone; exiting", role, args.rank, parent_pid)
        _remove_dead_supervisor_sockets(run_dir, fence, log)
        _close_process_logging(log_file)
        return 1
    try:
        cap_compile_workers(placement.compile_threads)  # before anything compiles
        device = place_process(placement.device, args.cpus, placement.processes_on_host)
        if getattr(getattr(placement.config, "run", None), "deterministic", False):
            use_deterministic_torch(device)
        log.info("TorchInductor compile workers capped at %d", placement.compile_threads)
        rejects = RejectCounter(f"{role}-{args.rank}", log)
        socks = ChildSockets(
            run_dir,
            role,
            args.rank,
            pull_endpoint(run_dir, args.rank),
            key,
            control=_control_spec(run_dir, args),
            supervisor_endpoint=args.supervisor_endpoint,
            rejects=rejects,
        )
        if socks.plane.spec.is_tcp:
            log.info("control plane over tcp (CURVE): supervisor %s, this process's PULL %s", args.supervisor_endpoint, socks.pull_endpoint)
        child = ChildContext(
            role=role,
            rank=args.rank,
            run_dir=run_dir,
            args=args,
            config=placement.config,
            log=log,
            stop=stop,
            parent_pid=parent_pid,
            device=device,
            socks=socks,
            rejects=rejects,
            fence=fence,
        )
        with child.closing:
            try:
                code = main_fn(child)
            except Exception as e:  # noqa: BLE001 (whatever the role raises, the supervisor must hear of it)
                # Dead leaves before the resources close: closing a ring can take long, and the
                # supervisor should start its teardown from the first cause.
                failed_in_main = True
                socks.report_dead(e, log)
                return 1
        return 0 if code is None else int(code)
    except Exception as e:
        if failed_in_main:
            log.exception("%s-%d: closing after the failure failed too", role, args.rank)
        elif socks is not None:
            socks.report_dead(e, log)
        else:
            log.exception("%s-%d could not start", role, args.rank)
        return 1
    finally:
        if socks is not None:
            socks.close(linger_ms=socket_linger_ms)
        if os.getppid() != parent_pid:
            # The supervisor was killed (SIGKILL leaves its socket files): the last of its children
            # to leave removes them, so a dead run leaves no socket behind.
            _remove_dead_supervisor_sockets(run_dir, fence, log)
        _close_process_logging(log_file)


def _remove_dead_supervisor_sockets(run_dir: Path, fence: Fence, log: logging.Logger) -> None:
    """The dead supervisor's socket files, unless a newer `up` owns the directory (they are its own then)."""
    try:
        with fence.guard("removing the dead supervisor's socket files"):
            remove_supervisor_sockets(run_dir)
    except FencedOut as e:
        log.warning("%s", e)
