"""One `dflash-ipc up` per run directory: an exclusive ``flock`` held by the supervisor for its life.

Two supervisors in one directory sweep each other's live shared memory, reset each other's
``metrics.jsonl`` and overwrite each other's checkpoints. So the supervisor takes the directory's
lock before it touches, sweeps or spawns anything there, and keeps it across every attempt of
``--max-restarts``; the kernel releases it when the supervisor dies, however it dies, so a lock file
left by a SIGKILLed supervisor never blocks the next start (no stale-pid guessing). The lock's open
file description is close-on-exec: children and the probe never hold it (a stopped orphan cannot
keep a directory locked). The file also records the owner (pid, host, start time), read only to
word a refusal. A file can be deleted while it is locked, and a lock taken on its replacement
would exclude nobody: so the directory itself is flocked first (an fd opened with O_DIRECTORY),
and a deleted ``lock`` file admits no second run. Once locked, the supervisor takes the directory's
next *generation* (:mod:`dflash_ipc.rundir.fence`), which fences out every write of the processes
of earlier runs::

    up: validate the config (reads only; an owned directory is refused here already: refuse_if_owned)
      ─▶ RunDirLock.take (Supervisor.dir_lock): flock RUN_DIR itself (O_DIRECTORY), then open
           RUN_DIR/lock (0600, O_CREAT), flock LOCK_EX|LOCK_NB; each checked to be what the path names now
           held (retried for ACQUIRE_WAIT_S) ─▶ RunDirBusy "RUN_DIR is in use by ... pid P on H", exit 2
           taken ─▶ write the owner record ─▶ fence.advance: RUN_DIR/generation N+1 (children get it in argv)
           ─▶ status "preparing", probe, sweep, spawn, restarts ... (held throughout)
      ─▶ exit or death: the kernel drops the lock (the file stays, unlocked)
      a start refused after it (the probe refused the config): release(remove_created=True, written=...)
      removes the directory again if the lock created it and nothing else was written there

Several nodes (``runtime.nodes``) keep working when they share a directory (a run dir on shared
storage, or one ``--shared-dir``): a node holds ``lock`` *shared* and ``lock.node-<rank>``
exclusively, so nodes of one run do not exclude each other, two supervisors of the same node rank
do, and so do a single-node run and a run of several nodes. The same locks are taken in the
shared directory (``--shared-dir``) when it is not the run dir: two runs that would write their
checkpoints there are refused too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_ipc.rundir import bounded_json, fence

if TYPE_CHECKING:
    from dflash_ipc.runtime.nodes import NodeSpec

LOCK_FILE = "lock"
ACQUIRE_WAIT_S = 1.0  # a concurrent refuse_if_owned holds `lock` shared for microseconds
_RETRY_S = 0.05


class RunDirBusy(RuntimeError):
    """Another supervisor owns the directory; the message names it and how to stop it."""


@dataclass(frozen=True)
class LockSpec:
    """Which node of how many takes the locks (a single node: ``lock`` exclusively)."""

    nnodes: int = 1
    node_rank: int = 0

    def files(self) -> list[tuple[str, bool]]:
        """(file name, exclusive) in the order taken; the exclusive one holds the owner record."""
        if self.nnodes <= 1:
            return [(LOCK_FILE, True)]
        return [(LOCK_FILE, False), (f"{LOCK_FILE}.node-{self.node_rank}", True)]


def _owner_record(spec: LockSpec) -> bytes:
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time()}
    owner |= {"node_rank": spec.node_rank, "nnodes": spec.nnodes}
    return (json.dumps(owner) + "\n").encode()


def _read_owner(path: Path) -> dict:
    try:
        owner = bounded_json.read(path)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _held(path: Path, flags: int = os.O_NOFOLLOW) -> bool:
    """Whether some process holds ``path`` exclusively (a shared probe, released at once); ``flags``
    open it (``os.O_DIRECTORY`` for a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the shared lock
    return False


def busy_text(directory: Path, what: Path) -> str:
    """The refusal: who owns ``directory`` (the live owner records under it) and how to stop it."""
    # `what` held shared (by the nodes of a run of several): its record is an old owner's; the nodes' count
    held = [what] if _held(what) else [p for p in sorted(directory.glob(f"{LOCK_FILE}.node-*")) if _held(p)]
    owners = [_read_owner(p) for p in held]
    if not any(isinstance(o.get("pid"), int) for o in owners):  # the lock file deleted: the generation names the owner
        owners = [fence.read_owner(p) for p in sorted(directory.glob(f"{fence.GENERATION_FILE}*"))]
    here = socket.gethostname()
    lines = []
    pids = []
    for owner in owners:
        pid = owner.get("pid")
        if not isinstance(pid, int):
            continue
        host = str(owner.get("host", "?"))
        since = owner.get("started_unix")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else ""
        node = f", node {owner.get('node_rank')}/{owner.get('nnodes')}" if (owner.get("nnodes") or 1) > 1 else ""
        lines.append(f"pid {pid} on host {host}{node}{when}")
        pids.append(f"kill -TERM {pid}" + ("" if host == here else f" (on {host})"))
    who = "; ".join(lines) if lines else "a supervisor that is still starting (its pid is not written yet)"
    stop = f"stop it with `{pids[0]}` (it checkpoints and exits; under systemd: `systemctl stop` its unit)" if pids else "stop it"
    return (
        f"{directory} is in use by another `dflash-ipc up` ({who}); one run per directory. "
        f"See it with `dflash-ipc status --run-dir {directory}`, {stop}, or use another --run-dir"
    )


def refuse_if_owned(directory: Path) -> None:
    """RunDirBusy if a single-node supervisor owns ``directory`` (read-only: takes nothing).

    A check for ``up`` to make before its other run-dir checks, so that "in use by pid P" comes
    before, say, "already holds checkpoints": :meth:`RunDirLock.acquire` still decides."""
    path = directory / LOCK_FILE
    if _held(path) or _dir_held(directory):
        raise RunDirBusy(busy_text(directory, path))


def _dir_held(directory: Path) -> bool:
    """Whether a single-node supervisor holds the directory itself (its lock file may be deleted)."""
    return _held(directory, os.O_DIRECTORY)


def _lock_dir(directory: Path, exclusive: bool, wait_s: float) -> int:
    """An fd of ``directory`` itself holding its flock: deleting the lock file cannot undo it."""
    deadline = time.monotonic() + wait_s
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    while True:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise RunDirBusy(busy_text(directory, directory / LOCK_FILE)) from None
            time.sleep(_RETRY_S)
            continue
        except OSError:
            os.close(fd)
            raise
        try:
            st, fst = os.stat(directory), os.fstat(fd)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            return fd
        os.close(fd)  # the directory was replaced meanwhile: lock the one the path names now


def _lock_one(path: Path, exclusive: bool, wait_s: float) -> int:
    """An fd holding ``path``'s flock; RunDirBusy when another process holds it for ``wait_s``."""
    deadline = time.monotonic() + wait_s
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:  # a refused run removed the directory it had made: make it again
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise RunDirBusy(busy_text(path.parent, path)) from None
            time.sleep(_RETRY_S)
            continue
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                why = f"cannot lock {path} ({e.strerror}): put the run directory on a filesystem with flock support"
                raise OSError(e.errno, why) from None
            raise
        # A refused run removes the lock file it created (release): a lock taken on that unlinked
        # file would exclude nobody. Only a lock on the file the path names now counts.
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        fst = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            return fd
        os.close(fd)


class RunDirLock:
    """The locks a supervisor holds on its run dir (and shared dir); see the module docstring.
    Made unlocked; :meth:`take` locks (idempotent), :meth:`release` unlocks (idempotent)."""

    def __init__(self, directories: list[Path], spec: LockSpec | None = None) -> None:
        self.directories = list(dict.fromkeys(Path(d).absolute() for d in directories))
        self.spec = spec or LockSpec()
        self._fds: list[int] = []
        self._files: list[Path] = []
        self._created: list[Path] = []  # directories this lock made (removed again by release(remove_created=True))
        self.generation: fence.Generation | None = None  # this run's, taken with the locks

    @classmethod
    def acquire(cls, directories: list[Path], spec: LockSpec | None = None, wait_s: float = ACQUIRE_WAIT_S) -> RunDirLock:
        lock = cls(directories, spec)
        lock.take(wait_s)
        return lock

    def take(self, wait_s: float = ACQUIRE_WAIT_S) -> None:
        """Every directory's locks (each directory created 0700 if missing), or RunDirBusy naming the owner."""
        if self.held:
            return
        try:
            for directory in self.directories:
                self._take(directory, wait_s)
            self.generation = fence.advance(self.generation_path, {"node_rank": self.spec.node_rank, "nnodes": self.spec.nnodes})
        except BaseException:
            self.release(remove_created=True)
            raise

    def _take(self, directory: Path, wait_s: float) -> None:
        missing = [p for p in (directory, *directory.parents) if not p.exists()]
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._created += missing  # deepest first
        self._fds.append(_lock_dir(directory, self.spec.nnodes <= 1, wait_s))
        for name, exclusive in self.spec.files():
            path = directory / name
            fd = _lock_one(path, exclusive, wait_s)
            self._fds.append(fd)
            self._files.append(path)
            if exclusive:
                record = _owner_record(self.spec)
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    @property
    def generation_path(self) -> Path:
        """The file holding this node's generation (in the run dir, the first directory)."""
        return fence.generation_file(self.directories[0], self.spec.nnodes, self.spec.node_rank)

    def own_fence(self) -> fence.Fence:
        """The supervisor's own fence (taken: its generation; unlocked: not fenced)."""
        return fence.Fence(self.generation_path, self.generation) if self.generation else fence.Fence.none()

    def release(self, *, remove_created: bool = False, written: tuple[str, ...] = ()) -> None:
        """Drop every lock (idempotent). ``remove_created``: also remove the directories this lock made,
        when they hold nothing but its lock files and the files named in ``written``."""
        if remove_created:
            ours = {p.name for p in self._files} | {self.generation_path.name} | set(written)
            for directory in self._created:  # deepest first
                with contextlib.suppress(OSError):
                    if set(os.listdir(directory)) <= ours:  # nothing else was written there
                        for name in ours & set(os.listdir(directory)):
                            (directory / name).unlink()
                        directory.rmdir()
        for fd in self._fds:
            os.close(fd)
        self._fds, self._files, self._created = [], [], []
        self.generation = None


def lock_run_dirs(run_dir: Path, node: NodeSpec) -> RunDirLock:
    """A supervisor's locks (not taken yet): its run dir, and its shared dir (``--shared-dir``) when that is another one."""
    return RunDirLock([run_dir, node.shared_root(run_dir)], LockSpec(node.nnodes, node.node_rank))
