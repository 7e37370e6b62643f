"""Fenced run directories: no process of an earlier `up` writes in a directory a newer one owns.

* A deleted lock file admits no second `up`: the supervisor also holds the directory itself
  (before: a second `up` after ``rm RUN_DIR/lock`` swept the live run's shared memory, interleaved
  metrics.jsonl and had its checkpoint deleted by the first run's retention).
* A stopped child of a SIGKILLed supervisor: its sentinel SIGKILLs it at once; and with the sentinel
  switched off, the child woken (SIGCONT) after a new `up --resume` took the directory writes and
  deletes nothing there (before: its checkpoint at step 6 deleted the new run's newer ones and moved
  ``latest`` back).
* A write with a generation that moved on (checkpoint, rotation, ``latest``, metrics) is refused
  and leaves the directory as it was.
* A full disk: the FAILED line names the drafter whose checkpoint did not fit, with its sizes, not
  the peer whose collective then failed ("Connection closed by peer").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from fault_harness import CLI, Up, report, write_config

from dflash_ipc.drafter.checkpoint.store import BatchLedger, read_latest_pointer, save_checkpoint
from dflash_ipc.rundir.fence import Fence, FencedOut, generation_file
from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV
from dflash_ipc.runtime.run_lock import LOCK_FILE, RunDirBusy, RunDirLock, refuse_if_owned


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _save(root: Path, step: int, fence: Fence | None = None) -> Path:
    return save_checkpoint(
        root,
        step,
        model_state={"w": torch.full((16,), float(step))},
        trainer_state={"step": step},
        rng_state=None,
        ledger=BatchLedger([(0, 0, i) for i in range(step)]),
        keep=3,
        fence=fence,
    )


# --------------------------------------------------------------------------- the lock and the fence, in-process


def test_a_deleted_lock_file_admits_no_second_run(tmp_path):
    run_dir = tmp_path / "run"
    first = RunDirLock.acquire([run_dir])
    try:
        (run_dir / LOCK_FILE).unlink()
        with pytest.raises(RunDirBusy, match=rf"in use by another `dflash-ipc up` \(pid {os.getpid()} on host"):
            RunDirLock.acquire([run_dir], wait_s=0.1)
        with pytest.raises(RunDirBusy):
            refuse_if_owned(run_dir)
    finally:
        first.release()
    RunDirLock.acquire([run_dir], wait_s=0).release()  # released with its owner


def test_a_write_of_an_earlier_generation_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    old = RunDirLock.acquire([run_dir])
    old_fence = old.own_fence()
    root = run_dir / "checkpoints"
    for step in (2, 4):
        _save(root, step, old_fence)
    old.release()  # the old supervisor dies; its children keep their generation
    new = RunDirLock.acquire([run_dir])
    try:
        assert new.generation.number == old_fence.generation.number + 1
        new_fence = Fence.of_argv(run_dir, new.own_fence().argv_value)  # as a child of the new run gets it
        for step in (6, 8):
            _save(root, step, new_fence)
        before = sorted(p.name for p in root.iterdir())
        # the old run's drafter, woken: a checkpoint at step 3 would rotate away 6 and 8 and point latest at 3
        with pytest.raises(FencedOut, match=rf"belongs to a newer `dflash-ipc up` \(generation {new.generation.number}"):
            _save(root, 3, old_fence)
        with pytest.raises(FencedOut):
            old_fence.check("metrics.jsonl (step 3)")
        assert sorted(p.name for p in root.iterdir()) == before == ["latest", "step-000004", "step-000006", "step-000008"]
        assert read_latest_pointer(root) == "step-000008"
        # a generation file deleted by hand: recreated empty, it matches no old process either
        generation_file(run_dir).unlink()
        with pytest.raises(FencedOut, match="generation file was replaced"):
            new_fence.check("metrics.jsonl")
    finally:
        new.release()


# --------------------------------------------------------------------------- the sentinel: real processes

SUPERVISOR = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)
CHILD = textwrap.dedent(
    """
    import os, signal, time
    from dflash_ipc.runtime.launch import set_parent_death_signal, start_death_sentinel
    signal.signal(signal.SIGTERM, lambda *_: None)  # a role's handler: SIGTERM only asks it to stop
    set_parent_death_signal(signal.SIGTERM)
    assert start_death_sentinel(os.getppid()) is not None
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("sentinel", [True, False])
def test_a_stopped_child_dies_with_its_supervisor(tmp_path, sentinel):
    """The death signal waits out SIGSTOP; the sentinel's SIGKILL does not (without it: the child lives on)."""
    env = dict(os.environ) | ({} if sentinel else {"DFLASH_IPC_DEBUG_NO_SENTINEL": "1"})
    child_code = CHILD if sentinel else CHILD.replace("is not None", "is None")
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, child_code], stdout=subprocess.PIPE, text=True, env=env)
    child = int(sup.stdout.readline())
    try:
        assert sup.stdout.readline().strip() == "ready"  # the child shares the pipe: its sentinel (if any) started
        os.kill(child, signal.SIGSTOP)
        sup.kill()
        sup.wait()
        t0 = time.monotonic()
        while not _gone(child) and time.monotonic() - t0 < (10 if sentinel else 1):  # a sentinel acts in ~0.1 s
            time.sleep(0.02)
        if sentinel:
            assert _gone(child), "the stopped child outlived its supervisor"
            report(f"fence: a stopped child gone {time.monotonic() - t0:.2f} s after its supervisor's SIGKILL")
        else:
            assert not _gone(child) and psutil.Process(child).status() == psutil.STATUS_STOPPED
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        sup.kill()


