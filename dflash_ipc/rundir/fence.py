"""Fencing tokens for a run directory: a write by a process of an earlier `up` is refused.

The run lock (:mod:`dflash_ipc.runtime.run_lock`) admits one supervisor at a time, but a process
can outlive its supervisor: a child SIGSTOPped while its supervisor was SIGKILLed wakes up (SIGCONT)
in a directory that a new `up` has taken over, and whatever it writes there then (a checkpoint, its
retention's deletes, ``latest``, a metrics line, the socket files it cleans up) damages the new run.
So each `up`, once it holds the lock, takes a fresh *generation*: the number after the directory's
last one plus a random token, written in ``RUN_DIR/generation`` (``generation.node-<rank>`` for a
node of several) and given to its children in argv (``--generation``). Every write a process of the
run makes to the directory goes through :meth:`Fence.guard`, which holds the file shared while it
checks that the directory's generation is still the process's own and does the write; the next
`up` takes it exclusively to write its own, so a write either completes before the new generation
exists or is refused (:class:`FencedOut`)::

    up (holding the run lock) ─▶ advance: flock generation EX (bounded wait for writes in flight)
        ─▶ number + 1, new token, pwrite in place (same length: one write), fsync ─▶ unlock
    any writer of the run: Fence.guard(what)
        ─▶ flock generation SH ─▶ the path still names the file locked? its generation == ours?
             no ─▶ FencedOut "… belongs to a newer `up` (generation N); this process (generation M) writes nothing there"
             yes ─▶ the write ─▶ unlock

The token makes a recreated file (deleted by hand) never match an old process's generation; the
number only tells a person which run is newer. A process with no generation (started by hand, or
by a test on its own) is not fenced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GENERATION_FILE = "generation"
RECORD_BYTES = 512  # every record is padded to this length: an update is one pwrite of the same size
ADVANCE_WAIT_S = 10.0  # a write in flight holds the file shared for as long as the write takes
_RETRY_S = 0.02


class FencedOut(RuntimeError):
    """This process's generation is no longer the run directory's: a newer `up` owns it."""


@dataclass(frozen=True)
class Generation:
    number: int
    token: str

    @property
    def text(self) -> str:
        """The argv form, ``N:TOKEN``."""
        return f"{self.number}:{self.token}"

    @classmethod
    def parse(cls, text: str) -> Generation:
        number, sep, token = text.partition(":")
        if not sep or not number.isdigit() or not token:
            raise ValueError(f"a generation is N:TOKEN, got {text!r}")
        return cls(int(number), token)


def generation_file(run_dir: Path, nnodes: int = 1, node_rank: int = 0) -> Path:
    return run_dir / (GENERATION_FILE if nnodes <= 1 else f"{GENERATION_FILE}.node-{node_rank}")


def _read_record(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, RECORD_BYTES * 2, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _record_generation(record: dict) -> Generation | None:
    number, token = record.get("generation"), record.get("token")
    return Generation(number, token) if isinstance(number, int) and isinstance(token, str) else None


def read_owner(path: Path) -> dict:
    """The record of the `up` that took ``path``'s generation last (pid, host, start time), or {}."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return {}
    try:
        return _read_record(fd)
    finally:
        os.close(fd)


