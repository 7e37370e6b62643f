"""Reading a run's status: live from the supervisor's endpoint, else its last snapshot.

Over ipc the endpoint is ``RUN_DIR/sock/status``; over tcp (``run.control = "tcp"``) it is named
in ``RUN_DIR/control.json`` and reached with the run's CURVE client keys (``control.plane``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import psutil
import zmq

from dflash_ipc.control import channels, curve
from dflash_ipc.control.plane import published_endpoints
from dflash_ipc.control.protocol import ProtocolError
from dflash_ipc.control.status import LIVE_STATES, StatusSnapshot, decode_status
from dflash_ipc.rundir import bounded_json

log = logging.getLogger(__name__)


class StatusUnavailable(RuntimeError):
    pass


def resolve_run_dir(path: Path) -> Path:
    """A run directory, or the newest run inside a folder of runs."""
    try:
        if (path / "status.json").exists() or (path / "run_id").exists():
            return path
        runs = [p for p in path.glob("*/status.json")] if path.is_dir() else []
        newest = max(runs, key=lambda p: p.stat().st_mtime).parent if runs else None
    except OSError as e:  # a name too long for the file system, a directory we may not read, ...
        raise StatusUnavailable(f"{_shown(path)}: cannot read it ({e.strerror or e})") from None
    if newest is None:
        raise StatusUnavailable(f"{_shown(path)} is not a run directory (no status.json) and holds no runs")
    return newest


def _shown(path: Path) -> str:
    """A path as text that can be printed, whatever bytes it holds (a non-UTF-8 name shows its escapes),
    the middle of a very long one elided."""
    text = os.fsencode(str(path)).decode("utf-8", "backslashreplace")
    return text if len(text) <= 200 else f"{text[:100]}...{text[-97:]} ({len(text)} characters)"


def read_status(path: Path, timeout_ms: int = 500) -> StatusSnapshot:
    """The live snapshot from the supervisor's endpoint, else the last ``status.json``; either is
    validated field by field (StatusUnavailable names the first bad field)."""
    run_dir = resolve_run_dir(path)
    live = _live_endpoint(run_dir)
    if live is not None:
        endpoint, keys = live
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if keys is not None:
                curve.curve_client(sock, keys)
                sock.ipv6 = endpoint.startswith("tcp://[")
            sock.connect(endpoint)
            sock.send(b"status")
            if sock.poll(timeout_ms):
                return _decode(sock.recv(), f"the status endpoint of {_shown(run_dir)}")
        except (zmq.ZMQError, UnicodeError) as e:  # an endpoint ZeroMQ cannot take (too long, not encodable): read status.json
            log.debug("status endpoint %r not reachable: %s", endpoint, e)
        finally:
            sock.close()
            ctx.term()
    path = run_dir / "status.json"
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise StatusUnavailable(f"{_shown(run_dir)} has no status.json yet (the run has not started)") from None
    except UnicodeDecodeError as e:
        raise StatusUnavailable(f"{_shown(path)} is not UTF-8 text ({e.reason} at byte {e.start}): not a status snapshot") from None
    except OSError as e:  # a directory, unreadable, ...
        raise StatusUnavailable(f"{_shown(path)}: cannot read it ({e.strerror or e})") from None
    snap = _decode(text, _shown(path))
    if snap.state in LIVE_STATES and not supervisor_alive(snap):
        return dataclasses.replace(snap, state="lost")
    return snap


def _live_endpoint(run_dir: Path) -> tuple[str, curve.RunKeys | None] | None:
    """The supervisor's status endpoint, with the CURVE keys it takes over tcp; None: none is served."""
    try:
        published = published_endpoints(run_dir)
    except ValueError as e:  # not UTF-8 or not JSON
        raise StatusUnavailable(f"{_shown(run_dir)}/control.json is not JSON: {e}") from None
    except OSError as e:
        raise StatusUnavailable(f"{_shown(run_dir)}/control.json: cannot read it ({e.strerror or e})") from None
    if published is None:
        try:
            sock_dir = channels.socket_dir(run_dir)
            # a socket directory another user could have made (RUN_DIR/sock links to /tmp) is not asked
            live = channels.is_own_private_dir(sock_dir) and (sock_dir / "status").exists()
            return (channels.status_endpoint(run_dir), None) if live else None
        except OSError:  # a sock link that cannot be read: no live endpoint to ask
            return None
    if not (isinstance(published, dict) and all(isinstance(published.get(k), str) for k in ("status", "key_root"))):
        raise StatusUnavailable(
            f"{_shown(run_dir)}/control.json is not what a supervisor publishes (an object naming status and key_root): "
            f"{json.dumps(published)[:80]}"
        )
    try:
        keys = curve.read_run_keys(Path(published["key_root"]))
    except (OSError, KeyError, ValueError) as e:
        raise StatusUnavailable(f"cannot read the CURVE keys of {run_dir} (run.control = tcp), needed to ask its supervisor: {e}") from None
    return published["status"], keys


def supervisor_alive(snap: StatusSnapshot) -> bool:
    """The snapshot's supervisor still runs (a pid reused by a later process does not count)."""
    try:
        proc = psutil.Process(snap.supervisor_pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= snap.started_unix + 1.0
    except psutil.Error:
        return False


def _decode(text: str | bytes, source: str) -> StatusSnapshot:
    try:
        return decode_status(bounded_json.loads(text))
    except ValueError as e:  # json.JSONDecodeError and ProtocolError are both ValueErrors
        what = "is not a status snapshot this dflash-ipc can read" if isinstance(e, ProtocolError) else "is not JSON"
        raise StatusUnavailable(f"{source} {what}: {e}") from None
