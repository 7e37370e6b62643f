"""The status snapshot as Prometheus metrics, on ``prometheus-client``.

:class:`StatusCollector` turns a :class:`~dflash_ipc.control.status.StatusSnapshot` into gauge
families named ``dflash_ipc_*``; :func:`render_prometheus` renders one snapshot as text
exposition (``dflash-ipc status --prometheus``, node_exporter's textfile collector) and
:class:`MetricsServer` serves the supervisor's latest snapshot on ``http://127.0.0.1:PORT/metrics``
(``run.metrics_port``) so Prometheus/Grafana can scrape a long run.

``dflash_ipc_state{state=...}`` is 1 for the run's state and 0 for the others; per-process gauges
carry ``role``, ``rank``, ``device`` (``process_state`` adds ``state``, ``process_rejected_by_kind``
adds ``kind``); ``process_inflight_to_drafter`` has one sample per (target, drafter) pair. A value
that is ``None`` gives no sample, and a family without samples is left out.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from dflash_ipc.control.status import (
    RUN_STATES,
    SLOT_STATES,
    ProcessStatus,
    StatusSnapshot,
)

PREFIX = "dflash_ipc_"
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_RESERVED_LABELS = frozenset({"role", "rank", "device", "state", "drafter", "kind", "config", "run_dir"})


def _ratio(pct: float | None) -> float | None:
    return None if pct is None else pct / 100.0


def _slot(key: str) -> Callable[[ProcessStatus], int | None]:
    return lambda p: None if p.slots is None else getattr(p.slots, key)


# name, help, getter. One sample per process (when the value is not None).
PROCESS_METRICS: list[tuple[str, str, Callable[[ProcessStatus], Any]]] = [
    (
        "process_up",
        "1 while the process runs (has a pid and no exit code), else 0.",
        lambda p: int(p.pid is not None and p.exit_code is None),
    ),
    ("process_pid", "OS process id.", lambda p: p.pid),
    ("process_uptime_seconds", "Seconds since the process started.", lambda p: p.uptime_s),
    ("process_heartbeat_age_seconds", "Seconds since the process's last heartbeat.", lambda p: p.heartbeat_age_s),
    ("process_tokens_per_second", "Tokens per second through this process.", lambda p: p.tokens_per_s),
    *[(f"process_slots_{k}", f"Ring slots in state {k} (targets).", _slot(k)) for k in SLOT_STATES],
    (
        "process_inflight_slots",
        "Slots outstanding at all drafters (targets).",
        lambda p: None if p.inflight_per_drafter is None else sum(p.inflight_per_drafter),
    ),
    ("process_queue_depth", "Batches waiting to be trained on (drafters).", lambda p: p.queue_depth),
    ("process_step", "Optimizer steps done (drafters).", lambda p: p.step),
    ("process_loss", "Latest training loss (drafters).", lambda p: p.loss),
    ("process_anchors_per_batch", "Most anchors the next batch trains on (drafters; 0: no cap).", lambda p: p.anchors_per_batch),
    ("process_tau_holdout", "Held-out acceptance length of the last held-out pass (drafter 0).", lambda p: p.tau_holdout),
    ("process_gpu_memory_allocated_bytes", "GPU memory allocated by tensors.", lambda p: p.gpu_mem_allocated_bytes),
    ("process_gpu_memory_reserved_bytes", "GPU memory reserved by the caching allocator.", lambda p: p.gpu_mem_reserved_bytes),
    ("process_resident_memory_bytes", "Resident set size.", lambda p: p.rss_bytes),
    ("process_rejected_messages", "Control messages refused as bad or unexpected.", lambda p: p.rejected_messages),
    ("process_busy_ratio", "Share of wall time spent computing (0..1).", lambda p: _ratio(p.busy_pct)),
    ("process_wait_ratio", "Share of wall time spent waiting for input (0..1).", lambda p: _ratio(p.wait_pct)),
    ("process_exit_code", "Exit code of a process that has exited.", lambda p: p.exit_code),
]

RUN_METRICS: list[tuple[str, str, Callable[[StatusSnapshot], Any]]] = [
    ("supervisor_pid", "OS process id of the supervisor.", lambda s: s.supervisor_pid),
    ("started_timestamp_seconds", "Unix time the supervisor started.", lambda s: s.started_unix),
    ("updated_timestamp_seconds", "Unix time of this status snapshot.", lambda s: s.updated_unix),
    ("tokens_per_second", "Training throughput of the whole pipeline, tokens per second.", lambda s: s.totals.tokens_per_s),
    ("step", "Optimizer steps done.", lambda s: s.totals.step),
    ("max_steps", "Steps the run will stop at (absent: until the data is exhausted).", lambda s: s.totals.max_steps),
    ("loss", "Latest training loss.", lambda s: s.totals.loss),
    ("pipeline_resident_memory_bytes", "Resident set size of the supervisor and all its processes.", lambda s: s.totals.pipeline_rss_bytes),
    ("eta_seconds", "Estimated seconds until the run finishes.", lambda s: s.totals.eta_s),
]


def check_extra_labels(extra_labels: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Labels put on every sample (e.g. ``{"run": "myrun"}``, to tell runs on one host apart)."""
    base = list((extra_labels or {}).items())
    for k, _ in base:
        if not _LABEL_RE.fullmatch(k) or k.startswith("__") or k in _RESERVED_LABELS:
            raise ValueError(f"extra label name {k!r} is invalid or used by dflash-ipc metrics")
    return base


