"""What every child process of a run does first: title, logging, faulthandler, parent watch.

Shutdown of a child (drawn once here, used by every role)::

    RUNNING ──Shutdown msg / SIGTERM / parent died──▶ STOPPING ──close rings, sockets──▶ exit 0
       │
       └── exception ──▶ send Dead(error) to the supervisor ──▶ close what is open ──▶ exit 1

The supervisor spawns children with ``PR_SET_PDEATHSIG = SIGTERM`` so a child never
outlives a supervisor killed with SIGKILL; SIGTERM only sets a flag that the role's main loop
checks, so it always leaves through its own cleanup.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import setproctitle


class StopFlag:
    """Set by SIGTERM/SIGINT or by a Shutdown message; polled by the main loop."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.requested:
            self.requested = True
            self.reason = reason


def _set_parent_death_signal(sig: int) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def setup_child_process(role: str, rank: int, run_dir: Path, log_level: str = "info") -> tuple[logging.Logger, StopFlag]:
    """Title, logging to RUN_DIR/logs/<role>-<rank>.log (+stderr), faulthandler, signals."""
    setproctitle.setproctitle(f"dflash-ipc:{role}:{rank}")
    _set_parent_death_signal(signal.SIGTERM)
    parent = os.getppid()
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{role}-{rank}.log"
    fault_file = open(log_path, "a", buffering=1)
    faulthandler.enable(file=fault_file, all_threads=True)
    if os.environ.get("DFLASH_IPC_DEBUG_FAULTHANDLER_SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=fault_file, all_threads=True)
    logger = logging.getLogger(f"dflash_ipc.{role}{rank}")
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(fault_file)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {role}-{rank} %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(getattr(logging, log_level.upper()))
    stop = StopFlag()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if os.getppid() != parent:  # parent died before the death signal was armed
        stop.set("parent died")
    return logger, stop


def apply_cpu_share(cpus: str | None) -> int | None:
    """Pin this process (and what it spawns, e.g. compile workers) to its share of the cores;
    returns the number of cores, for torch's intra-op thread count."""
    if not cpus:
        return None
    cores = {int(c) for c in cpus.split(",") if c.strip()}
    os.sched_setaffinity(0, cores)
    return len(cores)


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
    bound PULL for data-plane messages, and PUSH sockets to its peers. Closed explicitly."""

    def __init__(self, run_dir: Path, role: str, rank: int, pull_endpoint: str):
        import zmq

        from dflash_ipc.control import channels
        from dflash_ipc.control import handshake

        self.role, self.rank = role, rank
        self.ctx = zmq.Context()
        self.dealer = channels.connect(self.ctx, zmq.DEALER, channels.supervisor_endpoint(run_dir), handshake.identity(role, rank))
        self.pull_endpoint = pull_endpoint
        self.pull = channels.bind(self.ctx, zmq.PULL, pull_endpoint)
        self.pushes: list = []

    def connect_peers(self, endpoints: list[str]) -> list:
        import zmq

        from dflash_ipc.control import channels

        self.pushes = [channels.connect(self.ctx, zmq.PUSH, ep) for ep in endpoints]
        return self.pushes

    def send_to_peer(self, peer: int, msg) -> None:
        from dflash_ipc.control import channels

        channels.send(self.pushes[peer], msg)

    def send_to_supervisor(self, msg) -> None:
        from dflash_ipc.control import protocol

        self.dealer.send(protocol.encode(msg))

    def report_dead(self, exc: BaseException, log: logging.Logger) -> None:
        """Log the traceback and tell the supervisor (best effort: it may be gone)."""
        import traceback

        import zmq

        from dflash_ipc.control.protocol import Dead

        log.error("%s-%d failed: %s", self.role, self.rank, traceback.format_exc())
        try:
            self.send_to_supervisor(Dead(role=self.role, rank=self.rank, error=f"{type(exc).__name__}: {exc}"))
        except zmq.ZMQError:
            pass

    def read_control(self, rejects, stop: StopFlag, parent_pid: int, wait_ms: int = 0) -> None:
        """Apply what the supervisor said (Shutdown -> stop) and notice a dead supervisor;
        ``wait_ms`` > 0 waits that long for a message first."""
        from dflash_ipc.control import channels
        from dflash_ipc.control.protocol import Shutdown

        if wait_ms:
            self.dealer.poll(wait_ms)
        for msg in channels.drain(self.dealer, rejects):
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

    def close(self, linger_ms: int = 1000) -> None:
        for s in self.pushes:
            s.close()
        self.pull.close()
        self.dealer.close(linger=linger_ms)
        self.ctx.term()
