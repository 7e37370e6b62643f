"""Renderings of the status snapshot (:mod:`dflash_ipc.control.status`): a human table
(:func:`render_table`) and JSON (:func:`render_json`); Prometheus exposition is
:mod:`dflash_ipc.ops.prometheus`. :func:`render_status` picks one by name.

In the table, memory sizes use binary units (``12.3G`` = 12.3 GiB) and rates SI
suffixes (``18.2k`` tok/s); a value that is ``None`` shows as ``-``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from dflash_ipc.control.drafter_tau import NOT_WORTH_SERVING, WORTH_SERVING_TAU
from dflash_ipc.control.protocol import to_wire
from dflash_ipc.control.status import ENDED_STATES, SLOT_STATES, ProcessStatus, StatusSnapshot

FORMATS = ("table", "json", "prometheus")
TABLE_WIDTH = 100

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
    return text[: keep // 2] + "..." + text[len(text) - (keep - keep // 2) :]


def _work(p: ProcessStatus) -> str:
    if p.exit_code is not None:  # exited: its last step (drafters), nothing live
        return f"s{p.step}" if p.step is not None else "-"
    if p.slots is not None:
        text = "/".join(str(getattr(p.slots, k)) for k in SLOT_STATES)
        if p.inflight_per_drafter is not None:
            with_inflight = f"{text} i{sum(p.inflight_per_drafter)}"
            if len(with_inflight) <= 12:
                text = with_inflight
        return text
    parts = []
    if p.queue_depth is not None:
        parts.append(f"q{p.queue_depth}")
    if p.step is not None:
        parts.append(f"s{p.step}")
    if len(" ".join(parts)) > 12:
        parts = parts[:1]
    return " ".join(parts) or "-"


def _gpu(p: ProcessStatus) -> str:
    a, r = p.gpu_mem_allocated_bytes, p.gpu_mem_reserved_bytes
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


def _busy_wait(p: ProcessStatus) -> str:
    b, w = p.busy_pct, p.wait_pct
    if b is None and w is None:
        return "-"
    f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    return f"{f(b)}/{f(w)}"


def _live(cell: Callable[[ProcessStatus], str]) -> Callable[[ProcessStatus], str]:
    """A cell that describes a running process: "-" once it exited (a snapshot written by an older
    supervisor may still carry the figures of its last heartbeat)."""
    return lambda p: "-" if p.exit_code is not None else cell(p)


# (header, max width, right-aligned, cell function)
_COLUMNS: list[tuple[str, int, bool, Callable[[ProcessStatus], str]]] = [
    ("PROC", 9, False, lambda p: p.name),
    ("PID", 7, True, lambda p: "-" if p.pid is None else str(p.pid)),
    ("DEVICE", 7, False, lambda p: p.device),
    ("STATE", 8, False, lambda p: p.state if p.exit_code is None else f"exited {p.exit_code}"),
    ("UP", 6, True, _live(lambda p: fmt_duration(p.uptime_s))),
    ("HB", 6, True, _live(lambda p: fmt_duration(p.heartbeat_age_s))),
    ("TOK/S", 5, True, _live(lambda p: fmt_rate(p.tokens_per_s))),
    ("WORK", 12, False, _work),
    ("LOSS", 6, True, lambda p: fmt_loss(p.loss)),
    ("GPU MEM", 10, True, _live(_gpu)),
    ("RSS", 5, True, _live(lambda p: fmt_bytes(p.rss_bytes))),
    ("B/W%", 7, True, _live(_busy_wait)),
]

LEGEND = (
    "WORK: target slots free/filling/ready/copying + in flight (i); drafter queue (q), step (s)",
    "HB: heartbeat age. GPU MEM: allocated/reserved. B/W%: busy/waiting share of wall time",
)


def render_table(
    status: StatusSnapshot,
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
    procs = status.sorted_processes()
    lines = _header_lines(status, now, width, stale_after_s)
    lines.append("")
    lines.extend(_process_lines(procs, width))
    lines.append("")
    lines.extend(_total_lines(status, procs, width))
    warnings = _warnings(status, procs, heartbeat_warn_s)
    if warnings:
        lines.append("")
        lines.extend(_fit(f"! {w}", width) for w in warnings)
    if legend and procs:
        lines.append("")
        lines.extend(_fit(x, width) for x in LEGEND)
    return "\n".join(lines) + "\n"


def _header_lines(status: StatusSnapshot, now: float, width: int, stale_after_s: float) -> list[str]:
    """The run's state, age, pid and config; why it ended; its run directory and node."""
    lines: list[str] = []
    state = status.state
    updated = status.updated_unix
    age = max(0.0, now - updated)
    ended = state in ENDED_STATES
    head = [f"dflash-ipc  {state.upper()}"]
    if age > stale_after_s and not ended:
        head.append("STALE")
    head.append(f"pid {status.supervisor_pid}")
    if ended:  # how long it ran, and when it ended
        head.append(f"ran {fmt_duration(max(0.0, updated - status.started_unix))}")
        head.append(f"ended {fmt_duration(age)} ago")
    else:  # a live run: its age now (a snapshot of a run still preparing may be seconds old)
        head.append(f"up {fmt_duration(max(0.0, now - status.started_unix))}")
        head.append(f"updated {fmt_duration(age)} ago")
    head_text = "  ".join(head)
    config = status.config
    config_in_head = bool(config) and len(head_text) + len("  config ") + len(config) <= width
    if config_in_head:
        head_text += f"  config {config}"
    lines.append(_fit(head_text, width))
    if ended and status.end_reason:
        lines.append(_fit(f"{'why' if state == 'failed' else 'ended':<8} {status.end_reason}", width))
    if ended and status.drafter_tau is not None:
        under = "" if status.drafter_tau.worth_serving else f", under {WORTH_SERVING_TAU}"
        lines.append(_fit(f"drafter  {status.drafter_tau.figure()}{under}", width))
    lines.append(_fit(f"run dir  {status.run_dir}", width))
    if status.node is not None:
        n = status.node
        group = f"{n.group_step:,}" if n.group_step is not None else "?"
        lines.append(_fit(f"node     {n.node_rank} of {n.nnodes} (drafter group {n.master})  group step {group}", width))
    if config and not config_in_head:
        lines.append(_fit(f"config   {config}", width))
    return lines


