"""How the supervisor starts a child, and the first thing that child runs.

``python -m dflash_ipc.runtime.launch ROLE --supervisor-pid P --key-fd N ...`` arms the
parent-death signal (:data:`IMPORT_DEATH_SIGNAL`: its handler removes the dead supervisor's socket
files; a stop signal meanwhile ends the import at once) and checks that its parent is still the supervisor that spawned it
*before* importing the role (torch and the model code take seconds to import; a supervisor
SIGKILLed meanwhile would otherwise leave the child running until its handshake timed out).
The role's ``run_<role>_process`` then parses the same argv and checks again once its SIGTERM
handler is installed (:func:`dflash_ipc.runtime.child.run_child`).
It also pins glibc's mmap threshold (:func:`pin_malloc_mmap_threshold`) before anything large is
allocated, so a child's RSS does not creep up over a run of days as its heap fragments.

With ``run.launcher`` "forkserver" the child is forked from :mod:`dflash_ipc.runtime.forkserver`
instead, with the same argv, and ``--supervisor-pid`` is the fork server's pid (the child's real
parent, itself killed by the supervisor's death): every check below then holds unchanged.

The run key (:class:`dflash_ipc.control.channels.PeerAuth`) reaches the child through an
inherited pipe (``--key-fd``): never in argv (world-readable in /proc), the environment, or a
file an orphan of an earlier attempt could read later.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_ipc.platform.third_party_logs import quiet_import_notes
from dflash_ipc.runtime import stop_signals

_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
#: Host allocations at least this large get pages of their own (mmap), handed back when freed.
MMAP_THRESHOLD_BYTES = 128 << 10


def set_parent_death_signal(sig: int) -> None:
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


# The sentinel's program: a bare interpreter (-S -I: a few MiB, not a copy of a child that has
# torch mapped), watching the supervisor through the pidfd the child hands it. A group's stop signals
# (runtime.stop_signals) are ignored: it lives as long as its child, which stops on them.
_SENTINEL = """
import ctypes, os, select, signal, sys, time
worker, pidfd, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(stop, signal.SIG_IGN)
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL, 0, 0, 0)
if os.getppid() != worker:
    sys.exit(0)
