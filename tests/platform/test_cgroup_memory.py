"""platform/host_memory.py: the host memory preflight counts is capped by the process's cgroup limits (v1 and v2,
every ancestor, a container's own cgroup mounted as the root), read from a /proc + /sys tree built here; on this
machine, from the real files. A run that does not fit the limit is refused naming the cgroup file."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.platform.host_memory import HostMemory, host_memory
from dflash_ipc.runtime import resources

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path, cgroup_lines: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup_lines)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_v2_the_tightest_ancestor_counts_with_its_droppable_page_cache(tmp_path):
    slice_ = "sys/fs/cgroup/user.slice"
    root = _tree(
        tmp_path,
        "0::/user.slice/job-7\n",
        {
            f"{slice_}/memory.max": f"{8 * GIB}\n",
            f"{slice_}/memory.current": f"{6 * GIB}\n",
            f"{slice_}/memory.stat": f"anon 123\ninactive_file {GIB}\nactive_file 5\n",
            f"{slice_}/job-7/memory.max": "max\n",
            f"{slice_}/job-7/memory.current": f"{5 * GIB}\n",
            "sys/fs/cgroup/memory.max": "max\n",  # the root: never a limit
        },
    )
    assert host_memory(20 * GIB, root) == HostMemory(3 * GIB, str(root / slice_ / "memory.max"))
    # the machine is tighter than the cgroup: the machine's figure, no cgroup named
    assert host_memory(2 * GIB, root) == HostMemory(2 * GIB)


def test_v2_the_job_limit_below_its_parent(tmp_path):
    job = "sys/fs/cgroup/a/b"
    root = _tree(
        tmp_path,
        "0::/a/b\n",
        {
            "sys/fs/cgroup/a/memory.max": f"{64 * GIB}",
            "sys/fs/cgroup/a/memory.current": f"{10 * GIB}",
            f"{job}/memory.max": f"{12 * GIB}",
            f"{job}/memory.current": f"{10 * GIB}",
        },
    )
    assert host_memory(100 * GIB, root) == HostMemory(2 * GIB, str(root / job / "memory.max"))


def test_v1_container_sees_its_own_cgroup_as_the_mount(tmp_path):
    # /proc/self/cgroup names the host's path, which does not exist inside the container
    mount = "sys/fs/cgroup/memory"
    root = _tree(
        tmp_path,
        "5:devices:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        {
            f"{mount}/memory.limit_in_bytes": f"{4 * GIB}\n",
            f"{mount}/memory.usage_in_bytes": f"{3 * GIB}\n",
            f"{mount}/memory.stat": f"cache 9\ntotal_inactive_file {GIB // 2}\n",
        },
    )
    assert host_memory(20 * GIB, root) == HostMemory(GIB + GIB // 2, str(root / mount / "memory.limit_in_bytes"))


def test_no_limit_or_no_files_is_the_machines_figure(tmp_path):
    unlimited = _tree(
        tmp_path / "v1",
        "4:memory:/\n",
        {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712", "sys/fs/cgroup/memory/memory.usage_in_bytes": "5"},
    )
    assert host_memory(7 * GIB, unlimited) == HostMemory(7 * GIB)
    assert host_memory(7 * GIB, tmp_path / "nothing-here") == HostMemory(7 * GIB)
    garbage = _tree(tmp_path / "bad", "0::/x\n", {"sys/fs/cgroup/x/memory.max": "lots", "sys/fs/cgroup/x/memory.current": "1"})
    assert host_memory(7 * GIB, garbage) == HostMemory(7 * GIB)


def test_this_machine_reads_its_real_files():
    psutil = pytest.importorskip("psutil")
    machine = int(psutil.virtual_memory().available)
    found = host_memory(machine)
    assert 0 <= found.available <= machine
    assert found.limited_by == "" or Path(found.limited_by).is_file()
    cfg = load_config(str(REPO / "configs" / "tiny-cpu.toml"))
    # preflight's figure goes through the same reading (memory moves between two reads: no equality)
    measured = resources.measure_available(cfg)
    assert measured.host > 0 and (measured.host_limited_by == "" or Path(measured.host_limited_by).is_file())


def test_a_run_over_the_limit_is_refused_naming_the_cgroup_file():
    cfg = load_config(str(REPO / "configs" / "tiny-cpu.toml"))
    needs = [resources.Need("the token cache", resources.HOST, 3 * GIB, [("data.max_samples", 1000, 100)])]
    limit = "/sys/fs/cgroup/job/memory.max"
    resources.check_fits(cfg, needs, resources.Available(host=3 * GIB, shm=0, host_limited_by=limit))
    refused = r"3\.0 GiB of host .* but 2\.0 GiB is available under the cgroup limit in /sys/fs/cgroup/job/memory\.max"
    with pytest.raises(ConfigError, match=refused):
        resources.check_fits(cfg, needs, resources.Available(host=2 * GIB, shm=0, host_limited_by=limit))
