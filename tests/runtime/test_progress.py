"""Progress output of `dflash-ipc up`: the pure line decider, the rich bar, and a real run's output."""

from __future__ import annotations

import io
import itertools
import re

import pytest
from conftest import SHARED_RUN_STEPS
from rich.console import Console

from dflash_ipc.control.stats import DrafterStats, DrafterWork, Vitals
from dflash_ipc.drafter.core import RecentRate
from dflash_ipc.runtime.progress import (
    PlainProgress,
    ProgressLines,
    ProgressSnapshot,
    RichProgress,
    eta_seconds,
    progress_snapshot,
)

PROGRESS_LINE = re.compile(r"^\[up\] step ")


def snap(**kw) -> ProgressSnapshot:
    base = {
        "step": 3,
        "max_steps": 40,
        "loss": 2.5,
        "acc": 0.125,
        "tokens_per_s": 1000.0,
        "eta_s": 74.0,
        "busy_pct": {"target-0": 80.0, "drafter-0": 60.0},
    }
    return ProgressSnapshot(**(base | kw))


def test_identical_snapshots_print_one_line():
    lines = ProgressLines()
    out = [lines.update(snap()) for _ in range(5)]
    assert out[0] == "[up] step 3/40 loss 2.5000 acc 0.1250 tok/s 1000 ETA 1m14s | busy target-0 80% drafter-0 60%"
    assert out[1:] == [None] * 4


def test_a_new_step_prints_a_new_line_and_rates_alone_do_not():
    lines = ProgressLines()
    assert lines.update(snap()) is not None
    # tokens/s, ETA and busy % move every second while the training waits: no new line
    assert lines.update(snap(tokens_per_s=900.0, eta_s=80.0, busy_pct={"target-0": 10.0, "drafter-0": 0.0})) is None
    assert lines.update(snap(step=4)).startswith("[up] step 4/40 ")
    assert lines.update(snap(step=4, loss=2.25)).startswith("[up] step 4/40 loss 2.2500 ")
    assert lines.update(snap(step=4, loss=2.25)) is None


def test_unknown_values_show_a_dash_never_none():
    lines = ProgressLines()
    line = lines.update(ProgressSnapshot(busy_pct={"target-0": None}))
    assert line == "[up] step 0 loss - acc - tok/s - ETA - | busy target-0 -%"
    assert "None" not in line and "nan" not in line.lower()
    assert lines.update(snap(loss=float("nan"), max_steps=None)).startswith("[up] step 3 loss - acc 0.1250 ")


def test_eta_needs_a_step_a_limit_and_a_time():
    assert eta_seconds(0, 40, 10.0) is None
    assert eta_seconds(5, None, 10.0) is None
    assert eta_seconds(5, 40, 10.0) == pytest.approx(70.0)
    assert eta_seconds(50, 40, 10.0) == 0.0


def test_the_rate_and_eta_follow_the_last_steps_not_the_start_up():
    """A run whose first step ends 79 s after the start (processes ready, then the compile) and whose steps
    then take 0.25 s: the mean since the start says an ETA of hours at step 3; the window says minutes."""
    rate = RecentRate(window=50)
    assert rate.step_s() is None and rate.tokens_per_s() is None  # one step: no span yet
    elapsed, tokens = 79.0, 25_000
    rate.observe(1, elapsed, tokens)
    assert rate.step_s() is None
    for step in range(2, 4):
        elapsed += 0.25
        tokens += 25_000
        rate.observe(step, elapsed, tokens)
    assert rate.step_s() == pytest.approx(0.25) and rate.tokens_per_s() == pytest.approx(100_000.0)
    work = DrafterWork(
        step=3,
        loss=7.0,
        acc=0.03,
        tau=1.0,
        tokens_per_s=tokens / elapsed,
        tokens=tokens,
        params=1,
        train_elapsed_s=elapsed,
        gpu=None,
        recent_step_s=rate.step_s(),
        recent_tokens_per_s=rate.tokens_per_s(),
    )
    lead = DrafterStats(Vitals("running", 0.0, 0, 0, {}), work, queue_depth=0, outstanding=0, copying=0, wait_pct=0.0, slots_per_target=[0])
    shown = progress_snapshot(lead, [], max_steps=1648)
    assert shown.eta_s == pytest.approx(1645 * 0.25)  # 6m51s
    assert shown.tokens_per_s == pytest.approx(100_000.0)
    assert eta_seconds(3, 1648, elapsed) > 3600 * 11  # what the mean since the start said: 12h
    # the window forgets: 60 slow steps (a held-out pass each) later, only they count
    for step in range(4, 64):
        elapsed += 1.0
        rate.observe(step, elapsed, tokens)
    assert rate.step_s() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        RecentRate(window=0)


def test_the_rate_starts_after_the_compiling_steps():
    """A run whose first four steps compile (35 s, then 6 s each: a new shape per length bucket) and then
    take 0.25 s: counted from step 1 the window still reads 1.9 s per step at step 12; from step 4, 0.25."""
    from_first, after_compiles = RecentRate(window=50), RecentRate(window=50, start_after=4)
    elapsed = 0.0
    for step in range(1, 13):
        elapsed += 35.0 if step == 1 else 6.0 if step <= 4 else 0.25
        from_first.observe(step, elapsed, 1000 * step)
        after_compiles.observe(step, elapsed, 1000 * step)
        if step <= 4:
            assert after_compiles.step_s() is None  # nothing but compiles yet: no pace to show
    assert from_first.step_s() == pytest.approx((18 + 8 * 0.25) / 11)
    assert after_compiles.step_s() == pytest.approx(0.25)
    assert after_compiles.tokens_per_s() == pytest.approx(4000.0)
    with pytest.raises(ValueError, match="start_after must be >= 1"):
        RecentRate(start_after=0)


