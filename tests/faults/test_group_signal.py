"""A signal to the whole process group is a stop: real `dflash-ipc up` groups on the tiny CPU config.

``timeout``, ``kill -- -PGID``, a batch scheduler and systemd's control-group kill (``systemctl kill``,
``KillMode=control-group``) signal every process of a run at once: the supervisor, its fork server, the
probe, every target and drafter and each one's sentinel. Every one of them takes SIGTERM, SIGINT and SIGHUP
for "checkpoint and stop" (dflash_ipc/runtime/stop_signals.py): the drafters checkpoint at an agreed step,
`up` exits 0 and `status` says STOPPED; before training started, `up` stops at once, exit 0. No process of
the tree is left.

The run's processes must be in the group the signal reaches: each `up` here has a process group of its
own, and its own fork server (the worker's shared server, ``own_forkserver``, forks into the worker's group).
CI runs the two common senders mid-training; DFLASH_IPC_FAULTS_FULL=1 adds each stop signal at each moment
(the probe, the handshake, training) and systemd's kill, which signals each process of the cgroup in turn.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from fault_harness import Up, leftovers, report, write_config

pytestmark = [pytest.mark.slow, pytest.mark.own_forkserver]

#: Safety net for `timeout`'s own limit: the test ends it by hand (the expiry, SIGALRM) at the moment it picks.
TIMEOUT_LIMIT_S = "600"


def _tree(root: int) -> list[psutil.Process]:
    """``root`` and every process below it (supervisor, fork server, probe or children, sentinels)."""
    try:
        parent = psutil.Process(root)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"pid {p.pid}: {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _probe_running(up: Up) -> bool:
    for p in _tree(up.proc.pid):
        try:
            if "-m dflash_ipc.runtime.probe" in " ".join(p.cmdline()):  # not the fork server preloading it
                return True
        except psutil.Error:
            pass
    return False


def _wait_moment(up: Up, moment: str) -> None:
    if moment == "probe":
        up.wait_until(lambda: _probe_running(up), "the config probe", poll_s=0.01)
    elif moment == "handshake":
        up.wait_until(lambda: bool(up.child_pids()), "the children to be spawned", poll_s=0.005)
    else:  # training: a few steps in
        up.wait_until(lambda: up.steps_logged() >= 2, "2 steps", poll_s=0.02)


def _send(up: Up, sender: str, sig: signal.Signals) -> list[psutil.Process]:
    """Signal the run as ``sender`` would; returns every process of its tree at that moment."""
    tree = _tree(up.proc.pid)
    if sender == "timeout":  # the expiry itself: `timeout` then signals its command, then the whole group
        os.kill(up.proc.pid, signal.SIGALRM)
    elif sender == "kill -- -PGID":
        os.killpg(up.proc.pid, sig)
    else:  # systemd's control-group kill: every process of the cgroup, one by one, in pid order
        for p in sorted(tree, key=lambda p: p.pid):
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    return tree


def group_stop_trial(tmp_path, sender: str, sig: signal.Signals = signal.SIGTERM, moment: str = "training") -> str:
    """One run, stopped by ``sig`` from ``sender`` at ``moment``; returns its output."""
    cfg = write_config(tmp_path / "c.toml")
    run_dir = tmp_path / "run"
    wrapper = ("timeout", "--preserve-status", "-s", sig.name, TIMEOUT_LIMIT_S) if sender == "timeout" else ()
    up = Up(cfg, run_dir, wrapper=wrapper, own_group=True)
    try:
        _wait_moment(up, moment)
        pids = up.child_pids()
        tree = _send(up, sender, sig)
        code = up.wait()
        left = _alive(tree)
        out = up.output
    finally:
        up.close()
    report(f"{sig.name} from {sender} during {moment}: exit {code}, {len(tree)} processes signalled, {len(left)} left")
    assert code == 0, out[-3000:]
    assert "FAILED" not in out and "Traceback" not in out, out[-3000:]
    assert left == [], left
    assert leftovers(up, pids) == []
    if moment == "training":
        assert f"[up] stopped (signal {sig.name}; resume with --resume)" in out, out[-3000:]
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "stopped" and status["end_reason"].startswith(f"{sig.name} at step "), status
        step = int(status["end_reason"].rsplit(" ", 1)[1])
        assert (run_dir / "checkpoints" / f"step-{step:06d}" / "meta.json").is_file(), "the stop's checkpoint"
    return out


def test_timeout_ending_a_run_checkpoints_and_exits_0_stopped(tmp_path):
    group_stop_trial(tmp_path, "timeout")


def test_a_sigterm_to_the_process_group_checkpoints_and_exits_0_stopped(tmp_path):
    group_stop_trial(tmp_path, "kill -- -PGID")


@pytest.mark.faults_full
@pytest.mark.parametrize("moment", ["probe", "handshake", "training"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_full_each_stop_signal_to_the_group_at_each_moment(tmp_path, sig, moment):
    t0 = time.monotonic()
    out = group_stop_trial(tmp_path, "kill -- -PGID", sig, moment)
    if moment == "probe":
        assert f"[up] {sig.name}: stopping before training started" in out, out[-3000:]
    report(f"{sig.name} during {moment}: {time.monotonic() - t0:.1f} s")


@pytest.mark.faults_full
@pytest.mark.parametrize("moment", ["handshake", "training"])
def test_full_systemd_control_group_kill_is_a_stop(tmp_path, moment):
    group_stop_trial(tmp_path, "systemd", signal.SIGTERM, moment)
