"""``[run]``: the run's name and directory, its seed, liveness timeouts, logging and how processes start."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from dflash_ipc.config.fields import MAX_SEED, require

__all__ = ["MAX_TIMEOUT_S", "RunConfig", "tensorboard_installed", "valid_host", "zmq_has_curve"]

# Longest accepted timeout: a week. Longer ones are typos that would hang a run, and ZeroMQ
# poll timeouts in milliseconds must fit an int.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Shortest heartbeat interval: each beat is a sealed message a thread of every child sends (holding the GIL the
# training loop needs) and the supervisor decodes; liveness is judged in seconds, so faster beats only cost CPU.
MIN_HEARTBEAT_INTERVAL_S = 0.05


def valid_host(host: str) -> bool:
    """An IP address that is not a wildcard, or a syntactically valid host name."""
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host) is not None


def zmq_has_curve() -> bool:
    import zmq

    return bool(zmq.has("curve"))


def tensorboard_installed() -> bool:
    # Imported, not just found: torch.utils.tensorboard needs a tensorboard that imports.
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class RunConfig:
    name: str = "dflash"
    """The run's name: one path component, since the default run directory is ``runs/<name>``."""
    run_dir: str = ""
    """Run directory (checkpoints, logs, sockets, export); empty: ``runs/<name>`` under the working directory.
    ``up --run-dir`` overrides it."""
    seed: int = 0
    """Seeds the batch order, the drafter's initial weights and its noise; ``--resume`` refuses a changed seed
    (the ledger names batches in this order). 0 .. 2**32 - 1."""
    deterministic: bool = False
    """false: each batch goes to the least-busy drafter, so which rank trains which batch (with that rank's anchor
    sampling) follows the timing, and two runs of one seed differ from step 1. true: batches are dealt round-robin in
    plan order (control/router.py, deal_by_plan), each drafter trains its own in that order, credits still bound every
    queue, and torch uses its deterministic algorithms where it has them (warning where not; on CUDA with
    CUBLAS_WORKSPACE_CONFIG=:4096:8): one seed repeats its per-step losses bit for bit. Cost: a drafter waits for its
    own next batch instead of taking any that is ready, and a target sends first-in first-out (docs/BENCHMARKS.md
    measures it). Still not repeated: a run stopped and resumed (deterministic from its checkpoint, but
    not the uninterrupted run's steps), training.max_seconds (the clock picks the last step), when held-out tau is
    measured, another machine, thread count, device or library build."""
    handshake_timeout_s: float = 120.0
    """Seconds every process has to load its model and report ready before the group is torn down."""
    heartbeat_interval_s: float = 1.0
    """Seconds between two heartbeats of a child (sent from a thread of their own)."""
    heartbeat_timeout_s: float = 60.0
    """A child silent this long is declared dead and the group torn down; at least 3x ``heartbeat_interval_s``."""
    stall_timeout_s: float = 0.0
    """A child still beating whose loop has not moved this long is torn down as stalled; 0: 10x ``heartbeat_timeout_s``."""
    teardown_grace_s: float = 15.0
    """Seconds between asking the children to stop (Shutdown, then SIGTERM) and SIGKILL."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Level of every process's log (``RUN_DIR/logs/<role>.log``)."""
    cpu_affinity: Literal["auto", "off"] = "auto"
    """"auto": on GPU hosts each process gets its own share of the CPU cores, so one process's compile workers or
    data loading cannot starve another's kernel launches. "off": inherit the supervisor's."""
    tensorboard: bool = False
    """TensorBoard events beside metrics.jsonl (drafter 0): loss, acc, tau, tau_holdout, ...;
    needs ``pip install "dflash-ipc[tensorboard]"``."""
    metrics_port: int = 0
    """Serve the live status as Prometheus metrics on ``http://127.0.0.1:PORT/metrics`` (loopback only: scrape through
    an SSH tunnel or a local Prometheus). 0: no endpoint."""
    compile_threads: int = 1
    """TorchInductor compile workers per process (1..64). Above 1 every process starts a pool of workers, each a
    Python importing torch and triton; 1 compiles in the process: slower only for the first compile."""
    control: Literal["ipc", "tcp"] = "ipc"
    """Control plane: "ipc" (Unix sockets in the 0700 run directory) or "tcp" (ZeroMQ over TCP on ``control_host``,
    every peer authenticated with the run's CURVE keys; only with ``transport.backend = "nccl"``, where a target and
    its drafters may be on different hosts)."""
    control_host: str = "127.0.0.1"
    """Address of this host the tcp control sockets (and a target's nccl rendezvous) listen on; never a wildcard."""
    launcher: Literal["auto", "exec", "forkserver"] = "auto"
    """How ``up`` starts the probe and its processes: "exec" a new Python each; "forkserver" forked from one server
    that imported torch once; "auto": forkserver when every device is the CPU, exec with any CUDA device."""

    def __post_init__(self) -> None:
        require(
            bool(self.name) and self.name not in (".", "..") and not any(c in self.name for c in "/\\") and self.name.isprintable(),
            "name",
            f"must be a plain name without '/' or control characters, not '.' or '..' (got {self.name!r}): the run directory "
            "is runs/<name>, and the name goes into titles and log lines",
        )
        require(0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, 2**32 - 1] (got {self.seed})")
        launchers = ("auto", "exec", "forkserver")
        require(self.launcher in launchers, "launcher", f"must be one of {', '.join(map(repr, launchers))} (got {self.launcher!r})")
        require(
            not self.tensorboard or tensorboard_installed(),
            "tensorboard",
            'is true but the tensorboard package is not installed; pip install "dflash-ipc[tensorboard]" or set it to false',
        )
        require(1 <= self.compile_threads <= 64, "compile_threads", f"must be between 1 and 64 (got {self.compile_threads})")
        self._check_timeouts()
        require(0 <= self.metrics_port <= 65535, "metrics_port", "must be a TCP port in 1..65535, or 0 for no /metrics endpoint")
        require(
            valid_host(self.control_host),
            "control_host",
            f"must be one address or host name of this host, e.g. 127.0.0.1 or 10.0.0.5 (got {self.control_host!r}); "
            "a wildcard would listen on every interface",
        )
        require(
            self.control != "tcp" or zmq_has_curve(),
            "control",
            'is "tcp" but this pyzmq/libzmq has no CURVE support, so peers could not be authenticated; use "ipc"',
        )

    def _check_timeouts(self) -> None:
        for key in ("handshake_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            value = getattr(self, key)
            require(0 < value <= MAX_TIMEOUT_S, key, f"must be > 0 and <= {MAX_TIMEOUT_S:g} seconds (7 days; got {value:g})")
        require(
            self.heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S,
            "heartbeat_interval_s",
            f"must be at least {MIN_HEARTBEAT_INTERVAL_S:g} s (got {self.heartbeat_interval_s:g}): each beat is a sealed message "
            "the supervisor reads, and liveness is judged in seconds",
        )
        require(
            self.heartbeat_timeout_s >= 3 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            f"must be at least 3x run.heartbeat_interval_s ({3 * self.heartbeat_interval_s:g} s); raise it",
        )
        ok = self.stall_timeout_s == 0 or self.heartbeat_timeout_s <= self.stall_timeout_s <= MAX_TIMEOUT_S
        require(ok, "stall_timeout_s", "must be 0 (10x heartbeat_timeout_s) or between heartbeat_timeout_s and 7 days")
        require(
            0 <= self.teardown_grace_s <= MAX_TIMEOUT_S,
            "teardown_grace_s",
            f"must be >= 0 and <= {MAX_TIMEOUT_S:g} seconds (got {self.teardown_grace_s:g})",
        )
