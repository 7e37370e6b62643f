"""What a role's loop needs from its process (:class:`LoopIO`): its peers, the supervisor, a
way to wait, and liveness. ``procs/*`` hand their :class:`~dflash_ipc.runtime.child.ChildContext`
(real sockets, a heartbeat thread); the loop tests hand in-memory channels and run the same
loops in one process (``tests/loop_harness.py``)."""

from __future__ import annotations

from typing import Protocol

from dflash_ipc.control.protocol import Heartbeat, Message
from dflash_ipc.control.stats import Vitals


class StopState(Protocol):
    requested: bool
    reason: str


class LoopIO(Protocol):
    stop: StopState

    def drain_peers(self) -> list[tuple[int | None, Message]]:
        """Data-plane messages waiting, each with its sender's rank (None: not known)."""

    def read_control(self, wait_ms: int = 0) -> None:
        """Apply the supervisor's Shutdown (sets ``stop``), waiting up to ``wait_ms`` for one."""

    def wait(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for a message from a peer or the supervisor."""

    def send_to_supervisor(self, msg: Message) -> None:
        """Done: the loop's final report."""

    def report(self, beat: Heartbeat) -> None:
        """The loop's latest figures; the heartbeat goes out on its own clock, not the loop's."""

    def progressed(self) -> None:
        """The loop completed an iteration (the supervisor's stall rule reads the time since)."""

    def vitals(self, state: str, uptime_s: float) -> Vitals:
        """This process's state, uptime, memory and rejected messages."""
