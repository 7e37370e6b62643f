"""The supervisor's record of each child process (``Child``) and how a group of them is ended
(``teardown``).

Teardown of the children still alive, in order: SIGKILL the stopped ones (state T cannot clean up),
Shutdown to every one, then SIGTERM (at once before the handshake ended, else after up to 5 s of
waiting on the Shutdown), SIGKILL after run.teardown_grace_s more, and a child not reaped
``UNREAPABLE_AFTER_S`` after its SIGKILL is reported and left behind, so `up` still exits.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash_ipc.control.protocol import Done
from dflash_ipc.control.stats import DrafterStats, TargetStats
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.forkserver import ForkedProcess

log = logging.getLogger(__name__)

UNREAPABLE_AFTER_S = 10.0  # a SIGKILLed child not reaped by then is reported and left: `up` still exits


@dataclass
class Child:
    role: str
    rank: int
    device: str
    popen: subprocess.Popen | ForkedProcess | None = None
    started: float = 0.0
    last_beat: float | None = None
    loop_age_s: float = 0.0  # the last heartbeat's: seconds since the child's loop last progressed
    stats: TargetStats | DrafterStats | None = None  # the latest heartbeat's figures (after Done: the final ones)
    done: Done | None = None
    dead_error: str | None = None
    dead_at: float = 0.0  # when it failed, by its Dead report: the first failure of a group is its cause
    unreaped: bool = False  # SIGKILLed and still not reaped (state D, a frozen cgroup): reported, left behind

    @property
    def name(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def key(self) -> tuple[str, int]:
        return (self.role, self.rank)


def teardown(
    children: list[Child], send_shutdown: Callable[[Child], None], grace_s: float, handshake_done: bool, echo: Callable[[str], None]
) -> None:
    """End every child still alive (the order is in the module docstring); ``send_shutdown`` sends one its Shutdown."""
    alive = [c for c in children if c.popen and c.popen.poll() is None]
    if not alive:
        return
    for ch in alive:
        if liveness.is_stopped(ch.popen):  # a stopped process cannot clean up: Shutdown and SIGTERM would only wait
            log.warning("%s is stopped (state T): SIGKILL", ch.name)
            ch.popen.kill()
    for ch in alive:
        send_shutdown(ch)
    # Before the handshake ended a child may still be importing or loading and read no
    # Shutdown: SIGTERM (a flag once its handler is in, else exit) at once.
    deadline = time.monotonic() + (min(grace_s, 5.0) if handshake_done else 0.0)
    while time.monotonic() < deadline and any(c.popen.poll() is None for c in alive):
        time.sleep(0.05)
    for ch in alive:
        if ch.popen.poll() is None:
            ch.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(c.popen.poll() is None for c in alive):
        time.sleep(0.05)
    for ch in alive:
        if ch.popen.poll() is None:
            log.warning("%s did not stop within %.0f s of SIGTERM: SIGKILL", ch.name, grace_s)
            ch.popen.kill()
    for ch in alive:
        if ch.popen.poll() is None and not liveness.reap_after_kill(ch.popen, UNREAPABLE_AFTER_S):
            ch.unreaped = True
            echo(
                f"[up] {ch.name} (pid {ch.popen.pid}) survived SIGKILL for {UNREAPABLE_AFTER_S:g} s "
                f"(uninterruptible sleep, state D, or a frozen cgroup?): left behind; it dies once it wakes"
            )
