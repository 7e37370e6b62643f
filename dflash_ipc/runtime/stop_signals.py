"""The signals that mean "checkpoint and stop" to every process of a run, whoever sends them.

A terminal's Ctrl-C, ``timeout``, ``kill -- -PGID``, a batch scheduler and systemd's control-group
kill all signal the whole process group (or cgroup) at once: the supervisor, the fork server, the
probe, every target and drafter and their sentinels. Each process of the tree gives the same answer:

* the supervisor (``up``) and every child that runs its role: the first one sets a stop request (a
  flag the main loop reads), the run checkpoints at an agreed step boundary and exits 0 (STOPPED);
* a child still importing its role and the probe: they end at once (nothing to save), and the
  supervisor, which had the signal too, reports a stop, not their exits;
* the fork server and each child's death sentinel: ignored. They end with the process they serve (the
  supervisor's EOF or death, the child's death), so the exits they report are never lost.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def install(on_stop: Callable[[str], None]) -> dict[int, Any]:
    """Every stop signal calls ``on_stop(name)`` ("SIGTERM", ...); returns the previous handlers, for :func:`restore`."""

    def on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001
        on_stop(signal.Signals(signum).name)

    return {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def ignore() -> None:
    """For a process whose life follows another's (the fork server, a sentinel): a group's stop is not its own."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def end_at_once() -> None:
    """For a process with nothing to save (the probe, a child still importing its role, a child just forked
    from a server that :func:`ignore`\\ s them): a stop signal ends it silently, as the kernel ends a process by
    SIGTERM, never a KeyboardInterrupt's traceback."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