select.select([pidfd], [], [])
deadline = time.monotonic() + grace
while True:
    try:
        with open(f"/proc/{worker}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        sys.exit(0)
    if state in "Tt" or time.monotonic() >= deadline:
        os.kill(worker, signal.SIGKILL)
        sys.exit(0)
    time.sleep(0.05)
"""
#: After its supervisor died, a child still running this long (it was SIGTERMed by its death
#: signal, and checkpoints and leaves) is SIGKILLed by its sentinel; a stopped one at once.
ORPHAN_KILL_AFTER_S = 120.0


def start_death_sentinel(supervisor: int, grace_s: float = ORPHAN_KILL_AFTER_S) -> subprocess.Popen | None:
    """A small process that ends this one when ``supervisor`` dies, *also while this one is stopped*.

    The death signal (SIGTERM, so a running child leaves through its CLOSING path) stays pending
    in a SIGSTOPped process until SIGCONT: a stopped child of a SIGKILLed supervisor would wake up
    later in a directory a newer `up` owns (dflash_ipc.rundir.fence refuses its writes). The sentinel waits
    on the supervisor's pidfd; once it is gone it SIGKILLs this process at once if stopped, else
    after ``grace_s``. It dies with this process (its own death signal). None where unsupported
    (not Linux, no pidfd) or when the supervisor is already gone (the caller's check exits then)."""
    if sys.platform != "linux" or not supervisor or not hasattr(os, "pidfd_open") or os.environ.get("DFLASH_IPC_DEBUG_NO_SENTINEL"):
        return None
    try:
        pidfd = os.pidfd_open(supervisor)
    except OSError:
        return None
    try:
        if os.getppid() != supervisor:  # the pid may name another process already
            return None
        argv = [sys.executable, "-S", "-I", "-c", _SENTINEL, str(os.getpid()), str(pidfd), str(grace_s)]
        return subprocess.Popen(argv, pass_fds=(pidfd,), stdin=subprocess.DEVNULL)
    except OSError:
        return None
    finally:
        os.close(pidfd)


def pin_malloc_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes``; returns whether it was set (False off glibc).

    By default glibc raises the threshold to the size of every mmapped block freed (up to 32 MiB),
    so after the first steps a trainer's tensors of a few MiB are carved out of the heap instead,
    where blocks of shifting sizes fragment it and RSS creeps up for hundreds of steps (the soak's
    figures: docs/FAULTS.md). A fixed threshold turns that adjustment off: a large block is mapped when allocated and unmapped when freed.
    """
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def child_argv(role: str, supervisor_pid: int, key_fd: int) -> list[str]:
    """The command line of a child, up to its role's own options."""
    return [sys.executable, "-m", "dflash_ipc.runtime.launch", role, "--supervisor-pid", str(supervisor_pid), "--key-fd", str(key_fd)]


def child_env() -> dict[str, str]:
    """The environment every child of ``up`` shares (the fork server's too: what its preloads read
    at import is then the same as in a child started on its own)."""
    from dflash_ipc.ops.sdnotify import scrub_notify_env

    env = scrub_notify_env()
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def key_pipe(key: bytes) -> int:
    """A pipe holding ``key`` (then closed for writing); returns the read end, for ``pass_fds``.
    The caller closes it once the child is spawned."""
    r, w = os.pipe()
    try:
        os.write(w, key)
    finally:
        os.close(w)
    return r


def read_key(fd: int) -> bytes | None:
    """The run key from the inherited pipe (None when no fd was given: a child started by hand)."""
    if fd < 0:
        return None
    chunks = []
    with os.fdopen(fd, "rb", closefd=True) as f:
        while chunk := f.read(4096):
            chunks.append(chunk)
    return b"".join(chunks)


def _option(argv: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(argv[:-1]):
        if a == name:
            return argv[i + 1]
    return None


def supervisor_pid_from(argv: Sequence[str]) -> int:
    value = _option(argv, "--supervisor-pid")
    return int(value) if value else 0


def remove_supervisor_sockets(run_dir: Path) -> None:
    """The supervisor's socket files, once it was killed (SIGKILL leaves them): its children remove
    them as they go, so a dead run leaves no socket behind."""
    sock_dir = (run_dir / "sock").resolve()
    # control.json (control.plane.CONTROL_FILE, named here: this may run in a signal handler, so no import): tcp endpoints
    for path in (sock_dir / "sup", sock_dir / "status", run_dir / "control.json"):
        with contextlib.suppress(OSError):
            path.unlink()


#: The parent-death signal while a child imports its role. A signal of its own, not SIGTERM: the
#: child must tell its parent's death (clean up after it) from a live supervisor's SIGTERM (which
#: removes its own sockets as it leaves), and ``getppid()`` cannot tell at that moment, because the
#: kernel sends the death signal when the *thread* that spawned the child exits, and until the dying
#: supervisor's last thread is gone the parent still reads as the supervisor's pid.
IMPORT_DEATH_SIGNAL = signal.SIGUSR2


def _exit_with_supervisor(run_dir: str | None):
    """The death signal while importing: clean up after the supervisor; then die of SIGTERM."""

    def on_parent_death(signum, frame):  # noqa: ARG001
        if run_dir:
            remove_supervisor_sockets(Path(run_dir))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    return on_parent_death


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m dflash_ipc.runtime.launch ROLE [role options]", file=sys.stderr)
        return 2
    role, rest = argv[0], list(argv[1:])
    supervisor = supervisor_pid_from(rest)
    run_dir = _option(rest, "--run-dir")
    # Until the role installs its own handlers, a stop signal ends the import at once and the parent's
    # death ends it after removing what the parent left (a forked child inherits its server's handlers).
    stop_signals.end_at_once()
    signal.signal(IMPORT_DEATH_SIGNAL, _exit_with_supervisor(run_dir))
    set_parent_death_signal(IMPORT_DEATH_SIGNAL)
    start_death_sentinel(supervisor)  # the death signal waits out a SIGSTOP; the sentinel's SIGKILL does not
    pin_malloc_mmap_threshold()  # before torch and the role allocate anything
    if supervisor and os.getppid() != supervisor:
        print(f"{role}: supervisor (pid {supervisor}) is gone before this child started; exiting", file=sys.stderr)
        if run_dir:
            remove_supervisor_sockets(Path(run_dir))
        return 1
    # an exec'd child (run.launcher "exec": every GPU run) imports torchao with its model, as the fork server's
    # children do after the server dropped the same notes: the user reads this child's stderr too
    quiet_import_notes()
    module = importlib.import_module(f"dflash_ipc.procs.{role}")
    return getattr(module, f"run_{role}_process")(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
