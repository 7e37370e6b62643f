"""The role loops' policy, in one process (tests/loop_harness.py): the very TargetLoop and
DrafterLoop that procs/ runs, over real cores (the tiny random Qwen3.5-family target, the
drafter), real cpu-shm rings and every peer message encoded and decoded as on a socket; only
the process shell is left out. EndOfData, the lockstep stop, the checkpoint cadence, held-out
passes and the anchor budget's moves, each without spawning a process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import holdout_file
from loop_harness import InprocIO, InprocRun, small_config

from dflash_ipc.control.protocol import Done, EndOfData, Shutdown, SlotReady
from dflash_ipc.drafter import loop as drafter_loop
from dflash_ipc.drafter.checkpoint.store import load_latest_checkpoint, read_latest_pointer
from dflash_ipc.drafter.training.anchor_budget import AnchorBudget


def metrics(run: InprocRun) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(run: InprocRun) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run.run_dir / "checkpoints").glob("step-*"))


# The runs to the data's end: 60 samples, 15 batches over 2 target shards (the harness's 120: twice as many)
FEW_SAMPLES = {"builtin_samples": 60}


@pytest.fixture
def inproc(tmp_path):
    runs = []

    def make(cfg, **kw) -> InprocRun:
        runs.append(InprocRun(cfg, tmp_path / f"run{len(runs)}", **kw))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def test_end_of_data_reaches_the_drafter_once_per_target_after_its_last_batch_and_every_batch_trains_once(tmp_path, inproc):
    run = inproc(small_config(tmp_path, targets=2, data=FEW_SAMPLES))
    summary = run.run()
    assert summary.reason == "data exhausted"
    trained = [tuple(i) for i in run.drafter_core.trained_ids]
    assert sorted(trained) == sorted(run.planned) and len(trained) == len(set(trained)) > 4  # every batch, once
    received = run.drafter_io.received
    for p in range(2):
        mine = [m for m in received if isinstance(m, (SlotReady, EndOfData)) and m.producer == p]
        ends = [i for i, m in enumerate(mine) if isinstance(m, EndOfData)]
        assert ends == [len(mine) - 1], f"target {p}: EndOfData once, after its last SlotReady"
        assert mine[-1].batches_sent == len(mine) - 1
        assert run.targets[p].end_sent
    (done,) = run.drafter_io.to_supervisor
    assert isinstance(done, Done) and done.drafter.reason == "data exhausted"
    ckpt = load_latest_checkpoint(run.run_dir / "checkpoints")  # training.checkpoint_on_finish
    assert ckpt.step == len(trained) and set(ckpt.ledger) == run.planned
    assert done.drafter.export is not None and (Path(done.drafter.export) / "model.safetensors").is_file()


def test_a_shutdown_stops_at_the_step_boundary_and_checkpoints_what_was_trained(tmp_path, inproc):
    run = inproc(small_config(tmp_path, targets=1, training={"checkpoint_on_finish": False, "export_on_finish": False}))

    def stop_after_three(r: InprocRun) -> None:
        if r.drafter_core.step == 3 and not r.drafter_io.control and not r.drafter_io.stop.requested:
            r.drafter_io.control.append(Shutdown(reason="operator", checkpoint=True))

    summary = run.run(on_step=stop_after_three)
    assert summary.reason == "shutdown: operator"
    assert run.drafter_core.step == 3 and checkpoint_steps(run) == [3]  # a stop checkpoints even without checkpoint_on_finish
    ckpt = load_latest_checkpoint(run.run_dir / "checkpoints")
    assert sorted(ckpt.ledger) == sorted(tuple(i) for i in run.drafter_core.trained_ids)  # a batch in hand stays out


def test_a_resumed_run_repeats_no_consumed_batch_and_skips_none(tmp_path, inproc):
    """Stop at step 3 (its checkpoint's ledger: those 3 batches), resume in the same run directory:
    the targets skip exactly the ledger, and the two runs together train every planned batch once."""
    cfg = small_config(tmp_path, targets=2, data=FEW_SAMPLES, training={"max_steps": 100, "export_on_finish": False})
    first = inproc(cfg)

    def stop_after_three(r: InprocRun) -> None:
        if r.drafter_core.step == 3 and not r.drafter_io.control and not r.drafter_io.stop.requested:
            r.drafter_io.control.append(Shutdown(reason="operator", checkpoint=True))

    first.run(on_step=stop_after_three)
    before = [tuple(i) for i in first.drafter_core.trained_ids]
    assert len(before) == 3 and checkpoint_steps(first) == [3]
    again = InprocRun(cfg, first.run_dir, resume=True)
    try:
        assert again.drafter_core.step == 3 and sum(t.core.skipped_ledgered for t in again.targets) == 3
        assert again.run().reason == "data exhausted"
        after = [tuple(i) for i in again.drafter_core.trained_ids]
        assert not set(before) & set(after) and sorted(before + after) == sorted(first.planned)
        assert set(load_latest_checkpoint(again.run_dir / "checkpoints").ledger) == first.planned
    finally:
        again.close()


class LateShutdownIO(InprocIO):
    """The supervisor's Shutdown reaches this rank only while it waits for it (a peer saw it first)."""

    deliver: bool = True

    def read_control(self, wait_ms: int = 0) -> None:
        if wait_ms and self.deliver:
            self.control.append(Shutdown(reason="operator"))
        super().read_control(wait_ms)


@pytest.mark.parametrize("own_shutdown_arrives", [True, False])
def test_a_stop_another_rank_saw_first_is_agreed_and_this_rank_waits_for_its_own(tmp_path, inproc, monkeypatch, own_shutdown_arrives):
    """One drafter in-process: the other rank's vote in the lockstep all-reduce (``trainer.agree``,
    a MAX over ranks) is played by OR-ing a stop into this rank's answer from step 2 on."""
    monkeypatch.setattr(drafter_loop, "PEER_STOP_WAIT_S", 0.3)
    io = LateShutdownIO("drafter-0")
    io.deliver = own_shutdown_arrives
    run = inproc(small_config(tmp_path, targets=1, training={"checkpoint_on_finish": False, "export_on_finish": False}), drafter_io=io)
    agree = run.drafter_core.trainer.agree

    def agree_with_a_stopping_peer(has_batch: bool, stop: bool) -> tuple[bool, bool]:
        any_batch, any_stop = agree(has_batch, stop)
        return any_batch, any_stop or run.drafter_core.step >= 2

    run.drafter_core.trainer.agree = agree_with_a_stopping_peer
    summary = run.run()
    assert run.drafter_core.step == 2 and checkpoint_steps(run) == [2]
    expected = "shutdown: operator" if own_shutdown_arrives else "stop requested (seen by another drafter)"
    assert summary.reason == expected


def test_checkpoints_every_n_steps_and_at_max_steps_never_twice(tmp_path, inproc):
    cfg = small_config(tmp_path, targets=1, training={"checkpoint_every": 3, "max_steps": 7, "keep_checkpoints": 5})
    run = inproc(cfg)
    assert run.run().reason == "max_steps 7"
    assert checkpoint_steps(run) == [3, 6, 7]
    cfg = small_config(tmp_path, targets=1, training={"checkpoint_every": 3, "max_steps": 6, "keep_checkpoints": 5})
    run = inproc(cfg)
    run.run()
    assert checkpoint_steps(run) == [3, 6]  # the periodic checkpoint fell on the last step: not written again
    meta = json.loads((run.run_dir / "checkpoints" / read_latest_pointer(run.run_dir / "checkpoints") / "meta.json").read_text())
    assert meta["extra"]["reason"] == "every 3 steps"


def test_held_out_passes_reach_drafter_0_are_scored_and_never_trained_on(tmp_path, inproc):
    holdout = holdout_file(tmp_path, 120)  # conversations the training data (the first 60) does not hold
    data = FEW_SAMPLES | {"holdout_paths": [str(holdout)]}
    cfg = small_config(tmp_path, targets=2, data=data, training={"holdout_every": 3, "holdout_batches": 2})
    run = inproc(cfg)
    run.run()
    trained = sorted(tuple(i) for i in run.drafter_core.trained_ids)
    assert trained == sorted(run.planned)  # held-out batches never enter training or the ledger
    held = [m for m in run.drafter_io.received if isinstance(m, SlotReady) and m.holdout]
    assert held and all(m.holdout_pass_batches == 2 for m in held)
    passes = [r for r in metrics(run) if "tau_holdout" in r]
    assert passes[0]["holdout_pass"] == 0 and passes[0]["holdout_step"] == 0  # the untrained floor, before the first step
    assert len(passes) >= 2 and all(r["tau_holdout_blocks"] > 0 for r in passes)
    assert [r["holdout_pass"] for r in passes] == sorted({r["holdout_pass"] for r in passes})


def test_the_anchor_budget_moves_on_the_wait_the_loop_measures(tmp_path, inproc):
    """The loop times its own waits and hands them to each step: replaying the recorded (wait_s,
    step_s) through a fresh AnchorBudget gives exactly the anchors every step trained on. The
    target is paced slow (forwarding every 10th round, 20 ms per empty drafter round), so the
    drafter waits far above the 20% target and the budget grows."""
    follow = {"anchor_budget": "follow-wait", "anchor_chunk": 8, "max_anchors_per_batch": 8, "max_anchors_auto": 24, "anchor_window": 2}
    cfg = small_config(tmp_path, targets=1, drafter=follow, transport={"ring_slots": 2}, training={"max_steps": 9})
    run = inproc(cfg)
    run.drafter_io.wait_s = 0.02
    run.run(target_every=10)
    recs = metrics(run)
    d = cfg.drafter
    budget = AnchorBudget(d.max_anchors_per_batch, d.anchor_chunk, d.resolved_max_anchors_auto(), d.anchor_target_wait, d.anchor_window, 4)
    replayed = []
    for r in recs:
        replayed.append(budget.anchors)
        budget.observe(r["wait_s"], r["step_s"], lambda w, s: (w, s))
    assert [r["anchors"] for r in recs] == replayed
    assert sum(r["wait_s"] for r in recs) > 0 and max(replayed) > 8


def test_the_forward_only_ceiling_times_a_warm_forward_that_ships_what_a_plain_forward_ships(tmp_path):
    """The benchmark ceiling (a core observed by ``TargetBenchCounters(ceiling=True)``) forwards each batch once
    untimed (its first pass: a new shape's compiles), then bare and captured: what it ships is what the
    training path's single forward ships, batch for batch; only the first pass and the bare
    baseline are added, and counted apart."""
    import torch

    from dflash_ipc.bench.target_counters import TargetBenchCounters
    from dflash_ipc.rundir.ledger import BatchLedger
    from dflash_ipc.target.core import TargetCore

    cfg = small_config(tmp_path, targets=1)
    plain = TargetCore(cfg, 0, tmp_path / "plain", torch.device("cpu"))
    ceiling = TargetCore(cfg, 0, tmp_path / "ceiling", torch.device("cpu"))
    ceiling.observers.append(TargetBenchCounters(ceiling=True))
    try:
        for core in (plain, ceiling):
            core.start(BatchLedger())
        for _ in range(3):
            a, b = plain.forward_next(), ceiling.forward_next()
            assert a.wire_id == b.wire_id and torch.equal(a.meta.token_ids, b.meta.token_ids)
            assert len(a.planes) == len(b.planes) and all(torch.equal(x, y) for x, y in zip(a.planes, b.planes))
        ran, timed = ceiling.stats(), plain.stats()
        assert ran.forwards == timed.forwards == 3 and ran.tokens == timed.tokens
        assert ran.first_pass_forward_s > 0 and timed.first_pass_forward_s == 0
        assert ran.bare_forwards == 2 and timed.bare_forwards == 0  # steady state: after the first batch
    finally:
        plain.close()
        ceiling.close()
