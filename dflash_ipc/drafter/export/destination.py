"""Where an export may go: a directory it owns whole, and nothing else.

An export replaces its directory whole (``fsutil.replace_dir``: written beside it, swapped in by one
rename, so a kill leaves the previous export as it was). It therefore takes only a directory that
holds nothing it did not write:

* missing, or empty;
* a previous export: its marker file :data:`EXPORT_MARKER` lists the files that export wrote, and
  the directory holds no other (an export from before the marker: only the layout's own names,
  ``config.json`` among them).

Anything else (a home directory with a ``.netrc``, a checkpoint, a run directory) is refused by
name, and nothing in it is touched: no file is written, chmodded or removed there. ``dflash-ipc
export`` also refuses a target inside its source run directory (but its ``export/``) or inside a
checkpoint root, whatever they hold.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from dflash_ipc.rundir import bounded_json

#: the file every export writes last, naming the files it wrote
EXPORT_MARKER = ".dflash-ipc-export"
MARKER_FORMAT = "dflash-ipc-export/1"
#: the names an export wrote before it left a marker (config.json, the weights, the modeling code,
#: the draft rows of an older layout)
LEGACY_EXPORT_FILES = frozenset({"config.json", "model.safetensors", "modeling_dflash_ipc.py", "draft_vocab.safetensors"})
_SHOWN = 6


class ExportTargetRefused(ValueError):
    """``--out`` names a directory an export does not own."""


def marker_text(files: list[str]) -> str:
    return json.dumps({"format": MARKER_FORMAT, "files": sorted(files)}, indent=1) + "\n"


def _marker_files(marker: Path) -> set[str] | None:
    """The files a previous export's marker lists; None when it is no marker of ours."""
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        data = bounded_json.read(marker)  # a planted marker nested past the parser's recursion is no marker
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT or not isinstance(data.get("files"), list):
        return None
    return {f for f in data["files"] if isinstance(f, str)}


def check_replaceable(out: Path) -> None:
    """``out`` is missing, empty, or a previous export holding only its own files; else
    :class:`ExportTargetRefused` naming what it holds that no export wrote."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ExportTargetRefused(f"--out {out}: a symbolic link; give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise ExportTargetRefused(f"--out {out}: exists and is not a directory")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    own = _marker_files(out / EXPORT_MARKER)
    if own is None:
        own = set(LEGACY_EXPORT_FILES) if "config.json" in entries else set()
    foreign = [e for e in entries if e != EXPORT_MARKER and (e not in own or not stat.S_ISREG(os.lstat(out / e).st_mode))]
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
        raise ExportTargetRefused(
            f"--out {out}: holds {shown}, which no dflash-ipc export wrote; an export replaces its directory whole "
            "and touches nothing else: give a new or empty directory, or a previous export"
        )


def check_outside_run(out: Path, run_dir: Path, checkpoint_root: Path) -> None:
    """``out`` is neither the run directory, nor inside it (but its ``export/``), nor inside a checkpoint root."""
    where = out.resolve()
    run, ckpts = run_dir.resolve(), checkpoint_root.resolve()
    if where == ckpts or ckpts in where.parents:
        raise ExportTargetRefused(f"--out {out}: the run's checkpoints ({ckpts}) or a path inside them; export to a directory of its own")
    if where == run or (run in where.parents and (run / "export") not in where.parents):
        raise ExportTargetRefused(
            f"--out {out}: the run directory {run} or a path inside it; export to a directory of its own (or under {run}/export)"
        )
