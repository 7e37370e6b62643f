"""The sd_notify protocol: how the supervisor talks to systemd (a no-op outside it).

:func:`sd_notify` sends one datagram to ``$NOTIFY_SOCKET`` (a path, or an abstract socket when
it starts with ``@``) and is a no-op returning ``False`` when the variable is unset, so the
supervisor calls the helpers unconditionally:

- :func:`notify_ready` once every target and drafter has completed its handshake
  (the unit is ``Type=notify``, ``NotifyAccess=main``: only the supervisor process itself
  may send, so it must not be forwarded from a child);
- :func:`notify_watchdog` from the supervisor's heartbeat loop, at least every
  ``watchdog_interval_s() / 2`` seconds (systemd kills and restarts a supervisor that
  stays silent for ``WatchdogSec``);
- :func:`notify_status` for the one-line status ``systemctl status`` shows;
- :func:`notify_extend_timeout` while a slow start (model loading) or stop (checkpoint)
  needs more than ``TimeoutStartSec`` / ``TimeoutStopSec``;
- :func:`notify_stopping` when the shutdown (checkpoint, drain) begins.

Children must not inherit the notification variables: spawn them with :func:`scrub_notify_env`.
The unit files themselves are :mod:`dflash_ipc.ops.systemd_units`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _notify_address(value: str) -> bytes | None:
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    return None


def sd_notify(message: str) -> bool:
    """Send ``message`` (``KEY=VALUE`` lines) to the service manager.

    Returns ``True`` when the datagram was sent; ``False`` when ``$NOTIFY_SOCKET`` is unset
    (not running under systemd: a no-op) or the send failed (logged once, never raised:
    a notification must not take training down).
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    if not message:
        raise ValueError("sd_notify: empty message")
    addr = _notify_address(target)
    if addr is None:
        _warn_once("addr:" + target, "sd_notify: unsupported NOTIFY_SOCKET %r (need a path or @abstract)", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode("utf-8"), addr)
        return True
    except OSError as e:
        _warn_once("send:" + target, "sd_notify: cannot send to %s: %s", target, e)
        return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def notify_ready(status: str | None = None) -> bool:
    """``READY=1``: startup finished (all handshakes done); the unit becomes active."""
    return sd_notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_watchdog() -> bool:
    """``WATCHDOG=1``: keep-alive, sent from the supervisor's heartbeat."""
    return sd_notify("WATCHDOG=1")


def notify_stopping(status: str | None = None) -> bool:
    """``STOPPING=1``: shutdown (checkpoint, drain) has begun."""
    return sd_notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_status(text: str) -> bool:
    """``STATUS=...``: the free-form line ``systemctl status`` shows (newlines are folded)."""
    return sd_notify(f"STATUS={_one_line(text)}")


def notify_extend_timeout(seconds: float) -> bool:
    """``EXTEND_TIMEOUT_USEC``: ask for ``seconds`` more before the start/stop timeout fires."""
    return sd_notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")


def watchdog_interval_s() -> float | None:
    """The watchdog timeout (``WatchdogSec``) in seconds, or ``None`` when not enabled for
    this process (``WATCHDOG_USEC`` unset or invalid, or ``WATCHDOG_PID`` is another process).

    Send :func:`notify_watchdog` at least every half of this.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return value / 1_000_000


NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def scrub_notify_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) without the notification variables, for
    child processes: only the supervisor talks to systemd."""
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if k not in NOTIFY_ENV_VARS}
