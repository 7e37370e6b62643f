"""The status snapshot: its schema, a validator, and three renderings.

The supervisor produces one status snapshot (a plain dict, JSON-serialisable) describing
the run and every process in it; this module validates it (:func:`validate_status`) and
renders it as a human table (:func:`render_table`), as Prometheus text exposition
(:func:`render_prometheus`) or as JSON (:func:`render_json`).

Schema, version 1 (every key is required; ``X | None`` means the value may be ``null``;
``int`` never accepts ``bool``; ``float`` accepts ``int``)::

    {
      "schema": 1,
      "run_dir": str,                 # the run directory
      "state": "starting" | "running" | "stopping" | "finished" | "failed",
      "updated_unix": float,          # when this snapshot was taken (time.time())
      "supervisor_pid": int,
      "config": str,                  # the config file (or name)
      "started_unix": float,          # when the supervisor started
      "totals": {
        "tokens_per_s": float,        # training throughput of the whole pipeline
        "step": int,                  # optimizer steps done
        "max_steps": int | None,      # None: until the data is exhausted
        "loss": float | None,         # latest loss (may be NaN)
        "pipeline_rss_bytes": int,    # RSS of the supervisor and all its processes
        "eta_s": float | None
      },
      "processes": [                  # one entry per target / drafter process
        {
          "role": "target" | "drafter",
          "rank": int,                # index within its role; (role, rank) is unique
          "pid": int | None,          # None: not started (yet)
          "device": str,              # "cpu", "cuda:0", ...
          "state": str,               # free-form: "starting", "running", "exited", ...
          "uptime_s": float,
          "heartbeat_age_s": float | None,   # seconds since its last heartbeat
          "tokens_per_s": float,
          "slots": {"free": int, "filling": int, "ready": int, "copying": int} | None,  # targets
          "inflight_per_drafter": [int, ...] | None,   # targets: slots outstanding per drafter
          "queue_depth": int | None,  # drafters: batches waiting to be trained on
          "step": int | None,         # drafters
          "loss": float | None,       # drafters (may be NaN)
          "gpu_mem_allocated_bytes": int | None,
          "gpu_mem_reserved_bytes": int | None,
          "rss_bytes": int | None,
          "rejected_messages": int,   # control messages refused (bad/unexpected)
          "busy_pct": float | None,   # share of wall time computing, 0..100
          "wait_pct": float | None,   # share of wall time waiting for input, 0..100
          "exit_code": int | None     # None while running
        }
      ]
    }

Counts, sizes, rates and durations must be >= 0 and finite; percentages in [0, 100];
only the two ``loss`` fields may be NaN or infinite. Unknown keys are reported as problems
too (with the closest valid name), so a misspelt field cannot go unnoticed.

In the table, memory sizes use binary units (``12.3G`` = 12.3 GiB) and rates SI
suffixes (``18.2k`` tok/s). In Prometheus output every metric is a gauge named
``dflash_ipc_...``; per-process metrics carry the labels ``role``, ``rank`` and
``device``; ``None`` values are left out (no sample) rather than invented.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
RUN_STATES = ("starting", "running", "stopping", "finished", "failed")
ROLES = ("target", "drafter")
SLOT_STATES = ("free", "filling", "ready", "copying")
FORMATS = ("table", "json", "prometheus")
TABLE_WIDTH = 100

# --------------------------------------------------------------------------- schema


class _Spec:
    def check(self, value: Any, path: str, problems: list[str]) -> None:  # pragma: no cover
        raise NotImplementedError


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


class _Int(_Spec):
    def __init__(self, min: int | None = None, eq: int | None = None):
        self.min, self.eq = min, eq

    def check(self, value, path, problems):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected int, got {_tname(value)} {value!r}")
        elif self.eq is not None and value != self.eq:
            problems.append(f"{path}: must be {self.eq} (got {value})")
        elif self.min is not None and value < self.min:
            problems.append(f"{path}: must be >= {self.min} (got {value})")


class _Float(_Spec):
    def __init__(self, min: float | None = None, max: float | None = None, nonfinite: bool = False):
        self.min, self.max, self.nonfinite = min, max, nonfinite

    def check(self, value, path, problems):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected float, got {_tname(value)} {value!r}")
            return
        if not math.isfinite(value):
            if not self.nonfinite:
                problems.append(f"{path}: must be finite (got {value})")
            return
        if self.min is not None and value < self.min:
            problems.append(f"{path}: must be >= {self.min:g} (got {value})")
        if self.max is not None and value > self.max:
            problems.append(f"{path}: must be <= {self.max:g} (got {value})")


class _Str(_Spec):
    def __init__(self, nonempty: bool = False):
        self.nonempty = nonempty

    def check(self, value, path, problems):
        if not isinstance(value, str):
            problems.append(f"{path}: expected str, got {_tname(value)} {value!r}")
        elif self.nonempty and not value:
            problems.append(f"{path}: must not be empty")


class _Enum(_Spec):
    def __init__(self, choices: tuple[str, ...]):
        self.choices = choices

    def check(self, value, path, problems):
        if value not in self.choices or not isinstance(value, str):
            problems.append(f"{path}: must be one of {', '.join(map(repr, self.choices))} (got {value!r})")


class _Opt(_Spec):
    def __init__(self, inner: _Spec):
        self.inner = inner

    def check(self, value, path, problems):
        if value is not None:
            self.inner.check(value, path, problems)


class _List(_Spec):
    def __init__(self, item: _Spec):
        self.item = item

    def check(self, value, path, problems):
        if not isinstance(value, list):
            problems.append(f"{path}: expected list, got {_tname(value)}")
            return
        for i, v in enumerate(value):
            self.item.check(v, f"{path}[{i}]", problems)


class _Obj(_Spec):
    def __init__(self, fields: Mapping[str, _Spec]):
        self.fields = dict(fields)

    def check(self, value, path, problems):
        if not isinstance(value, dict):
            problems.append(f"{path or 'status'}: expected object, got {_tname(value)}")
            return
        prefix = f"{path}." if path else ""
        for key, spec in self.fields.items():
            if key not in value:
                problems.append(f"{prefix}{key}: missing")
            else:
                spec.check(value[key], prefix + key, problems)
        for key in value:
            if key not in self.fields:
                close = difflib.get_close_matches(str(key), list(self.fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(f"{prefix}{key}: unknown key{hint}")


_COUNT = _Int(min=0)
_NONNEG = _Float(min=0)
_PCT = _Opt(_Float(min=0, max=100))

TOTALS_SPEC = _Obj({
    "tokens_per_s": _NONNEG,
    "step": _COUNT,
    "max_steps": _Opt(_COUNT),
    "loss": _Opt(_Float(nonfinite=True)),
    "pipeline_rss_bytes": _COUNT,
    "eta_s": _Opt(_NONNEG),
})

PROCESS_SPEC = _Obj({
    "role": _Enum(ROLES),
    "rank": _COUNT,
    "pid": _Opt(_Int(min=1)),
    "device": _Str(nonempty=True),
    "state": _Str(nonempty=True),
    "uptime_s": _NONNEG,
    "heartbeat_age_s": _Opt(_NONNEG),
    "tokens_per_s": _NONNEG,
    "slots": _Opt(_Obj({k: _COUNT for k in SLOT_STATES})),
    "inflight_per_drafter": _Opt(_List(_COUNT)),
    "queue_depth": _Opt(_COUNT),
    "step": _Opt(_COUNT),
    "loss": _Opt(_Float(nonfinite=True)),
    "gpu_mem_allocated_bytes": _Opt(_COUNT),
    "gpu_mem_reserved_bytes": _Opt(_COUNT),
    "rss_bytes": _Opt(_COUNT),
    "rejected_messages": _COUNT,
    "busy_pct": _PCT,
    "wait_pct": _PCT,
    "exit_code": _Opt(_Int()),
})

STATUS_SPEC = _Obj({
    "schema": _Int(eq=SCHEMA_VERSION),
    "run_dir": _Str(),
    "state": _Enum(RUN_STATES),
    "updated_unix": _NONNEG,
    "supervisor_pid": _Int(min=1),
    "config": _Str(),
    "started_unix": _NONNEG,
    "totals": TOTALS_SPEC,
    "processes": _List(PROCESS_SPEC),
})


def validate_status(d: Any) -> list[str]:
    """Problems with a status snapshot, each ``dotted.path: what is wrong``; ``[]`` if valid."""
    problems: list[str] = []
    STATUS_SPEC.check(d, "", problems)
    if problems or not isinstance(d, dict):
        return problems
    seen: set[tuple[str, int]] = set()
    for i, p in enumerate(d["processes"]):
        key = (p["role"], p["rank"])
        if key in seen:
            problems.append(f"processes[{i}]: duplicate {p['role']} rank {p['rank']}")
        seen.add(key)
    if d["started_unix"] > d["updated_unix"]:
        problems.append("started_unix: later than updated_unix")
    return problems


def example_status(n_targets: int = 1, n_drafters: int = 1, *, now: float | None = None) -> dict[str, Any]:
    """A valid, fully populated snapshot (for tests, docs and the supervisor's authors)."""
    now = time.time() if now is None else now
    procs: list[dict[str, Any]] = []
    for r in range(n_targets):
        procs.append({
            "role": "target", "rank": r, "pid": 20000 + r, "device": f"cuda:{r}", "state": "running",
            "uptime_s": 3725.0, "heartbeat_age_s": 0.4, "tokens_per_s": 9100.0 + r,
            "slots": {"free": 1, "filling": 1, "ready": 1, "copying": 1},
            "inflight_per_drafter": [1] * n_drafters,
            "queue_depth": None, "step": None, "loss": None,
            "gpu_mem_allocated_bytes": 30 * 2**30, "gpu_mem_reserved_bytes": 34 * 2**30,
            "rss_bytes": 6 * 2**30, "rejected_messages": 0, "busy_pct": 91.0, "wait_pct": 6.5,
            "exit_code": None,
        })
    for r in range(n_drafters):
        procs.append({
            "role": "drafter", "rank": r, "pid": 21000 + r, "device": f"cuda:{n_targets + r}",
            "state": "running", "uptime_s": 3724.0, "heartbeat_age_s": 0.7, "tokens_per_s": 18200.0 / n_drafters,
            "slots": None, "inflight_per_drafter": None,
            "queue_depth": 1, "step": 1234, "loss": 2.3456,
            "gpu_mem_allocated_bytes": 41 * 2**30, "gpu_mem_reserved_bytes": 52 * 2**30,
            "rss_bytes": 5 * 2**30, "rejected_messages": 0, "busy_pct": 84.0, "wait_pct": 12.0,
            "exit_code": None,
        })
    return {
        "schema": SCHEMA_VERSION, "run_dir": "/var/lib/dflash-ipc/runs/example", "state": "running",
        "updated_unix": now, "supervisor_pid": 19999, "config": "/etc/dflash-ipc/example.toml",
        "started_unix": now - 3730.0,
        "totals": {
            "tokens_per_s": 18200.0, "step": 1234, "max_steps": 10000, "loss": 2.3456,
            "pipeline_rss_bytes": sum(p["rss_bytes"] for p in procs) + 2**29, "eta_s": 11520.0,
        },
        "processes": procs,
    }


# --------------------------------------------------------------------------- formatting


def fmt_bytes(n: int | float | None, *, long: bool = False) -> str:
    """``12.3G`` (binary units); ``long=True``: ``12.3 GiB``. At most 5 characters short."""
    if n is None:
        return "-"
    v = float(n)
    units = ("B", "K", "M", "G", "T", "P", "E")
    i = 0
    while abs(v) >= 999.5 and i < len(units) - 1:
        v /= 1024
        i += 1
    num = f"{v:.0f}" if (i == 0 or abs(v) >= 99.95) else f"{v:.1f}"
    if long:
        return f"{num} {units[i] if i == 0 else units[i] + 'iB'}"
    return num + units[i]


def fmt_rate(x: float | None) -> str:
    """``950``, ``9.12k``, ``18.2k``, ``182k``, ``1.82M``: at most 5 characters."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 999.5e18:
        return f"{x:.0e}"
    for div, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div * 0.9995:
            v = x / div
            if abs(v) >= 99.95:
                return f"{v:.0f}{suffix}"
            return f"{v:.1f}{suffix}" if abs(v) >= 9.995 else f"{v:.2f}{suffix}"
    return f"{x:.0f}" if abs(x) >= 9.95 or x == 0 else f"{x:.1f}"


def fmt_duration(s: float | None) -> str:
    """``0.4s``, ``42s``, ``12m05s``, ``3h07m``, ``4d03h``, ``123d``: at most 6 characters."""
    if s is None:
        return "-"
    if not math.isfinite(s):
        return str(s)
    if s < 0:
        return "-" + fmt_duration(-s)
    if s < 9.95:
        return f"{s:.1f}s"
    t = int(round(s))
    if t < 60:
        return f"{t}s"
    if t < 3600:
        return f"{t // 60}m{t % 60:02d}s"
    if t < 86400:
        return f"{t // 3600}h{(t % 3600) // 60:02d}m"
    if t < 100 * 86400:
        return f"{t // 86400}d{(t % 86400) // 3600:02d}h"
    return f"{t // 86400}d"


def fmt_loss(x: float | None) -> str:
    """A loss in at most 6 characters."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x)
    if a >= 1e4 or (0 < a < 1e-3):
        return f"{x:.0e}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 10:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _fit(text: str, width: int) -> str:
    """Shorten ``text`` to ``width`` characters: eliding the middle ("...") when there is
    room for both ends (paths), else cutting the tail ("~")."""
    if len(text) <= width:
        return text
    if width < 16:
        return text[: width - 1] + "~" if width > 1 else text[:width]
    keep = width - 3
    return text[: keep // 2] + "..." + text[len(text) - (keep - keep // 2):]


def _proc_name(p: Mapping[str, Any]) -> str:
    return f"{p['role']}{p['rank']}"


def _sorted_procs(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    order = {r: i for i, r in enumerate(ROLES)}
    return sorted(status.get("processes", []), key=lambda p: (order.get(p.get("role"), 9), p.get("rank", 0)))


def _work(p: Mapping[str, Any]) -> str:
    if p.get("slots") is not None:
        s = p["slots"]
        text = "/".join(str(s.get(k, "?")) for k in SLOT_STATES)
        inflight = p.get("inflight_per_drafter")
        if inflight is not None:
            with_inflight = f"{text} i{sum(inflight)}"
            if len(with_inflight) <= 12:
                text = with_inflight
        return text
    parts = []
    if p.get("queue_depth") is not None:
        parts.append(f"q{p['queue_depth']}")
    if p.get("step") is not None:
        parts.append(f"s{p['step']}")
    if len(" ".join(parts)) > 12:
        parts = parts[:1]
    return " ".join(parts) or "-"


def _gpu(p: Mapping[str, Any]) -> str:
    a, r = p.get("gpu_mem_allocated_bytes"), p.get("gpu_mem_reserved_bytes")
    if a is None and r is None:
        return "-"
    if a is None or r is None:
        return fmt_bytes(a if r is None else r)
    big = fmt_bytes(max(a, r))
    unit = big[-1]
    scale = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50, "E": 2**60}[unit]

    def num(x: int) -> str:
        v = x / scale
        return f"{v:.0f}" if (unit == "B" or v >= 99.95) else f"{v:.1f}"

    return f"{num(a)}/{num(r)}{unit}"


def _busy_wait(p: Mapping[str, Any]) -> str:
    b, w = p.get("busy_pct"), p.get("wait_pct")
    if b is None and w is None:
        return "-"
    f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    return f"{f(b)}/{f(w)}"


# (header, max width, right-aligned, cell function)
_COLUMNS: list[tuple[str, int, bool, Callable[[Mapping[str, Any]], str]]] = [
    ("PROC", 9, False, _proc_name),
    ("PID", 7, True, lambda p: "-" if p.get("pid") is None else str(p["pid"])),
    ("DEVICE", 7, False, lambda p: str(p.get("device", "?"))),
    ("STATE", 8, False, lambda p: str(p.get("state", "?"))),
    ("UP", 6, True, lambda p: fmt_duration(p.get("uptime_s"))),
    ("HB", 6, True, lambda p: fmt_duration(p.get("heartbeat_age_s"))),
    ("TOK/S", 5, True, lambda p: fmt_rate(p.get("tokens_per_s"))),
    ("WORK", 12, False, _work),
    ("LOSS", 6, True, lambda p: fmt_loss(p.get("loss"))),
    ("GPU MEM", 10, True, _gpu),
    ("RSS", 5, True, lambda p: fmt_bytes(p.get("rss_bytes"))),
    ("B/W%", 7, True, _busy_wait),
]

LEGEND = (
    "WORK: target slots free/filling/ready/copying + in flight (i); drafter queue (q), step (s)",
    "HB: heartbeat age. GPU MEM: allocated/reserved. B/W%: busy/waiting share of wall time",
)


def render_table(
    status: Mapping[str, Any],
    *,
    now: float | None = None,
    width: int = TABLE_WIDTH,
    legend: bool = True,
    stale_after_s: float = 30.0,
    heartbeat_warn_s: float = 10.0,
) -> str:
    """A compact human-readable table: a run header, one line per process, totals, then
    warnings (exit codes, stale heartbeats, rejected messages). No line exceeds ``width``."""
    now = time.time() if now is None else now
    lines: list[str] = []
    state = str(status.get("state", "?"))
    updated = status.get("updated_unix")
    age = None if updated is None else max(0.0, now - updated)
    head = [f"dflash-ipc  {state.upper()}"]
    if age is not None and age > stale_after_s and state not in ("finished", "failed"):
        head.append("STALE")
    if status.get("supervisor_pid") is not None:
        head.append(f"pid {status['supervisor_pid']}")
    if status.get("started_unix") is not None and updated is not None:
        head.append(f"up {fmt_duration(max(0.0, updated - status['started_unix']))}")
    if age is not None:
        head.append(f"updated {fmt_duration(age)} ago")
    head_text = "  ".join(head)
    config = str(status.get("config", ""))
    config_in_head = bool(config) and len(head_text) + len("  config ") + len(config) <= width
    if config_in_head:
        head_text += f"  config {config}"
    lines.append(_fit(head_text, width))
    lines.append(_fit(f"run dir  {status.get('run_dir', '?')}", width))
    if config and not config_in_head:
        lines.append(_fit(f"config   {config}", width))
    lines.append("")

    procs = _sorted_procs(status)
    cells = [[_fit(fn(p), w) for (_, w, _, fn) in _COLUMNS] for p in procs]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (h, _, _, _) in enumerate(_COLUMNS)]

    def fmt_row(row: Iterable[str]) -> str:
        out = []
        for text, w, (_, _, right, _) in zip(row, widths, _COLUMNS):
            out.append(text.rjust(w) if right else text.ljust(w))
        return " ".join(out).rstrip()

    lines.append(fmt_row(h for (h, _, _, _) in _COLUMNS))
    for row in cells:
        lines.append(fmt_row(row))
    if not procs:
        lines.append("(no processes)")

    t = status.get("totals") or {}
    total = [f"TOTAL  {fmt_rate(t.get('tokens_per_s'))} tok/s"]
    step, max_steps = t.get("step"), t.get("max_steps")
    if step is not None:
        if max_steps:
            total.append(f"step {step:,}/{max_steps:,} ({100.0 * step / max_steps:.1f}%)")
        else:
            total.append(f"step {step:,}")
    if t.get("loss") is not None:
        total.append(f"loss {fmt_loss(t['loss'])}")
    if t.get("pipeline_rss_bytes") is not None:
        total.append(f"rss {fmt_bytes(t['pipeline_rss_bytes'], long=True)}")
    if t.get("eta_s") is not None:
        total.append(f"eta {fmt_duration(t['eta_s'])}")
    lines.append("")
    lines.append(_fit("  ".join(total), width))

    warnings = []
    for p in procs:
        name = _proc_name(p)
        if p.get("exit_code") not in (None, 0):
            warnings.append(f"{name} exited with code {p['exit_code']}")
        hb = p.get("heartbeat_age_s")
        if hb is not None and hb > heartbeat_warn_s and p.get("exit_code") is None:
            warnings.append(f"{name} last heartbeat {fmt_duration(hb)} ago")
        if p.get("rejected_messages"):
            warnings.append(f"{name} rejected {p['rejected_messages']} control message(s)")
        if p.get("loss") is not None and not math.isfinite(p["loss"]):
            warnings.append(f"{name} loss is {fmt_loss(p['loss'])}")
    if warnings:
        lines.append("")
        lines.extend(_fit(f"! {w}", width) for w in warnings)
    if legend and procs:
        lines.append("")
        lines.extend(_fit(x, width) for x in LEGEND)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- prometheus


def _prom_value(v: int | float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label_escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help_escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, Any]]) -> str:
    body = ",".join(f'{k}="{_label_escape(str(v))}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


def _sum_or_none(xs: list[int] | None) -> int | None:
    return None if xs is None else sum(xs)


def _ratio(pct: float | None) -> float | None:
    return None if pct is None else pct / 100.0


# name, help, getter. One sample per process (when the value is not None).
PROCESS_METRICS: list[tuple[str, str, Callable[[Mapping[str, Any]], Any]]] = [
    ("process_up", "1 while the process runs (has a pid and no exit code), else 0.",
     lambda p: int(p.get("pid") is not None and p.get("exit_code") is None)),
    ("process_pid", "OS process id.", lambda p: p.get("pid")),
    ("process_uptime_seconds", "Seconds since the process started.", lambda p: p.get("uptime_s")),
    ("process_heartbeat_age_seconds", "Seconds since the process's last heartbeat.",
     lambda p: p.get("heartbeat_age_s")),
    ("process_tokens_per_second", "Tokens per second through this process.", lambda p: p.get("tokens_per_s")),
    *[
        (f"process_slots_{k}", f"Ring slots in state {k} (targets).",
         (lambda key: lambda p: None if p.get("slots") is None else p["slots"].get(key))(k))
        for k in SLOT_STATES
    ],
    ("process_inflight_slots", "Slots outstanding at all drafters (targets).",
     lambda p: _sum_or_none(p.get("inflight_per_drafter"))),
    ("process_queue_depth", "Batches waiting to be trained on (drafters).", lambda p: p.get("queue_depth")),
    ("process_step", "Optimizer steps done (drafters).", lambda p: p.get("step")),
    ("process_loss", "Latest training loss (drafters).", lambda p: p.get("loss")),
    ("process_gpu_memory_allocated_bytes", "GPU memory allocated by tensors.",
     lambda p: p.get("gpu_mem_allocated_bytes")),
    ("process_gpu_memory_reserved_bytes", "GPU memory reserved by the caching allocator.",
     lambda p: p.get("gpu_mem_reserved_bytes")),
    ("process_resident_memory_bytes", "Resident set size.", lambda p: p.get("rss_bytes")),
    ("process_rejected_messages", "Control messages refused as bad or unexpected.",
     lambda p: p.get("rejected_messages")),
    ("process_busy_ratio", "Share of wall time spent computing (0..1).", lambda p: _ratio(p.get("busy_pct"))),
    ("process_wait_ratio", "Share of wall time spent waiting for input (0..1).",
     lambda p: _ratio(p.get("wait_pct"))),
    ("process_exit_code", "Exit code of a process that has exited.", lambda p: p.get("exit_code")),
]

RUN_METRICS: list[tuple[str, str, Callable[[Mapping[str, Any]], Any]]] = [
    ("supervisor_pid", "OS process id of the supervisor.", lambda s: s.get("supervisor_pid")),
    ("started_timestamp_seconds", "Unix time the supervisor started.", lambda s: s.get("started_unix")),
    ("updated_timestamp_seconds", "Unix time of this status snapshot.", lambda s: s.get("updated_unix")),
    ("tokens_per_second", "Training throughput of the whole pipeline, tokens per second.",
     lambda s: s["totals"].get("tokens_per_s")),
    ("step", "Optimizer steps done.", lambda s: s["totals"].get("step")),
    ("max_steps", "Steps the run will stop at (absent: until the data is exhausted).",
     lambda s: s["totals"].get("max_steps")),
    ("loss", "Latest training loss.", lambda s: s["totals"].get("loss")),
    ("pipeline_resident_memory_bytes", "Resident set size of the supervisor and all its processes.",
     lambda s: s["totals"].get("pipeline_rss_bytes")),
    ("eta_seconds", "Estimated seconds until the run finishes.", lambda s: s["totals"].get("eta_s")),
]

PREFIX = "dflash_ipc_"
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_RESERVED_LABELS = frozenset({"role", "rank", "device", "state", "drafter", "config", "run_dir"})


def render_prometheus(status: Mapping[str, Any], *, extra_labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of a snapshot: gauges named ``dflash_ipc_*``.

    ``dflash_ipc_state{state=...}`` is 1 for the run's state and 0 for the others;
    per-process gauges carry ``role``, ``rank``, ``device`` (``process_state`` adds
    ``state``); ``process_inflight_to_drafter`` has one sample per (target, drafter) pair.
    ``extra_labels`` (e.g. ``{"run": "myrun"}``) go on every sample, to tell several runs
    on one host apart.
    """
    base = list((extra_labels or {}).items())
    for k, _ in base:
        if not _LABEL_RE.fullmatch(k) or k.startswith("__") or k in _RESERVED_LABELS:
            raise ValueError(f"extra label name {k!r} is invalid or used by dflash-ipc metrics")
    out: list[str] = []

    def family(name: str, help_text: str, samples: list[tuple[list[tuple[str, Any]], Any]]) -> None:
        samples = [(lbl, v) for lbl, v in samples if v is not None]
        if not samples:
            return
        full = PREFIX + name
        out.append(f"# HELP {full} {_help_escape(help_text)}")
        out.append(f"# TYPE {full} gauge")
        for lbl, v in samples:
            out.append(f"{full}{_labels(base + lbl)} {_prom_value(v)}")

    state = status.get("state")
    family("state", "1 for the run's current state, 0 for the others.",
           [([("state", s)], int(s == state)) for s in RUN_STATES])
    family("info", "Constant 1; labels name the config and run directory.",
           [([("config", status.get("config", "")), ("run_dir", status.get("run_dir", ""))], 1)])
    for name, help_text, get in RUN_METRICS:
        family(name, help_text, [([], get(status))])

    procs = _sorted_procs(status)

    def plabels(p: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return [("role", p["role"]), ("rank", p["rank"]), ("device", p["device"])]

    family("process_state", "Constant 1; the state label is the process's current state.",
           [(plabels(p) + [("state", p.get("state", ""))], 1) for p in procs])
    for name, help_text, get in PROCESS_METRICS:
        family(name, help_text, [(plabels(p), get(p)) for p in procs])
    family("process_inflight_to_drafter", "Slots a target has outstanding at one drafter.",
           [(plabels(p) + [("drafter", j)], n)
            for p in procs for j, n in enumerate(p.get("inflight_per_drafter") or [])])
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- json


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def render_json(status: Mapping[str, Any], *, indent: int | None = 2) -> str:
    """Strict JSON (RFC 8259): non-finite floats (a NaN loss) become ``null``."""
    return json.dumps(_json_safe(dict(status)), indent=indent, allow_nan=False) + "\n"


def render_status(status: Mapping[str, Any], fmt: str = "table", **kwargs: Any) -> str:
    """Dispatch on ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "table":
        return render_table(status, **kwargs)
    if fmt == "json":
        return render_json(status, **kwargs)
    if fmt == "prometheus":
        return render_prometheus(status, **kwargs)
    raise ValueError(f"unknown status format {fmt!r}; use one of {', '.join(FORMATS)}")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and rename, so a reader (``dflash-ipc
    status``, node_exporter's textfile collector) never sees a half-written file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
