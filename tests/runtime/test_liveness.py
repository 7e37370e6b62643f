"""Which exited or silent child the supervisor blames (runtime/liveness.py), on real processes."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psutil
import pytest

from dflash_ipc.runtime.children import Child
from dflash_ipc.runtime.liveness import exited_child, host_memory_text, silent_child


def _proc(code: int | None) -> subprocess.Popen:
    """A real child that exits with ``code`` (None: keeps running until killed)."""
    script = "import time; time.sleep(600)" if code is None else f"raise SystemExit({code})"
    p = subprocess.Popen([sys.executable, "-c", script])
    if code is not None:
        p.wait(timeout=60)
    return p


@pytest.fixture
def procs():
    made: list[subprocess.Popen] = []

    def make(code: int | None) -> subprocess.Popen:
        made.append(_proc(code))
        return made[-1]

    yield make
    for p in made:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_a_targets_clean_exit_is_a_failure_unless_the_group_is_stopping(procs):
    """Ctrl-C reaches the whole process group: the targets stop cleanly while the drafters still
    checkpoint. That exit is expected while stopping, and only then (before: the 27B benchmark's
    SIGINT ended in "FAILED: target-0 (pid N) exit code 0")."""
    target = Child("target", 0, "cpu", popen=procs(0))
    drafter = Child("drafter", 0, "cpu", popen=procs(None))
    assert exited_child([target, drafter], stopping=False) is target
    assert exited_child([target, drafter], stopping=True) is None


def test_while_stopping_a_crashed_drafter_is_still_blamed_beside_a_cleanly_stopped_target(procs):
    target = Child("target", 0, "cpu", popen=procs(0))
    drafter = Child("drafter", 0, "cpu", popen=procs(3))
    assert exited_child([target, drafter], stopping=True) is drafter
    crashed_target = Child("target", 1, "cpu", popen=procs(1))
    assert exited_child([crashed_target, Child("drafter", 1, "cpu", popen=procs(None))], stopping=True) is crashed_target


def test_a_child_that_exited_is_not_called_silent(procs):
    """An exited target stops heartbeating; while stopping that is not a hang to report."""
    now = time.monotonic()
    gone = Child("target", 0, "cpu", popen=procs(0), last_beat=now - 100)
    alive = Child("drafter", 0, "cpu", popen=procs(None), last_beat=now - 100)
    blamed, text = silent_child([gone, alive], now, timeout=10)
    assert blamed is alive and "drafter-0" in text and "target-0" not in text
    assert silent_child([gone], now, timeout=10) is None


def test_waiting_for_exits_after_done_returns_the_late_ones_instead_of_raising(procs):
    """A child slow to exit after its Done (an oversubscribed machine) is handed to the teardown;
    before, the supervisor's wait raised TimeoutExpired and the finished run came back as an error."""
    from dflash_ipc.runtime.liveness import wait_for_exits

    done = Child("target", 0, "cpu", popen=procs(0))
    slow = Child("target", 1, "cpu", popen=procs(None))
    assert wait_for_exits([done, slow], timeout=0.5) == [slow]
    assert wait_for_exits([done], timeout=0.5) == []


def test_a_dead_report_is_blamed_on_the_peer_that_exits_just_after_it(procs):
    """drafter-1 SIGKILLed: drafter-0's collective fails at once and it reports Dead before the
    killed process is seen to exit (the full fault suite once named drafter-0). The peer exiting
    within the grace is the cause; with no exit the reporter stays the one named."""
    from dflash_ipc.runtime.liveness import root_cause

    reporter = Child("drafter", 0, "cpu", popen=procs(None), dead_error="Connection closed by peer", dead_at=1.0)
    victim_proc = procs(None)
    victim = Child("drafter", 1, "cpu", popen=victim_proc)
    victim_proc.kill()  # exits while the supervisor is already looking
    assert root_cause([reporter, victim], grace_s=30.0) is victim
    alone = Child("drafter", 1, "cpu", popen=procs(None))
    assert root_cause([reporter, alone], grace_s=0.2) is reporter


