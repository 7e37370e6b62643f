"""A child's heartbeat on its own clock: a thread that sends the loop's latest figures.

The role's loop hands its figures to :meth:`HeartbeatSender.report` when it gets to them (a
drafter after every step) and stamps :meth:`HeartbeatSender.progressed` after every iteration;
the thread sends the latest figures every ``interval_s``, and sooner when the loop reported new
ones (at most every ``interval_s / 4``, so status and progress show the step just taken), with
``loop_age_s`` (seconds since that stamp). So the supervisor tells two failures apart:

* no heartbeat for run.heartbeat_timeout_s: the process is gone, stopped (SIGSTOP) or frozen
  whole; a step that runs long (the first one compiles) does not silence it;
* heartbeats that say ``loop_age_s`` > run.stall_timeout_s: the process lives but its loop
  is stuck (a deadlock, a collective whose peer never comes).

States::

    IDLE ─start()─▶ BEATING (a beat at once, then every interval_s or on a new report, at most every
                       │     interval_s / 4; a full send queue drops a beat)
                       └─ close() / stop_beats() ─▶ STOPPED (joined; Done goes out after the last beat)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import zmq

from dflash_ipc.control.protocol import Heartbeat

log = logging.getLogger(__name__)


class HeartbeatSender:
    def __init__(self, send: Callable[[Heartbeat], None], interval_s: float):
        self._send = send
        self.interval_s = interval_s
        self._latest: Heartbeat | None = None
        self._progress = time.monotonic()
        self._stop = threading.Event()
        self._fresh = threading.Event()  # a new report since the last beat
        self._thread: threading.Thread | None = None
        self.sent = 0

    def report(self, beat: Heartbeat) -> None:
        self._latest = beat  # one reference swap: the thread reads a whole message or the previous one
        self._fresh.set()

    def progressed(self) -> None:
        self._progress = time.monotonic()

    @property
    def loop_age_s(self) -> float:
        return max(0.0, time.monotonic() - self._progress)

    def start(self) -> None:
        if self._thread is None:
            self._progress = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._fresh.clear()
            beat = self._latest
            if beat is not None:
                try:
                    self._send(dataclasses.replace(beat, loop_age_s=self.loop_age_s))
                    self.sent += 1
                except zmq.Again:
                    pass  # the supervisor is not reading: a dropped beat, the next one follows
                except zmq.ZMQError as e:  # the socket closed under us: the process is ending
                    log.debug("heartbeat thread stops: %s", e)
                    return
            if self._stop.wait(self.interval_s / 4):
                return
            self._fresh.wait(self.interval_s * 3 / 4)  # a new report sends sooner
            if self._stop.is_set():
                return

    def close(self) -> None:
        """Stop beating (before Done, so no beat follows the final report); idempotent."""
        self._stop.set()
        self._fresh.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
