"""What the supervisor knows about a child's life: how it exited, whether the kernel reports it
stopped, which child to blame when heartbeats stop, and its line in the status snapshot."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from dflash_ipc.control.stats import DrafterStats, TargetStats
from dflash_ipc.control.status import ProcessStatus, SlotCounts
from dflash_ipc.transport.shm_names import SHM_DIR, shm_free_bytes


def host_memory_text(proc: psutil.Process, *more: str) -> str:
    """This process's host memory now and its high-water mark so far, then each non-empty ``more``
    (a GPU's figures: :func:`dflash_ipc.platform.devices.gpu_memory_text`), for the phase lines of a role's
    log: where a peak happened is then read from the log, not guessed."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    host = f"host RSS {proc.memory_info().rss / 2**30:.2f} GiB (peak so far {peak_kib / 2**20:.2f} GiB)"
    return "; ".join((host, *filter(None, more)))


def cpu_shares_for(n_children: int) -> list[list[int]] | None:
    """Split this process's CPU cores into n contiguous shares (None if there are too few)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * n_children:
        return None
    size = len(cores) // n_children
    return [cores[i * size : (i + 1) * size] for i in range(n_children)]


def failure_text(what: str, children: list, logs_dir: Path, ch: Any = None) -> str:
    """``what`` went wrong, with the blamed child's exit, a shared-memory hint and its log's tail."""
    if ch is None:
        ch = next((c for c in children if c.name in what), None)
    text = what
    if ch is not None:
        if ch.popen is not None and ch.popen.poll() is not None and describe_exit(ch.popen.returncode) not in text:
            text += f" [{describe_exit(ch.popen.returncode)}]"
        text += shm_exhaustion_hint(ch.popen.returncode if ch.popen is not None else None)
        text += f"\n  last lines of {logs_dir}/{ch.name}.log:\n{log_tail(logs_dir / f'{ch.name}.log')}"
    return text


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code == -signal.SIGBUS:  # a write to a tmpfs page that could not be allocated
        return f"killed by signal SIGBUS: shared-memory exhaustion (most likely {SHM_DIR} ran out while a ring was written)"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def shm_exhaustion_hint(code: int | None) -> str:
    """For a child killed by SIGBUS: /dev/shm's free space now and what to change; else ""."""
    if code != -signal.SIGBUS:
        return ""
    return (
        f"\n  {SHM_DIR} has {shm_free_bytes()} bytes free now: enlarge it (docker: --shm-size), remove leftovers of "
        f"killed runs ({SHM_DIR}/dflash-ipc-*), or lower transport.ring_slots / data.token_budget"
    )


def is_stopped(popen: subprocess.Popen | None) -> bool:
    """The kernel reports the process stopped (SIGSTOP/SIGTSTP or a tracer): state T or t."""
    if popen is None or popen.poll() is not None:
        return False
    try:
        return psutil.Process(popen.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join("    " + ln for ln in text[-lines:])


def exited_child(children: list, stopping: bool = False) -> Any | None:
    """The exited child (without a Done) that explains a failure, or None. While ``stopping``, a
    target's clean exit is expected: it may have had the signal too (a terminal's Ctrl-C reaches
    the whole foreground process group)."""
    exited = _exited(children, stopping)
    # The likely cause first: killed by a signal, else exited without a Dead report. Peers
    # report Dead ("connection closed by peer" from gloo) and exit because of it.
    return min(exited, key=lambda c: (c.popen.returncode >= 0, c.dead_error is not None), default=None)


def exit_text(ch: Any) -> str:
    """The failure line of an exited child."""
    text = f"{ch.name} (pid {ch.popen.pid}) {describe_exit(ch.popen.returncode)}"
    return text + (f" after reporting: {ch.dead_error}" if ch.dead_error else "")


def first_failure(children: list, stopping: bool = False) -> Any | None:
    """The child whose failure came first, or None: the root cause, not its consequences.

    An exit nobody reported (a signal, an exit without a Dead report) comes first: it explains
    the reports of its peers ("connection closed by peer" from gloo). Otherwise the earliest Dead
    report by the time its child failed: the peer that failed first (disk full, out of memory)
    also exits later than the peers it takes down, while it closes its rings."""
    unreported = [c for c in children if c.dead_error is None and c in _exited(children, stopping)]
    if unreported:
        return min(unreported, key=lambda c: c.popen.returncode >= 0)
    reporters = [c for c in children if c.dead_error is not None and c.done is None]
    return min(reporters, key=lambda c: c.dead_at, default=None)


def _exited(children: list, stopping: bool) -> list:
    return [
        c
        for c in children
        if c.popen is not None and c.popen.poll() is not None and c.done is None
        if not (stopping and c.role == "target" and c.popen.returncode == 0)
    ]


def failure_line(ch: Any) -> str:
    """:func:`first_failure`'s child in words: its exit (and report), or its report while it still runs."""
    if ch.popen is not None and ch.popen.poll() is not None:
        return exit_text(ch)
    return f"{ch.name} reported: {ch.dead_error}"


def root_cause(
    children: list,
    stopping: bool = False,
    grace_s: float = 1.0,
    drain: Callable[[int], None] | None = None,
    report_wait_ms: int = 300,
) -> Any | None:
    """:func:`first_failure`, after waiting up to ``grace_s`` for an unreported exit to show.

    A peer's SIGKILL reaches the survivors' collectives ("connection closed by peer") within
    milliseconds, while the killed process, tearing down its mappings, can take longer to become
    a zombie the supervisor sees: blaming the first reporter named the wrong process.

    ``drain(wait_ms)`` reads the reports in flight (the supervisor's router) while it waits. A
    child that exited with a code, not a signal, sent its Dead report before it exited: that
    report may still be in flight, so it is waited for up to ``report_wait_ms`` before the exit
    counts as unreported (without it, the peer a full disk took down was named as the cause)."""
    drain = drain or (lambda wait_ms: time.sleep(wait_ms / 1000))
    deadline = time.monotonic() + grace_s
    while True:
        first = first_failure(children, stopping)
        if first is not None and first.dead_error is None and first.popen.returncode >= 0:
            drain(report_wait_ms)
            first = first_failure(children, stopping)
        if (first is not None and first.dead_error is None) or time.monotonic() >= deadline:
            return first
        drain(10)


def reap_after_kill(popen: Any, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a SIGKILLed process to be reaped; False if it was not (a
    process in uninterruptible sleep, state D, or in a frozen cgroup dies only once it wakes)."""
    try:
        popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def wait_for_exits(children: list, timeout: float) -> list:
    """Wait up to ``timeout`` s in all for ``children`` that reported Done to exit; returns those
    still running (the teardown stops them: a slow exit after Done is no failure of the run)."""
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [c for c in children if c.popen.poll() is None]


def silent_child(children: list, now: float, timeout: float) -> tuple[Any, str] | None:
    """The child to blame when heartbeats stopped: one the kernel reports stopped (SIGSTOP)
    first, else the one silent longest (its peers go quiet later, waiting for it)."""
    overdue = [c for c in children if c.done is None and c.popen.poll() is None and c.last_beat is not None and now - c.last_beat > timeout]
    if not overdue:
        return None
    stopped = [c for c in children if c.done is None and is_stopped(c.popen)]
    ch = stopped[0] if stopped else min(overdue, key=lambda c: c.last_beat)
    age = now - ch.last_beat
    why = " (stopped: state T, e.g. SIGSTOP)" if stopped else ""
    others = [c.name for c in overdue if c is not ch]
    text = f"{ch.name} (pid {ch.popen.pid}) stopped answering{why}: no heartbeat for {age:.1f} s (run.heartbeat_timeout_s = {timeout:g})"
    return ch, text + (f"; silent since, waiting for it: {', '.join(others)}" if others else "")


def stalled_child(children: list, now: float, timeout: float) -> tuple[Any, str] | None:
    """The child to blame when one lives (its heartbeat thread beats) but its loop stopped moving:
    the one stalled longest (its peers in a collective stall later, waiting for it)."""
    ages = [
        (c.loop_age_s + (now - c.last_beat), c) for c in children if c.done is None and c.last_beat is not None and c.popen.poll() is None
    ]
    stalled = [(age, c) for age, c in ages if age > timeout]
    if not stalled:
        return None
    age, ch = max(stalled, key=lambda item: item[0])
    text = f"{ch.name} (pid {ch.popen.pid}) is alive but its loop made no progress for {age:.1f} s (run.stall_timeout_s = {timeout:g})"
    others = [c.name for _, c in stalled if c is not ch]
    return ch, text + (f"; stalled since, waiting for it: {', '.join(others)}" if others else "")


def process_status(ch: Any, now: float, now_m: float) -> ProcessStatus:
    """One child's line in the status snapshot (``ch``: the supervisor's Child record)."""
    s = ch.stats
    vitals = s.vitals if s is not None else None
    pid = ch.popen.pid if ch.popen else None
    code = ch.popen.poll() if ch.popen else None
    rss = vitals.rss_bytes if vitals else None
    if pid and code is None:
        try:
            rss = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    target = s if isinstance(s, TargetStats) else None
    drafter = s if isinstance(s, DrafterStats) else None
    gpu = target.work.gpu if target else drafter.work.gpu if drafter else None
    slots = target.plane.slots if target else None
    if code is not None:  # exited: nothing of it is live any more; a drafter's final step and loss stay
        return _exited_status(ch, pid, code, drafter, vitals)
    return ProcessStatus(
        role=ch.role,
        rank=ch.rank,
        pid=pid,
        device=ch.device,
        state="exited" if code is not None else ("done" if ch.done is not None else (vitals.state if vitals else "starting")),
        uptime_s=max(0.0, now - ch.started) if ch.started else 0.0,
        heartbeat_age_s=(now_m - ch.last_beat) if ch.last_beat is not None else None,
        tokens_per_s=s.work.tokens_per_s if s is not None else 0.0,
        slots=SlotCounts(free=slots.free, filling=slots.filling + slots.queued, ready=slots.ready, copying=0) if slots else None,
        inflight_per_drafter=target.plane.inflight_per_drafter if target else None,
        queue_depth=drafter.queue_depth if drafter else None,
        step=drafter.work.step if drafter else None,
        loss=drafter.work.loss if drafter else None,
        gpu_mem_allocated_bytes=gpu.allocated_bytes if gpu else None,
        gpu_mem_reserved_bytes=gpu.reserved_bytes if gpu else None,
        rss_bytes=rss,
        rejected_messages=vitals.rejected_messages if vitals else 0,
        rejected_by_kind=dict(vitals.rejected_by_kind) if vitals else {},
        busy_pct=target.work.busy_pct if target else None,
        wait_pct=min(100.0, drafter.wait_pct) if drafter else None,
        exit_code=code,
        anchors_per_batch=drafter.work.anchors if drafter else None,
        tau_holdout=drafter.work.tau_holdout if drafter else None,
    )


def _exited_status(ch: Any, pid: int | None, code: int, drafter: DrafterStats | None, vitals: Any) -> ProcessStatus:
    """An exited child's line: no heartbeat age, slots, queue, rate or memory (they described a live process)."""
    return ProcessStatus(
        role=ch.role,
        rank=ch.rank,
        pid=pid,
        device=ch.device,
        state="exited",
        uptime_s=0.0,
        heartbeat_age_s=None,
        tokens_per_s=0.0,
        slots=None,
        inflight_per_drafter=None,
        queue_depth=None,
        step=drafter.work.step if drafter else None,
        loss=drafter.work.loss if drafter else None,
        gpu_mem_allocated_bytes=None,
        gpu_mem_reserved_bytes=None,
        rss_bytes=None,
        rejected_messages=vitals.rejected_messages if vitals else 0,  # what it refused while it ran still counts
        rejected_by_kind=dict(vitals.rejected_by_kind) if vitals else {},
        busy_pct=None,
        wait_pct=None,
        exit_code=code,
    )