def _process_lines(procs: list, width: int) -> list[str]:
    """The column header and one row per process, each column as wide as its widest cell."""
    cells = [[_fit(fn(p), w) for (_, w, _, fn) in _COLUMNS] for p in procs]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, (h, _, _, _) in enumerate(_COLUMNS)]

    def fmt_row(row: Iterable[str]) -> str:
        out = []
        for text, w, (_, _, right, _) in zip(row, widths, _COLUMNS):
            out.append(text.rjust(w) if right else text.ljust(w))
        return " ".join(out).rstrip()

    lines = [fmt_row(h for (h, _, _, _) in _COLUMNS)]
    lines.extend(fmt_row(row) for row in cells)
    if not procs:
        lines.append("(no processes)")
    return lines


def _total_lines(status: StatusSnapshot, procs: list, width: int) -> list[str]:
    """TOTAL (rate, step, loss, memory, ETA) and TRAIN (anchors per batch, held-out tau)."""
    t = status.totals
    total = [f"TOTAL  {fmt_rate(t.tokens_per_s)} tok/s"]
    if t.max_steps:
        total.append(f"step {t.step:,}/{t.max_steps:,} ({100.0 * t.step / t.max_steps:.1f}%)")
    else:
        total.append(f"step {t.step:,}")
    if t.loss is not None:
        total.append(f"loss {fmt_loss(t.loss)}")
    total.append(f"rss {fmt_bytes(t.pipeline_rss_bytes, long=True)}")
    if t.eta_s is not None:
        total.append(f"eta {fmt_duration(t.eta_s)}")
    lines = [_fit("  ".join(total), width)]
    train = []
    anchors = sorted({p.anchors_per_batch for p in procs if p.anchors_per_batch})
    if anchors:  # one figure: every data-parallel rank moves its budget alike
        train.append(f"anchors/batch {'/'.join(f'{a:,}' for a in anchors)}")
    held_out = [p.tau_holdout for p in procs if p.tau_holdout is not None]
    if held_out:
        train.append(f"held-out tau {held_out[0]:.2f}")
    if train:
        lines.append(_fit("TRAIN  " + "  ".join(train), width))
    return lines


def _warnings(status: StatusSnapshot, procs: list, heartbeat_warn_s: float) -> list[str]:
    """A lost supervisor, rejected messages, non-zero exits, stale heartbeats, non-finite losses."""
    warnings = []
    tau = status.drafter_tau
    if tau is not None and not tau.worth_serving:
        warnings.append(NOT_WORTH_SERVING)  # the figure is on the header's drafter line
    if status.state == "lost":
        warnings.append(f"the supervisor (pid {status.supervisor_pid}) is gone: this run is not running (last snapshot shown)")
    if status.supervisor_rejected_by_kind:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(status.supervisor_rejected_by_kind.items()))
        warnings.append(f"supervisor rejected {sum(status.supervisor_rejected_by_kind.values())} message(s): {kinds}")
    for p in procs:
        if p.exit_code not in (None, 0):
            warnings.append(f"{p.name} exited with code {p.exit_code}")
        hb = p.heartbeat_age_s
        if hb is not None and hb > heartbeat_warn_s and p.exit_code is None:
            warnings.append(f"{p.name} last heartbeat {fmt_duration(hb)} ago")
        if p.rejected_messages:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(p.rejected_by_kind.items()))
            warnings.append(f"{p.name} rejected {p.rejected_messages} control message(s)" + (f": {kinds}" if kinds else ""))
        if p.loss is not None and not math.isfinite(p.loss):
            warnings.append(f"{p.name} loss is {fmt_loss(p.loss)}")
    return warnings


# --------------------------------------------------------------------------- json


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def render_json(status: StatusSnapshot, *, indent: int | None = 2) -> str:
    """Strict JSON (RFC 8259), ending in one newline: non-finite floats (a NaN loss) become ``null``."""
    return json.dumps(_json_safe(to_wire(status)), indent=indent, allow_nan=False) + "\n"


def render_status(status: StatusSnapshot, fmt: str = "table", **kwargs: Any) -> str:
    """Dispatch on ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "table":
        return render_table(status, **kwargs)
    if fmt == "json":
        return render_json(status, **kwargs)
    if fmt == "prometheus":
        from dflash_ipc.ops.prometheus import render_prometheus

        return render_prometheus(status, **kwargs)
    raise ValueError(f"unknown status format {fmt!r}; use one of {', '.join(FORMATS)}")
