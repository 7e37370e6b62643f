"""Files that readers never see half-written, and directories private to the user."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = False) -> None:
    """Write via a temporary file in the same directory and rename over ``path``.

    A reader (``dflash-ipc status``, node_exporter's textfile collector, a resuming run) sees the
    old file or the new one, never a mix. ``durable`` also fsyncs the file and its directory, for
    files a crash must not lose (checkpoint pointers)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, durable: bool = False) -> None:
    write_bytes_atomic(path, text.encode(), durable=durable)
