"""A real `dflash-ipc up` forking from a shared fork server (DFLASH_IPC_SHARED_FORKSERVER, the test
suite's per-worker switch), its supervisor SIGKILLed mid-step: the server sees the connection's EOF
and SIGTERMs that supervisor's children, which leave through CLOSING; then nothing of the run is
left (no process, segment or socket file), and the server serves on. The product's own chain
(server and children ended by death signals): test_crash_anywhere.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from fault_harness import Up, leftovers, status_json, wait_gone, write_config

from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV, ForkServer, up_preload
from dflash_ipc.runtime.launch import child_env

pytestmark = [pytest.mark.slow, pytest.mark.own_forkserver]  # a shared server of its own, whose clients it counts


# The full suite's: by default, tests/runtime/test_forkserver_shared.py SIGKILLs a client of a shared server (its
# children end, the other client's run on, the server serves on), and test_crash_anywhere.py SIGKILLs a real
# `up` mid-step (its children leave through CLOSING: no process, segment or socket left; status "lost").
@pytest.mark.faults_full
def test_a_sigkilled_supervisor_of_a_shared_fork_server_leaves_nothing_and_the_server_serves_on(tmp_path, monkeypatch):
    owner = ForkServer.start_shared(up_preload(), child_env(), prefix="dflash-fs-test-")
    path = owner.listen_path
    try:
        monkeypatch.setenv(SHARED_FORKSERVER_ENV, path)
        up = Up(write_config(tmp_path / "c.toml"), tmp_path / "run")
        try:
            up.wait_until(lambda: up.steps_logged() >= 2, "2 steps")
            pids = up.child_pids()
            said = rf"^\[up\] fork server \(run.launcher\) ready after [\d.]+ s: the shared one at {re.escape(path)} \(pid {owner.pid},"
            assert re.search(said, up.output, re.M), up.output[-3000:]
            assert owner.server_status() == {"clients": 1, "children": len(pids), "rejected": 0}
            up.proc.send_signal(signal.SIGKILL)
            up.proc.wait()
            gone_s = wait_gone(up, pids, 30.0)
        finally:
            up.close()
        assert gone_s is not None, f"children of the killed supervisor still run: {leftovers(up, pids)}"
        print(f"FAULTS: SIGKILL supervisor of a shared fork server mid-step: children gone after {gone_s:.1f} s")
        deadline = time.monotonic() + 10  # gone is not yet reaped: the server reaps, then removes the socket files
        while (status := owner.server_status())["children"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == {"clients": 0, "children": 0, "rejected": 0}
        assert leftovers(up, pids) == []  # no process, shared-memory segment or socket file
        rc, snap = status_json(up.run_dir)
        assert rc == 0 and snap["state"] == "lost", snap
        probe = owner.popen([sys.executable, "-m", "json.tool", "--help"], env=child_env(), stdout=subprocess.DEVNULL)
        assert probe.wait(timeout=60) == 0  # the server serves on
    finally:
        owner.close()
    assert not os.path.exists(os.path.dirname(path))  # the server's private directory went with it
