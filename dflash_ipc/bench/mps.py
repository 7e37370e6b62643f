"""Is the CUDA Multi-Process Service (MPS) serving this machine's GPUs?

Target and drafter processes that share one GPU time-slice it: each gets the whole GPU in turn, and a
kernel of one never runs beside a kernel of the other. Under MPS the processes' kernels go to one
server's context and can run side by side. MPS is started outside dflash-ipc, by whoever runs it::

    nvidia-cuda-mps-control -d                 # start the control daemon (same user as dflash-ipc, or root)
    dflash-ipc up --config ...                 # every CUDA process started after it is an MPS client
    echo quit | nvidia-cuda-mps-control        # stop it (after the run)

``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) must be the same for the daemon and the
clients. A client that finds the daemon's ``control`` pipe there connects to it: :func:`mps_status`
reports the same test, and the servers the daemon runs (one per user, started by the first client).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
CONTROL = "nvidia-cuda-mps-control"


def parse_server_list(text: str) -> list[int]:
    """The server PIDs of ``get_server_list``'s answer (one per line; other lines ignored)."""
    return [int(line) for line in (raw.strip() for raw in text.splitlines()) if line.isdigit()]


def mps_status(env: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """``{"active", "pipe_dir", "servers"}``: ``active`` when the control daemon's pipe exists in the pipe
    directory (CUDA clients started now connect to it); ``servers``: its server PIDs, when the control
    command is on PATH and answers within ``timeout_s``."""
    env = os.environ if env is None else env
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR
    control = Path(pipe_dir) / "control"
    try:
        active = stat.S_ISFIFO(control.stat().st_mode)
    except OSError:
        active = False
    servers: list[int] = []
    exe = shutil.which(CONTROL)
    if active and exe:
        try:
            run = subprocess.run([exe], input="get_server_list\n", capture_output=True, text=True, timeout=timeout_s, env=dict(env))
            servers = parse_server_list(run.stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return {"active": active, "pipe_dir": pipe_dir, "servers": servers}