class StatusCollector(Collector):
    """Gauges over the snapshot ``snapshot()`` returns at scrape time (nothing while it is None)."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot | None], extra_labels: Mapping[str, str] | None = None):
        self._snapshot = snapshot
        self._base = check_extra_labels(extra_labels)

    def _family(self, name: str, help_text: str, samples: list[tuple[list[tuple[str, Any]], Any]]) -> GaugeMetricFamily | None:
        samples = [(labels, v) for labels, v in samples if v is not None]
        if not samples:
            return None
        names = [k for k, _ in self._base + samples[0][0]]
        family = GaugeMetricFamily(PREFIX + name, help_text, labels=names)
        for labels, v in samples:
            family.add_metric([str(x) for _, x in self._base + labels], float(v))
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self._snapshot()
        if status is None:
            return
        procs = status.sorted_processes()

        def plabels(p: ProcessStatus) -> list[tuple[str, Any]]:
            return [("role", p.role), ("rank", p.rank), ("device", p.device)]

        families = [
            self._family(
                "state", "1 for the run's current state, 0 for the others.", [([("state", s)], int(s == status.state)) for s in RUN_STATES]
            ),
            self._family(
                "info",
                "Constant 1; labels name the config and run directory.",
                [([("config", status.config), ("run_dir", status.run_dir)], 1)],
            ),
            *(self._family(name, help_text, [([], get(status))]) for name, help_text, get in RUN_METRICS),
            self._family(
                "process_state",
                "Constant 1; the state label is the process's current state.",
                [(plabels(p) + [("state", p.state)], 1) for p in procs],
            ),
            *(self._family(name, help_text, [(plabels(p), get(p)) for p in procs]) for name, help_text, get in PROCESS_METRICS),
            self._family(
                "process_rejected_by_kind",
                "Control messages refused, by kind of fault.",
                [(plabels(p) + [("kind", k)], n) for p in procs for k, n in sorted(p.rejected_by_kind.items())],
            ),
            self._family(
                "process_inflight_to_drafter",
                "Slots a target has outstanding at one drafter.",
                [(plabels(p) + [("drafter", j)], n) for p in procs for j, n in enumerate(p.inflight_per_drafter or [])],
            ),
        ]
        yield from (f for f in families if f is not None)


def render_prometheus(status: StatusSnapshot, *, extra_labels: Mapping[str, str] | None = None) -> str:
    """Prometheus text exposition (format 0.0.4) of one snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: status, extra_labels))
    return generate_latest(registry).decode()


class MetricsServer:
    """``GET /metrics`` on 127.0.0.1:``port`` over the snapshot ``snapshot()`` returns at each scrape.

    Runs in a daemon thread of the caller; :meth:`close` stops it and frees the port."""

    def __init__(self, port: int, snapshot: Callable[[], StatusSnapshot | None], addr: str = "127.0.0.1"):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(snapshot))
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.port = self._server.server_port
        self._closed = threading.Event()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