# --------------------------------------------------------------------------- live `up` groups


@pytest.mark.slow
@pytest.mark.faults_full  # the lock itself: test_a_deleted_lock_file_admits_no_second_run, in-process
def test_a_second_up_after_the_lock_file_was_deleted_is_refused(tmp_path):
    cfg = write_config(tmp_path / "c.toml", training={"checkpoint_every": 2})
    run_dir = tmp_path / "run"
    first = Up(cfg, run_dir, name="first")
    try:
        first.wait_until(lambda: first.steps_logged() >= 2, "2 steps")
        (run_dir / LOCK_FILE).unlink()
        argv = [*CLI, "up", "--config", str(cfg), "--run-dir", str(run_dir), "--resume"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and f"in use by another `dflash-ipc up` (pid {first.proc.pid} on host" in out, out
        assert "[up]" not in out and "Traceback" not in out, out
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait() == 0, first.output[-3000:]
    finally:
        first.close()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == list(range(1, len(steps) + 1)), steps
    report("fence: a second `up` after `rm RUN_DIR/lock`: refused (exit 2)")


@pytest.mark.slow
@pytest.mark.own_forkserver  # the product's chain: the supervisor's own fork server dies with it
def test_a_stopped_child_of_a_killed_supervisor_never_touches_the_resumed_run(tmp_path, monkeypatch, shared_forkserver):
    """Sentinel off (the fence alone): SIGSTOP both drafters at step 5, SIGKILL the supervisor,
    `up --resume`; at its step 5 past the resume SIGCONT the old drafters. They write nothing:
    the new run's checkpoints, ``latest`` and metrics stay its own, and it finishes. The resumed
    run forks from the worker's shared fork server (where its children come from is not asserted)."""
    monkeypatch.setenv("DFLASH_IPC_DEBUG_NO_SENTINEL", "1")
    cfg = write_config(tmp_path / "c.toml", data={"builtin_samples": 600}, training={"checkpoint_every": 2, "keep_checkpoints": 3})
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    a = Up(cfg, run_dir, name="a")
    old: list[int] = []
    try:
        a.wait_until(lambda: a.steps_logged() >= 5, "5 steps")
        old = [a.child_pids()["drafter-0"], a.child_pids()["drafter-1"]]
        for pid in old:
            os.kill(pid, signal.SIGSTOP)
        a.proc.kill()
        a.proc.wait()
        resumed_at = int(read_latest_pointer(ckpts).split("-")[1])
        shared = {SHARED_FORKSERVER_ENV: shared_forkserver} if shared_forkserver else {}
        b = Up(cfg, run_dir, "--resume", name="b", env={**os.environ, **shared})
        try:
            b.wait_until(lambda: _max_step(run_dir) >= resumed_at + 5, f"step {resumed_at + 5}")
            for pid in old:
                os.kill(pid, signal.SIGCONT)
            t0 = time.monotonic()
            while not all(_gone(p) for p in old) and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            assert all(_gone(p) for p in old), "the woken drafters of the killed run still run"
            b.proc.send_signal(signal.SIGTERM)
            assert b.wait() == 0, b.output[-3000:]
        finally:
            b.close()
    finally:
        for pid in old:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        a.close()
    logs = (run_dir / "logs" / "drafter-0.log").read_text()
    assert "leaves it alone" in logs, logs[-3000:]  # the fence spoke: the old drafter-0 tried a write
    b_pid = b.child_pids()["drafter-0"]
    writers = {json.loads((p / "meta.json").read_text())["pid"] for p in ckpts.glob("step-*")}
    latest = json.loads((ckpts / read_latest_pointer(ckpts) / "meta.json").read_text())
    assert old[0] not in writers and latest["pid"] == b_pid and latest["step"] > resumed_at, (writers, latest)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == list(range(1, len(steps) + 1)), steps  # nothing interleaved by the old drafter-0
    report(f"fence: woken drafters of a killed run (resumed at step {resumed_at}): no write; the new run's latest is step {latest['step']}")


def _max_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return max(steps, default=0)


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs (mounting needs root and CAP_SYS_ADMIN; skipped without them)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    argv = ["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(mnt)]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_named_as_the_cause_not_the_peer_it_took_down(tmp_path, small_disk):
    cfg = write_config(tmp_path / "c.toml", data={"builtin_samples": 600}, training={"checkpoint_every": 2})
    run_dir = small_disk / "run"
    up = Up(cfg, run_dir)
    try:
        up.wait_until(lambda: read_latest_pointer(run_dir / "checkpoints") is not None, "the first checkpoint")
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        with open(small_disk / "filler", "wb") as f:  # leave ~1 MiB: logs and metrics fit, a checkpoint does not
            f.write(b"\0" * max(0, free - (1 << 20)))
        code = up.wait()
        out = up.output
    finally:
        up.close()
    failed = out[out.index("[up] FAILED") :].splitlines()[0]
    report(f"fence: disk full mid-run: {failed[:200]}")
    assert code == 1 and "drafter-0" in failed and "CheckpointDiskFull" in failed and "free" in failed, out[-3000:]
    assert "Connection closed" not in failed and "drafter-1" not in failed, failed


def test_the_token_cache_on_a_tiny_disk_is_one_named_error(small_disk):
    """A 64 KiB disk: the cache of 1 MiB of tokens is refused with its sizes (before: a torch.save traceback)."""
    from dflash_ipc.data.token_cache import TokenCacheDiskFull, open_cache_dir, write_cache

    tiny = small_disk / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(tiny)], check=True)
    try:
        n = 200_000
        ones = torch.ones(n, dtype=torch.int32)
        payload = {"tokens": ones, "loss_mask": ones.to(torch.uint8), "offsets": torch.tensor([0, n])}
        with pytest.raises(TokenCacheDiskFull) as e, open_cache_dir(tiny / "data") as dir_fd:
            write_cache(dir_fd, tiny / "data" / "tokens-x.pt", "x", payload)
        assert "\n" not in str(e.value) and "for the token cache: need ~1.0 MiB" in str(e.value), str(e.value)
        assert "data.cache_dir" in str(e.value) and os.listdir(tiny / "data") == []
    finally:
        subprocess.run(["umount", "-l", str(tiny)], check=False)
