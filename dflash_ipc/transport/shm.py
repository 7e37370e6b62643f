"""POSIX shared-memory segments of the rings: creation, mapping, unlinking.

Every segment is a private (0600) file ``/dev/shm/dflash-ipc-<run_id>-target<rank>`` mapped
MAP_SHARED as a torch uint8 tensor. Its name, and the sweep of a run's leftovers, live in
:mod:`dflash_ipc.transport.shm_names` (no torch: the supervisor imports them).
"""

from __future__ import annotations

import errno
import os

import torch

from dflash_ipc.transport.shm_names import SHM_DIR, SHM_PREFIX, shm_free_bytes


class SharedMemoryFullError(RuntimeError):
    pass


def create_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    """Create a private (0600) shared-memory file and map it MAP_SHARED as a uint8 tensor.

    A tmpfs file is sparse: it takes memory only as it is written, and a write that finds
    /dev/shm full kills the writer with SIGBUS. So the whole size is checked up front, and then
    every page is reserved (``posix_fallocate``): /dev/shm filled by someone else in between (two
    targets sizing against the same free space) is a :class:`SharedMemoryFullError` here, at
    start-up, with the segment removed again, never a SIGBUS mid-run."""
    free = shm_free_bytes()
    if nbytes > free:
        raise SharedMemoryFullError(_full_message(nbytes, free))
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SharedMemoryFullError(_full_message(nbytes, shm_free_bytes(), f"reserving {path}: ")) from None
        raise
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _full_message(nbytes: int, free: int, what: str = "") -> str:
    return (
        f"shared memory full ({what}{SHM_DIR}, need {nbytes} bytes, {free} free): remove leftovers of killed runs "
        f"({SHM_DIR}/{SHM_PREFIX}-*), use fewer or smaller ring slots (transport.ring_slots, smaller batches), "
        "or enlarge /dev/shm (docker: --shm-size)"
    )


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