def test_the_first_failure_by_time_is_named_not_the_peer_that_exited_first(procs):
    """drafter-0 fails on a full disk and reports it, then closes its rings (slow); drafter-1's
    collective fails a moment later ("Connection closed by peer") and it exits first. The first
    report by the time of failure is the cause, whichever process exited first."""
    from dflash_ipc.runtime.liveness import failure_line, first_failure

    first = Child("drafter", 0, "cpu", popen=procs(None), dead_error="CheckpointDiskFull: need ~2.0 MiB, 1.4 MiB free", dead_at=100.0)
    peer_proc = procs(1)
    peer = Child("drafter", 1, "cpu", popen=peer_proc, dead_error="RuntimeError: Connection closed by peer", dead_at=100.2)
    peer_proc.wait()
    assert first_failure([peer, first]) is first
    assert failure_line(first) == "drafter-0 reported: CheckpointDiskFull: need ~2.0 MiB, 1.4 MiB free"


def test_a_peer_whose_dead_report_is_in_flight_when_it_exits_is_not_named_as_the_cause(tmp_path, procs):
    """drafter-0 reported a full disk and is still closing; drafter-1's collective failed after it,
    and drafter-1 sent its Dead report over a real ZeroMQ socket, then exited 1. The supervisor saw
    the exit before reading the report: the report is drained before the exit counts as
    unreported, and the first failure by time is named (the fault suite once named drafter-1)."""
    import zmq

    from dflash_ipc.runtime.liveness import root_cause

    endpoint = f"ipc://{tmp_path}/reports.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(endpoint)
    try:
        sender = (
            "import sys, zmq\n"
            "s = zmq.Context().socket(zmq.PUSH)\n"
            f"s.connect({endpoint!r})\n"
            "s.send(b'RuntimeError: Connection closed by peer')\n"
            "s.close(linger=5000)\n"
            "sys.exit(1)\n"
        )
        peer_proc = subprocess.Popen([sys.executable, "-c", sender])
        peer_proc.wait(timeout=60)  # exited, its report unread
        first = Child("drafter", 0, "cpu", popen=procs(None), dead_error="CheckpointDiskFull: need ~2.0 MiB", dead_at=time.time() - 1)
        peer = Child("drafter", 1, "cpu", popen=peer_proc)
        drained: list[int] = []

        def drain(wait_ms: int) -> None:
            drained.append(wait_ms)
            if pull.poll(wait_ms):
                peer.dead_error, peer.dead_at = pull.recv().decode(), time.time()

        assert root_cause([first, peer], grace_s=0.5, drain=drain) is first
        assert peer.dead_error == "RuntimeError: Connection closed by peer" and drained
        silent_proc = procs(1)  # an exit code and no report at all: named once the wait for it ends
        silent = Child("drafter", 1, "cpu", popen=silent_proc)
        assert root_cause([first, silent], grace_s=0.5, drain=lambda wait_ms: time.sleep(wait_ms / 1000)) is silent
    finally:
        pull.close(linger=0)
        ctx.term()


def test_host_memory_text_reports_the_high_water_mark_of_a_freed_peak():
    """A real process touches 512 MiB, frees it, then reports: the peak keeps it, "now" does not."""
    code = (
        "import re, psutil\n"
        "from dflash_ipc.runtime.liveness import host_memory_text\n"
        "block = bytearray(512 * 2**20)\n"
        "block[::4096] = b'x' * len(block[::4096])\n"
        "del block\n"
        "print(host_memory_text(psutil.Process()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    now, peak = (float(x) for x in re.fullmatch(r"host RSS ([\d.]+) GiB \(peak so far ([\d.]+) GiB\)\n", out).groups())
    assert peak >= now + 0.45, out


def test_host_memory_text_appends_the_other_figures_it_is_given():
    """A role's phase line: host figures first, then a GPU's ("" on CPU, left out)."""
    text = host_memory_text(psutil.Process(), "", "GPU peak 1.0 GiB allocated")
    assert re.fullmatch(r"host RSS [\d.]+ GiB \(peak so far [\d.]+ GiB\); GPU peak 1\.0 GiB allocated", text), text
    assert host_memory_text(psutil.Process(), "").endswith("GiB)")
