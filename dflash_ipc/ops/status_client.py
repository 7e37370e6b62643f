"""Reading a run's status: live from the supervisor's endpoint, else its last snapshot.

Over ipc the endpoint is ``RUN_DIR/sock/status``; over tcp (``run.control = "tcp"``) it is named
in ``RUN_DIR/control.json`` and reached with the run's CURVE client keys (``control.plane``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import psutil
import zmq

from dflash_ipc.control import channels, curve
from dflash_ipc.control.plane import published_endpoints
from dflash_ipc.control.protocol import ProtocolError
from dflash_ipc.control.status import LIVE_STATES, StatusSnapshot, decode_status


class StatusUnavailable(RuntimeError):
    pass


def resolve_run_dir(path: Path) -> Path:
    """A run directory, or the newest run inside a folder of runs."""
    if (path / "status.json").exists() or (path / "run_id").exists():
        return path
    runs = [p for p in path.glob("*/status.json")] if path.is_dir() else []
    if not runs:
        raise StatusUnavailable(f"{path} is not a run directory (no status.json) and holds no runs")
    return max(runs, key=lambda p: p.stat().st_mtime).parent


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
                return _decode(sock.recv(), f"the status endpoint of {run_dir}")
        finally:
            sock.close()
            ctx.term()
    try:
        text = (run_dir / "status.json").read_text()
    except FileNotFoundError:
        raise StatusUnavailable(f"{run_dir} has no status.json yet (the run has not started)") from None
    snap = _decode(text, str(run_dir / "status.json"))
    if snap.state in LIVE_STATES and not supervisor_alive(snap):
        return dataclasses.replace(snap, state="lost")
    return snap


def _live_endpoint(run_dir: Path) -> tuple[str, curve.RunKeys | None] | None:
    """The supervisor's status endpoint, with the CURVE keys it takes over tcp; None: none is served."""
    try:
        published = published_endpoints(run_dir)
    except ValueError as e:
        raise StatusUnavailable(f"{run_dir}/control.json is not JSON: {e}") from None
    if published is None:
        ipc = channels.socket_dir(run_dir) / "status"
        return (channels.status_endpoint(run_dir), None) if ipc.exists() else None
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
        return decode_status(json.loads(text))
    except ValueError as e:  # json.JSONDecodeError and ProtocolError are both ValueErrors
        what = "is not a status snapshot this dflash-ipc can read" if isinstance(e, ProtocolError) else "is not JSON"
        raise StatusUnavailable(f"{source} {what}: {e}") from None
