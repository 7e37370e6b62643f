"""Names of a run's POSIX shared-memory segments, listed and swept by run id.

Every segment of a run is ``/dev/shm/dflash-ipc-<run_id>-target<rank>``; the run id keeps
concurrent runs apart. A producer killed with SIGKILL leaves its segment behind, and the
supervisor's sweep of its run removes it. Plain files only: the supervisor imports this without
torch (``transport.shm`` maps the segments as tensors).
"""

from __future__ import annotations

import glob
import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dflash-ipc"


def new_run_id() -> str:
    return secrets.token_hex(4)


def shm_name(run_id: str, producer_rank: int) -> str:
    return f"{SHM_PREFIX}-{run_id}-target{producer_rank}"


def shm_free_bytes() -> int:
    """Bytes an unprivileged process can still write to /dev/shm (its tmpfs's free space)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


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
