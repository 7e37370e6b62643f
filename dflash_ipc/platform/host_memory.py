"""Host memory a run can still take: the machine's available memory, or less where the process's cgroup
caps it (a container's ``--memory``, a Kubernetes pod's limit, a Slurm job's ``--mem``, a systemd unit's
``MemoryMax``). ``psutil.virtual_memory()`` reports the whole machine: inside a 24 GiB pod on a 512 GiB host it
says 500 GiB are free, preflight passes, and the kernel's OOM killer ends the run mid-training instead.

A cgroup's headroom is its limit minus what it holds now, plus the page cache it can drop first (inactive
file pages). Every ancestor's limit applies, so the tightest one counts. Both cgroup versions:

- v2 (unified): ``/proc/self/cgroup`` has ``0::/path``; ``memory.max`` ("max" = none), ``memory.current``,
  ``memory.stat``'s ``inactive_file``, read in ``/sys/fs/cgroup/path`` and each parent up to the mount.
- v1: the ``memory`` controller's line names the path under ``/sys/fs/cgroup/memory``;
  ``memory.limit_in_bytes`` (a value near 2**63 = none), ``memory.usage_in_bytes``, ``memory.stat``'s
  ``total_inactive_file``.

Inside a container the path in ``/proc/self/cgroup`` is often the host's, while the container sees its own
cgroup mounted as the root: a path that does not exist under the mount falls back to the mount itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value; anything this large is no limit
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """``available`` bytes; ``limited_by``: the cgroup file that caps it ("" when the machine's free memory does)."""

    available: int
    limited_by: str = ""


def host_memory(machine_available: int, root: Path = Path("/")) -> HostMemory:
    """The smaller of ``machine_available`` (psutil's) and every cgroup limit's headroom above this process;
    ``root`` is the filesystem root (a test points it at a tree it builds)."""
    best = HostMemory(machine_available)
    for limit_file, headroom in _cgroup_headrooms(root):
        if headroom < best.available:
            best = HostMemory(max(headroom, 0), limit_file)
    return best


def _cgroup_headrooms(root: Path) -> list[tuple[str, int]]:
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[str, int]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            out += _walk(root / "sys/fs/cgroup", path, _v2_headroom)
        elif "memory" in controllers.split(","):
            out += _walk(root / "sys/fs/cgroup/memory", path, _v1_headroom)
    return out


def _walk(mount: Path, path: str, headroom) -> list[tuple[str, int]]:
    """The headroom of the cgroup at ``path`` and of each ancestor up to ``mount``."""
    here = mount / path.lstrip("/")
    if not here.is_dir():
        here = mount  # a container's own cgroup, mounted as the root
    out = []
    while True:
        found = headroom(here)
        if found is not None:
            out.append(found)
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _v2_headroom(cgroup: Path) -> tuple[str, int] | None:
    limit, current = _number(cgroup / "memory.max"), _number(cgroup / "memory.current")
    if limit is None or current is None:  # "max": no limit here
        return None
    return str(cgroup / "memory.max"), limit - current + _stat(cgroup / "memory.stat", "inactive_file")


def _v1_headroom(cgroup: Path) -> tuple[str, int] | None:
    limit, usage = _number(cgroup / "memory.limit_in_bytes"), _number(cgroup / "memory.usage_in_bytes")
    if limit is None or usage is None or limit >= _V1_UNLIMITED:
        return None
    return str(cgroup / "memory.limit_in_bytes"), limit - usage + _stat(cgroup / "memory.stat", "total_inactive_file")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