def test_plain_progress_echoes_only_changes():
    printed: list[str] = []
    display = PlainProgress(printed.append)
    for s in (snap(), snap(), snap(step=4), snap(step=4), snap(step=5)):
        display.update(s)
    display.close()
    assert [p.split(" loss")[0] for p in printed] == ["[up] step 3/40", "[up] step 4/40", "[up] step 5/40"]


def test_rich_progress_renders_the_bar_fields():
    buf = io.StringIO()
    display = RichProgress(Console(file=buf, force_terminal=True, width=200, color_system=None))
    display.update(snap(step=7, acc=None))
    display.close()
    text = buf.getvalue()
    assert "step 7/40" in text and "loss 2.5000" in text and "acc -" in text and "tok/s 1000" in text and "ETA 1m14s" in text
    assert "busy target-0 80% drafter-0 60%" in text and "None" not in text


@pytest.mark.slow
def test_up_without_a_tty_never_repeats_a_progress_line(shared_run):
    run = shared_run  # conftest: SHARED_RUN_STEPS steps, stdout not a TTY (test_up and test_tensorboard read it too)
    assert run.returncode == 0, run.output[-4000:]
    progress = [ln for ln in run.output.splitlines() if PROGRESS_LINE.match(ln)]
    assert progress, run.output[-4000:]
    repeats = [(a, b) for a, b in itertools.pairwise(progress) if a == b]
    assert not repeats, run.output
    steps = [int(re.match(r"\[up\] step (\d+)", ln).group(1)) for ln in progress]
    assert steps == sorted(steps) and all(s <= SHARED_RUN_STEPS for s in steps)
    assert "None" not in run.output and "\r" not in run.output
    assert f"[up] finished (max_steps {SHARED_RUN_STEPS})" in run.output


def _summary(tokens: int, train_s: float):
    import dataclasses

    from control.test_protocol import DRAFTER_STATS, DRAFTER_SUMMARY

    work = dataclasses.replace(DRAFTER_STATS.work, tokens=tokens, train_elapsed_s=train_s)
    return dataclasses.replace(DRAFTER_SUMMARY, final=dataclasses.replace(DRAFTER_STATS, work=work))


def test_summary_after_resume_rates_only_this_sessions_steps(tmp_path):
    """metrics.jsonl of a resumed run holds every step since the start; this invocation trained the
    last 10 of 30 in 5 s: 200 tokens/s, not all 3,000 tokens over its 5 s (600 tokens/s)."""
    import json

    from dflash_ipc.runtime.progress import finished_summary

    recs = [{"step": s, "loss": 2.0, "tokens": 100, "elapsed_s": 1.0 * (s if s <= 20 else s - 20) / 2} for s in range(1, 31)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = finished_summary(tmp_path, _summary(tokens=1000, train_s=5.0), wall_s=9.0)
    assert "this invocation (resumed at step 20): 10 steps, 1000 target tokens in 5.0 s: 200 tokens/s" in text, text
    assert "all 30 steps: 3000 target tokens" in text and "600 tokens/s" not in text
    one = finished_summary(tmp_path, _summary(tokens=3000, train_s=5.0), wall_s=9.0)  # a run that was never resumed
    assert "trained on 3000 target tokens in 5.0 s: 600 tokens/s; wall 9.0 s" in one, one


def test_a_short_runs_summary_counts_the_steps_it_had(tmp_path):
    """4 steps: "mean of all 4", never "first 10 ... last 10"; 25 steps: the first and last 10."""
    import json

    from dflash_ipc.runtime.progress import finished_summary

    def summary_line(n: int) -> str:
        recs = [{"step": s, "loss": float(s), "tokens": 100, "elapsed_s": 0.5 * s} for s in range(1, n + 1)]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return finished_summary(tmp_path, _summary(tokens=100 * n, train_s=0.5 * n), wall_s=9.0).splitlines()[1]

    assert summary_line(4) == "  steps 4, loss 1.0000 -> 4.0000 (mean of all 4 2.5000)"
    assert summary_line(25) == "  steps 25, loss 1.0000 -> 25.0000 (mean of first 10 5.5000, last 10 20.5000)"
    stopped = finished_summary(tmp_path, _summary(tokens=100, train_s=0.5), wall_s=1.0, stopped=True)
    assert stopped.startswith("[up] stopped (") and "resume with --resume" in stopped.splitlines()[0]


def test_the_checkpoint_resumed_from_and_why_are_in_ups_output():
    """A fallback from a damaged ``latest`` is said by the supervisor, not only in drafter-0's log:
    drafter 0's Hello carries its ResumePoint (notes included) over the wire."""

    from dflash_ipc.control import protocol
    from dflash_ipc.control.protocol import Hello
    from dflash_ipc.control.stats import ChildInfo, ResumePoint
    from dflash_ipc.runtime.progress import ready_text

    note = "latest says 'step-000040', which is missing or damaged; falling back to the older complete checkpoint step-000020: ..."
    hello = Hello(role="drafter", rank=0, pid=1, device="cpu", info=ChildInfo(resume=ResumePoint("/r/checkpoints/step-000020", 20, [note])))
    received = protocol.decode(protocol.encode(hello))
    assert ready_text(4, 2.5, {("drafter", 0): received}) == (
        f"[up] all 4 processes ready after 2.5 s; training\n[up] resumed from /r/checkpoints/step-000020 (step 20)\n[up] checkpoint: {note}"
    )
    fresh = Hello(role="drafter", rank=0, pid=1, device="cpu", info=ChildInfo())
    assert ready_text(4, 2.5, {("drafter", 0): fresh}) == "[up] all 4 processes ready after 2.5 s; training"
