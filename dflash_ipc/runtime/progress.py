"""What `dflash-ipc up` shows of a running training: one pure decider, two renderers.

The supervisor builds a :class:`ProgressSnapshot` about once a second and hands it to a display:

* :class:`PlainProgress` (stdout is not a TTY: journald, pipes, files) prints a line only when
  the training moved, i.e. when the step, loss or accuracy *as printed* changed; a run that waits
  prints nothing instead of the same line every second. :class:`ProgressLines` is that decision,
  free of any I/O, so it is tested by feeding it snapshots.
* :class:`RichProgress` (stdout is a TTY) keeps one live bar: step/max, loss, acc, tokens/s,
  ETA, and every process's busy % below it. Other output of the supervisor scrolls above it.

A value that is not known yet (no step finished, no max_steps) is shown as ``-``, never ``None``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ipc.control.stats import DrafterStats, DrafterSummary, TargetStats

MISSING = "-"


@dataclass(frozen=True)
class ProgressSnapshot:
    step: int = 0
    max_steps: int | None = None  # None: until the data is exhausted
    loss: float | None = None
    acc: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    # process name -> % of its time spent working (targets: forwards/packs; drafters: not waiting for data)
    busy_pct: dict[str, float | None] = field(default_factory=dict)


def eta_seconds(step: int, max_steps: int | None, elapsed_s: float | None, recent_step_s: float | None = None) -> float | None:
    """Time left at the recent step time (the last steps': the start-up and the first compile left out), else
    at the mean step time so far; None when it cannot be known yet."""
    if not max_steps or not step:
        return None
    if recent_step_s:
        return max(0.0, (max_steps - step) * recent_step_s)
    if not elapsed_s:
        return None
    return max(0.0, (max_steps - step) * elapsed_s / step)


def fmt(value: float | None, spec: str = "") -> str:
    """``value`` formatted with ``spec``; ``-`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return format(value, spec)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return MISSING
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_text(snap: ProgressSnapshot) -> str:
    return f"{snap.step}/{snap.max_steps}" if snap.max_steps else str(snap.step)


def busy_text(snap: ProgressSnapshot) -> str:
    return " ".join(f"{name} {fmt(pct, '.0f')}%" for name, pct in snap.busy_pct.items())


class ProgressLines:
    """Turns a stream of snapshots into the plain lines worth printing (pure: no I/O)."""

    def __init__(self, prefix: str = "[up] ") -> None:
        self.prefix = prefix
        self._last_key: tuple[str, ...] | None = None

    @staticmethod
    def key(snap: ProgressSnapshot) -> tuple[str, ...]:
        """What must change for a new line: the training's progress as printed. Rates, ETA and
        busy % move every second without the training moving, so they ride along."""
        return (step_text(snap), fmt(snap.loss, ".4f"), fmt(snap.acc, ".4f"))

    def line(self, snap: ProgressSnapshot) -> str:
        busy = busy_text(snap)
        return (
            f"{self.prefix}step {step_text(snap)} loss {fmt(snap.loss, '.4f')} acc {fmt(snap.acc, '.4f')} "
            f"tok/s {fmt(snap.tokens_per_s, '.0f')} ETA {fmt_duration(snap.eta_s)}" + (f" | busy {busy}" if busy else "")
        )

    def update(self, snap: ProgressSnapshot) -> str | None:
        """The line to print for ``snap``, or None when it would repeat the last one's progress."""
        key = self.key(snap)
        if key == self._last_key:
            return None
        self._last_key = key
        return self.line(snap)


class PlainProgress:
    """Not a TTY: a line through ``echo`` whenever the training moved."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.lines = ProgressLines()

    def update(self, snap: ProgressSnapshot) -> None:
        line = self.lines.update(snap)
        if line is not None:
            self.echo(line)

    def close(self) -> None:
        pass


class RichProgress:
    """A TTY: a live bar (rich) over two lines, redrawn with every snapshot; closed explicitly.

    Line 1: step/max, the bar, loss, acc, tokens/s, ETA. Line 2: every process's busy %. Text
    wraps on a narrow terminal instead of being cut."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.live import Live

        self._live = Live(console=console or Console(), auto_refresh=False, redirect_stdout=True, redirect_stderr=True)
        self._live.start()

    @staticmethod
    def renderable(snap: ProgressSnapshot):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        top = Table.grid(padding=(0, 1))
        top.add_row(
            Text(f"step {step_text(snap)}", style="bold"),
            ProgressBar(total=snap.max_steps, completed=snap.step, width=24),
            Text(
                f"loss {fmt(snap.loss, '.4f')}  acc {fmt(snap.acc, '.4f')}  tok/s {fmt(snap.tokens_per_s, '.0f')}  "
                f"ETA {fmt_duration(snap.eta_s)}"
            ),
        )
        busy = busy_text(snap)
        return Group(top, Text(f"busy {busy}", style="dim")) if busy else top

    def update(self, snap: ProgressSnapshot) -> None:
        self._live.update(self.renderable(snap), refresh=True)

    def close(self) -> None:
        self._live.stop()


def progress_display(live: bool, echo: Callable[[str], None]) -> PlainProgress | RichProgress:
    return RichProgress() if live else PlainProgress(echo)


def finished_summary(run_dir: Path, summary: DrafterSummary | None, wall_s: float, stopped: bool = False) -> str:
    """The lines `up` prints when training ended (``stopped``: by a signal): loss first -> last, tokens/s, where things are."""
    metrics = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    lines = []
    if recs:
        n = min(10, len(recs))  # a short run: its own count, not a 10 it never had
        first = [r["loss"] for r in recs[:n] if r.get("loss") is not None]
        lastl = [r["loss"] for r in recs[-n:] if r.get("loss") is not None]
        means = (
            f"mean of all {n} {fmt(sum(first) / len(first) if first else None, '.4f')}"
            if n == len(recs) and len(recs) <= 10
            else f"mean of first {n} {fmt(sum(first) / len(first) if first else None, '.4f')},"
            f" last {n} {fmt(sum(lastl) / len(lastl) if lastl else None, '.4f')}"
        )
        lines.append(
            f"steps {recs[-1]['step']}, loss {fmt(first[0] if first else None, '.4f')} -> {fmt(lastl[-1] if lastl else None, '.4f')}"
            f" ({means})"
        )
        lines.append(_rate_text(recs, summary, wall_s))
    lines.append(f"checkpoint: {(summary.checkpoint if summary else None) or MISSING}")
    lines.append(f"exported drafter: {(summary.export if summary else None) or MISSING}")
    if summary is not None and summary.drafter_tau is not None:  # beside the export: is it worth serving
        lines.append(f"drafter: {summary.drafter_tau.describe()}")
    lines.append(f"metrics: {metrics}; status: dflash-ipc status --run-dir {run_dir}")
    head = (
        f"[up] stopped ({summary.reason if summary else '?'}; resume with --resume)"
        if stopped
        else f"[up] finished ({summary.reason if summary else '?'})"
    )
    return head + "\n  " + "\n  ".join(lines)


def ready_text(n_processes: int, seconds: float, hellos: Mapping) -> str:
    """`up`'s line at the end of the handshake; after a resume also the checkpoint drafter 0 loaded
    and why that one (a damaged ``latest`` fell back to an older checkpoint), not only in its log."""
    text = f"[up] all {n_processes} processes ready after {seconds:.1f} s; training"
    hello = hellos.get(("drafter", 0))
    resume = hello.info.resume if hello is not None and hello.info is not None else None
    if resume is None:
        return text
    return text + f"\n[up] resumed from {resume.checkpoint} (step {resume.step})" + "".join(f"\n[up] checkpoint: {n}" for n in resume.notes)


def _rate_text(recs: list[dict], summary: DrafterSummary | None, wall_s: float) -> str:
    """Tokens/s of this invocation's steps only: metrics.jsonl of a resumed run also holds the steps
    before its checkpoint, trained by earlier invocations in time this one did not see."""
    toks = sum(r["tokens"] for r in recs)
    work = summary.final.work if summary is not None else None
    if work is None or work.tokens >= toks:  # one invocation (or no summary): every step is this invocation's
        train_s = recs[-1]["elapsed_s"] if recs[-1].get("elapsed_s") else wall_s
        return f"trained on {toks} target tokens in {train_s:.1f} s: {toks / max(1e-9, train_s):.0f} tokens/s; wall {wall_s:.1f} s"
    mine, steps = 0, 0
    for r in reversed(recs):  # this invocation's steps are the last ones, their tokens add up to its total
        if mine >= work.tokens:
            break
        mine += r["tokens"]
        steps += 1
    train_s = work.train_elapsed_s or wall_s
    return (
        f"this invocation (resumed at step {recs[-1]['step'] - steps}): {steps} steps, {work.tokens} target tokens in {train_s:.1f} s: "
        f"{work.tokens / max(1e-9, train_s):.0f} tokens/s; wall {wall_s:.1f} s; all {len(recs)} steps: {toks} target tokens"
    )


def progress_snapshot(lead: DrafterStats, children: list, max_steps: int | None) -> ProgressSnapshot:
    """What the progress display shows: drafter 0's step, loss, acc and rate, every process's busy %."""
    w = lead.work
    busy: dict[str, float | None] = {}
    for c in children:
        if isinstance(c.stats, TargetStats):
            busy[c.name] = c.stats.work.busy_pct
        elif isinstance(c.stats, DrafterStats):  # a drafter that is not waiting for data is training
            busy[c.name] = 100.0 - min(100.0, c.stats.wait_pct)
        else:
            busy[c.name] = None
    return ProgressSnapshot(
        step=w.step,
        max_steps=max_steps,
        loss=w.loss,
        acc=w.acc,
        tokens_per_s=w.recent_tokens_per_s if w.recent_tokens_per_s is not None else w.tokens_per_s,
        eta_s=eta_seconds(w.step, max_steps, w.train_elapsed_s, w.recent_step_s),
        busy_pct=busy,
    )
