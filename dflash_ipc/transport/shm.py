"""POSIX shared-memory segments of the rings: names per run, creation, mapping, sweeping.

Every segment is a private (0600) file ``/dev/shm/dflash-ipc-<run_id>-target<rank>`` mapped
MAP_SHARED as a torch uint8 tensor. The run id keeps concurrent runs apart; a producer killed
with SIGKILL leaves its segment behind, and the supervisor's sweep of its run removes it.
"""

from __future__ import annotations

import glob
import os
import secrets
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dflash-ipc"


def new_run_id() -> str:
    return secrets.token_hex(4)


def shm_name(run_id: str, producer_rank: int) -> str:
    return f"{SHM_PREFIX}-{run_id}-target{producer_rank}"


def sweep_run_shm(run_id: str) -> list[str]:
    """Unlink every shared-memory segment of one run (leftovers of a killed producer)."""
    removed = []
    for path in glob.glob(str(SHM_DIR / f"{SHM_PREFIX}-{run_id}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def list_run_shm(run_id: str) -> list[str]:
    return sorted(glob.glob(str(SHM_DIR / f"{SHM_PREFIX}-{run_id}-*")))


class SharedMemoryFullError(RuntimeError):
    pass


def shm_free_bytes() -> int:
    """Bytes an unprivileged process can still write to /dev/shm (its tmpfs's free space)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    """Create a private (0600) shared-memory file and map it MAP_SHARED as a uint8 tensor.

    A tmpfs file is sparse: it takes memory only as it is written, and a write that finds
    /dev/shm full kills the writer with SIGBUS. So the whole size is checked up front and
    refused with :class:`SharedMemoryFullError` while nothing has been created yet."""
    free = shm_free_bytes()
    if nbytes > free:
        raise SharedMemoryFullError(
            f"shared memory full ({SHM_DIR}, need {nbytes} bytes, {free} free): remove leftovers of killed runs "
            f"({SHM_DIR}/{SHM_PREFIX}-*), use fewer or smaller ring slots (transport.ring_slots, smaller batches), "
            "or enlarge /dev/shm (docker: --shm-size)"
        )
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def open_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    path = SHM_DIR / name
    actual = path.stat().st_size
    if actual != nbytes:
        raise ValueError(f"shared memory {path} has {actual} bytes, descriptor says {nbytes}")
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def unlink_shm(name: str) -> None:
    """Remove a segment's name (idempotent); mappings stay valid until dropped."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass
