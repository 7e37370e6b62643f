"""One run per directory: a second `dflash-ipc up` on a live run directory is
refused, and the first run loses nothing.

Before, a second `up` swept the first's live shared memory, reset its metrics.jsonl, overwrote its
checkpoints, and both exited 0. Now the supervisor holds ``RUN_DIR/lock`` (``runtime.run_lock``)
for its whole life. The fast tests take the lock in real processes (a holder process, SIGKILL, a
grandchild that outlives it, nodes of a run of several); one live `up` then serves every timing of
a second `up`: during its probe (before the handshake), its handshake, training, a checkpoint and
the restart of its group after a drafter is killed (the same run is `up --max-restarts`'s test).
Each refusal is timed (``FAULTS:`` lines); the pass/fail conditions are what was refused and what
the first run kept.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fault_harness import CLI, Up, leftovers, lock_owner_pid, report, status_json, write_config

from dflash_ipc.drafter.checkpoint.layout import META_FILE, read_latest_pointer
from dflash_ipc.runtime.nodes import NodeSpec
from dflash_ipc.runtime.run_lock import LOCK_FILE, LockSpec, RunDirBusy, RunDirLock, lock_run_dirs, refuse_if_owned

HOLDER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from dflash_ipc.runtime.run_lock import RunDirLock
    lock = RunDirLock.acquire([Path(sys.argv[1])])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) if sys.argv[2] == "spawn" else None
    print("locked", child.pid if child else 0, flush=True)
    time.sleep(120)
    """
)


def _holder(run_dir: Path, spawn: bool = False) -> tuple[subprocess.Popen, int]:
    """A process holding ``run_dir``'s lock (and, with ``spawn``, a child of its own); (process, child pid)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "spawn" if spawn else "-"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line[:1] == ["locked"], line
    return proc, int(line[1])


def test_a_held_directory_is_refused_naming_its_owner(tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = _holder(run_dir)
    try:
        owner = json.loads((run_dir / LOCK_FILE).read_text())
        assert owner["pid"] == proc.pid and owner["host"]
        assert (run_dir / LOCK_FILE).stat().st_mode & 0o777 == 0o600
        for attempt in (lambda: RunDirLock.acquire([run_dir], wait_s=0.2), lambda: refuse_if_owned(run_dir)):
            with pytest.raises(RunDirBusy) as e:
                attempt()
            text = str(e.value)
            assert str(run_dir) in text and f"pid {proc.pid}" in text and f"kill -TERM {proc.pid}" in text
            assert f"dflash-ipc status --run-dir {run_dir}" in text
    finally:
        proc.kill()
        proc.wait()


def test_a_sigkilled_owner_and_its_surviving_child_never_block_the_next_start(tmp_path):
    """The kernel drops the lock with its owner; a child it spawned never held it (close-on-exec)."""
    run_dir = tmp_path / "run"
    proc, child = _holder(run_dir, spawn=True)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the child outlives its parent here (no death signal): it must not hold the lock
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid  # the stale record is still there
        refuse_if_owned(run_dir)
        lock = RunDirLock.acquire([run_dir], wait_s=0)
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_nodes_share_a_directory_but_two_of_one_rank_do_not(tmp_path):
    run_dir, shared = tmp_path / "run", tmp_path / "shared"
    node0 = RunDirLock.acquire([run_dir], LockSpec(2, 0))
    node1 = RunDirLock.acquire([run_dir], LockSpec(2, 1))
    try:
        refuse_if_owned(run_dir)  # a run of several nodes holds `lock` shared: the read-only check passes
        with pytest.raises(RunDirBusy, match=rf"pid {os.getpid()} on host \S+, node 1/2"):
            RunDirLock.acquire([run_dir], LockSpec(2, 1), wait_s=0.1)
        with pytest.raises(RunDirBusy, match="node 0/2.*node 1/2"):  # a single-node run in that directory
            RunDirLock.acquire([run_dir], wait_s=0.1)
    finally:
        node0.release()
        node1.release()
    # own run dirs, one --shared-dir: the shared dir is locked per node rank as well
    a, b, c = (lock_run_dirs(tmp_path / d, NodeSpec(2, r, "127.0.0.1", 29500, str(shared))) for d, r in (("a", 0), ("b", 1), ("c", 0)))
    a.take()
    b.take()
    try:
        with pytest.raises(RunDirBusy, match=f"{shared} is in use"):
            c.take(wait_s=0.1)
        assert not (tmp_path / "c").exists()  # the refused one removed the run dir it had made
    finally:
        a.release()
        b.release()


def test_a_refused_start_removes_only_what_it_created(tmp_path):
    new = tmp_path / "runs" / "r"
    RunDirLock.acquire([new]).release(remove_created=True)
    assert not (tmp_path / "runs").exists()
    lock = RunDirLock.acquire([new])
    (new / "logs").mkdir()
    lock.release(remove_created=True)
    assert (new / "logs").is_dir() and (new / LOCK_FILE).exists()


# --------------------------------------------------------------------------- a live `up`


def _second_up(config: Path, run_dir: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    argv = [*CLI, "up", "--config", str(config), "--run-dir", str(run_dir), *extra]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0


def _metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_second_up_is_refused_at_every_moment_of_a_live_run_and_a_killed_drafter_restarts_it_from_the_last_checkpoint(tmp_path):
    """One live run (``--max-restarts 1``); a second `up` (plain, --resume, --max-restarts) during its
    probe, handshake, training, a checkpoint and the group's restart: each refused, exit 2, naming
    the directory and the owner's pid, with no traceback and nothing touched. Between the checkpoint
    and the restart, drafter-1 is SIGKILLed once a checkpoint and step 3 are logged: the supervisor
    names it (not drafter-0, whose collective then fails with "connection closed by peer"), starts a
    second group (a new run id) from the last checkpoint, whose targets skip what that checkpoint
    consumed. The first run (stopped by SIGTERM after step 6) trains steps 1..N once (the steps lost
    with the crash are not kept twice), keeps its run ids, and its checkpoints are its own (its rank 0s'), the last at step N."""
    cfg = write_config(tmp_path / "c.toml", data={"builtin_samples": 600}, training={"checkpoint_every": 2})
    run_dir = tmp_path / "run"
    first = Up(cfg, run_dir, "--max-restarts", "1", name="first")
    refusals: dict[str, float] = {}

    def second(moment: str, *extra: str) -> None:
        r, seconds = _second_up(cfg, run_dir, *extra)
        out = r.stdout + r.stderr
        assert r.returncode == 2, f"{moment}: exit {r.returncode}\n{out}"
        assert f"{run_dir} is in use by another `dflash-ipc up` (pid {first.proc.pid} on host" in out, f"{moment}: {out}"
        assert f"kill -TERM {first.proc.pid}" in out and "Traceback" not in out, f"{moment}: {out}"
        assert "[up]" not in out, f"{moment}: the refused `up` did something: {out}"
        refusals[moment] = seconds
        report(f"run lock: second `up` {' '.join(extra) or '(plain)'} during the first's {moment}: refused (exit 2) after {seconds:.2f} s")

    try:
        first.wait_until(lambda: lock_owner_pid(run_dir) == first.proc.pid, "the first `up` to own the run dir", poll_s=0.01)
        assert not (run_dir / "logs").exists()  # still probing: the lock came before anything else
        code, snap = status_json(run_dir)  # answered while the probe runs
        if not (run_dir / "logs").exists():  # still probing after the answer: it described the probe
            assert code == 0 and snap["state"] == "preparing" and snap["supervisor_pid"] == first.proc.pid, snap
            report("run lock: `status` during the first's probe: preparing")
        second("probe")
        first.wait_until(lambda: bool(first.child_pids()), "the children to be spawned", poll_s=0.01)
        run_id = (run_dir / "run_id").read_text()
        if "processes ready after" not in first.output:
            second("handshake", "--resume")
        first.wait_until(lambda: first.steps_logged() >= 2, "2 steps")
        code, snap = status_json(run_dir)  # status still answers on a locked directory
        assert code == 0 and snap["state"] == "running", snap
        second("training", "--max-restarts", "3")
        first.wait_until(lambda: read_latest_pointer(run_dir / "checkpoints") is not None, "a checkpoint")
        second("checkpoint", "--resume")
        first.wait_until(lambda: first.steps_logged() >= 3, "step 3")
        assert (run_dir / "run_id").read_text() == run_id  # the refused `up`s changed nothing
        victim = first.child_pids()["drafter-1"]
        os.kill(victim, signal.SIGKILL)
        first.wait_until(lambda: len(first.groups_started()) == 2, "the second group to be started", poll_s=0.01)
        run_id = (run_dir / "run_id").read_text()  # a restarted group's shared memory has a run id of its own
        second("restart", "--resume")
        # the rest of the data would prove nothing more: stop it the way systemd does (it checkpoints),
        # once the restarted group trains (the first group may have logged 6 steps before its kill)
        first.wait_until(lambda: first.output.count("processes ready after") == 2, "the restarted group's handshake", poll_s=0.01)
        trained = first.steps_logged()
        first.wait_until(lambda: first.steps_logged() >= max(6, trained + 1), "a step of the restarted group, 6 in all")
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait() == 0, first.output[-3000:]
    finally:
        first.close()
    out = first.output
    steps = _metrics_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 6, steps  # every step once, none reset, none kept twice
    assert (run_dir / "run_id").read_text() == run_id
    groups = first.groups_started()
    assert "swept" not in out and all(leftovers(first, group) == [] for group in groups)
    latest = read_latest_pointer(run_dir / "checkpoints")
    meta = json.loads((run_dir / "checkpoints" / latest / META_FILE).read_text())
    assert meta["step"] == steps[-1], meta  # the last checkpoint is the first run's final step
    # systemd's stop (SIGTERM to the supervisor alone) mid-training: the drafters checkpoint where they are
    assert "SIGTERM: asking drafters to checkpoint and stop" in out and "[up] stopped (shutdown: SIGTERM; resume with --resume)" in out
    writers = {json.loads((p / META_FILE).read_text())["pid"] for p in (run_dir / "checkpoints").glob("step-*")}
    assert writers <= {g["drafter-0"] for g in groups} and meta["pid"] == groups[1]["drafter-0"], (writers, groups)
    # the restart: named as the cause, one new group from the last checkpoint
    assert f"[up] FAILED: drafter-1 (pid {victim}) killed by signal SIGKILL" in out, out
    assert "restarting the group from the last checkpoint (1/1)" in out
    assert len(groups) == 2 and groups[0].keys() == groups[1].keys() and not set(groups[0].values()) & set(groups[1].values()), groups
    # the restarted targets skipped what the checkpoint had consumed
    logs = [(run_dir / "logs" / f"target-{r}.log").read_text() for r in range(2)]
    consumed = [int(n) for log in logs for n in re.findall(r"(\d+) already consumed \(ledger\)", log)]
    assert len(consumed) == 4 and consumed[0] == consumed[2] == 0 and consumed[1] + consumed[3] > 0, consumed
    report(f"run lock: {len(refusals)} refusals, worst {max(refusals.values()):.2f} s; the first run trained steps 1..{steps[-1]} once")
