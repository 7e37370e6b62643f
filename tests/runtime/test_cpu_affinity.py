"""CPU shares: on GPU hosts each process gets its own cores (and so do the workers it spawns)."""

from __future__ import annotations

import os
import subprocess
import sys

from dflash_ipc.runtime.liveness import cpu_shares_for


def test_cpu_shares_are_disjoint_and_cover_equal_parts():
    n = len(os.sched_getaffinity(0))
    shares = cpu_shares_for(1)
    assert shares == [sorted(os.sched_getaffinity(0))]
    assert cpu_shares_for(n) is None  # fewer than two cores per process: leave affinity alone
    if n >= 4:
        two = cpu_shares_for(2)
        assert two is not None and not set(two[0]) & set(two[1]) and len(two[0]) == len(two[1])


def test_apply_cpu_share_pins_the_process_and_its_children():
    core = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import os, subprocess, sys\n"
        "from dflash_ipc.runtime.child import apply_cpu_share\n"
        f"assert apply_cpu_share('{core}') == 1\n"
        "probe = 'import os; print(sorted(os.sched_getaffinity(0)))'\n"
        "child = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)\n"
        "print(sorted(os.sched_getaffinity(0)), child.stdout.strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"[{core}] [{core}]"