def lock_holders(path: Path) -> list[int]:
    """The pids /proc/locks names as holding a flock on ``path`` (Linux; [] elsewhere)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ  1234 08:01:5678 0 EOF" (a waiter's line has "->" after the number)
        fields = [f for f in fields if f != "->"]
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want and fields[4].isdigit():
            pids.append(int(fields[4]))
    return sorted(set(pids))


def _open_locked(path: Path, mode: int, deadline: float | None) -> int:
    """An fd of the file ``path`` names now, flocked with ``mode``; BlockingIOError past ``deadline``."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
                    time.sleep(_RETRY_S)
            # deleted (or replaced) by hand meanwhile: a lock on the unlinked file fences nobody
            with contextlib.suppress(FileNotFoundError):
                st, fst = os.stat(path, follow_symlinks=False), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def advance(path: Path, owner: dict | None = None, wait_s: float = ADVANCE_WAIT_S) -> Generation:
    """Take the next generation of ``path`` (the caller holds the run lock); returns it.

    Waits up to ``wait_s`` for writes of an earlier generation still in flight; a process of an
    earlier run that holds the file longer (stopped in the middle of a write) is named."""
    try:
        fd = _open_locked(path, fcntl.LOCK_EX, time.monotonic() + wait_s)
    except BlockingIOError:
        pids = [p for p in lock_holders(path) if p != os.getpid()]
        who = f" (pid {', '.join(map(str, pids))})" if pids else ""
        raise FencedOut(
            f"a process of an earlier run of {path.parent}{who} has been writing there for {wait_s:g} s (stopped?); "
            f"end it (`kill -KILL PID`) and start again"
        ) from None
    try:
        last = _record_generation(_read_record(fd))
        new = Generation((last.number if last else 0) + 1, secrets.token_hex(16))
        record = {"generation": new.number, "token": new.token, "pid": os.getpid(), "host": socket.gethostname()}
        record |= {"started_unix": time.time()} | (owner or {})
        data = json.dumps(record).encode()
        if len(data) >= RECORD_BYTES:
            raise ValueError(f"generation record of {len(data)} bytes (at most {RECORD_BYTES - 1})")
        os.pwrite(fd, data.ljust(RECORD_BYTES - 1) + b"\n", 0)
        os.ftruncate(fd, RECORD_BYTES)  # a record longer than this one (an older format) leaves no tail
        os.fsync(fd)
    finally:
        os.close(fd)  # drops the lock
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return new


class Fence:
    """One process's generation of one run directory; :meth:`guard` every write made there."""

    def __init__(self, path: Path | None, generation: Generation | None) -> None:
        self.path = path
        self.generation = generation

    @classmethod
    def none(cls) -> Fence:
        """Not fenced: a process started by hand or on its own in a test."""
        return cls(None, None)

    @classmethod
    def of_argv(cls, run_dir: Path, value: str) -> Fence:
        """A child's fence from its ``--generation FILE:N:TOKEN`` (:attr:`argv_value`; empty: not fenced)."""
        if not value:
            return cls.none()
        name, sep, text = value.partition(":")
        if not sep or not name.startswith(GENERATION_FILE) or "/" in name:
            raise ValueError(f"--generation is FILE:N:TOKEN with FILE in the run directory, got {value!r}")
        return cls(run_dir / name, Generation.parse(text))

    @property
    def argv_value(self) -> str:
        """What a child gets in ``--generation`` ("" when not fenced)."""
        return f"{self.path.name}:{self.generation.text}" if self.active else ""

    @property
    def active(self) -> bool:
        return self.path is not None and self.generation is not None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Hold the directory's generation (shared) around a write; FencedOut if it moved on."""
        if not self.active:
            yield
            return
        try:
            fd = _open_locked(self.path, fcntl.LOCK_SH, None)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # only a recreated file needs space: refuse
                raise FencedOut(f"cannot check the generation of {self.path.parent} ({e.strerror}); {what} not written") from None
            raise
        try:
            record = _read_record(fd)
            now = _record_generation(record)
            if now != self.generation:
                who = f"generation {now.number}, pid {record.get('pid')}" if now else "its generation file was replaced"
                raise FencedOut(
                    f"{self.path.parent} belongs to a newer `dflash-ipc up` ({who}); this process "
                    f"(generation {self.generation.number}) leaves it alone: {what} not written"
                )
            yield
        finally:
            os.close(fd)

    def check(self, what: str) -> None:
        """FencedOut unless the directory's generation is still this process's (no write follows)."""
        with self.guard(what):
            pass
