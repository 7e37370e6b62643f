"""The follow-wait anchor budget inside a real :class:`DrafterCore` (tiny-cpu config): scripted
waits make it grow one chunk per window up to the cap, the sampler trains on that many anchors,
held-out passes do not count, and a checkpoint carries the budget (and its ceiling) into a resumed
run. Waits are scripted far from the thresholds, so no assertion depends on how fast a step runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import free_port, process_group_rank, spawn_ranks, tiny_cpu_config, write_toml
from test_drafter_warmup import batches

from dflash_ipc.config import load_config
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.training.distributed import DistInfo

FOLLOW_WAIT = {"anchor_budget": "follow-wait", "anchor_chunk": 8, "max_anchors_per_batch": 8, "max_anchors_auto": 24, "anchor_window": 2}
SETTLE = 4  # transport.ring_slots (2) + 2 steps not counted after each (re)start
WAITING = 1000.0  # seconds of wait per step: the drafter idles far above the 20% target
BOUND = 0.0  # no wait at all: the drafter is the bound


def make_core(tmp_path: Path, drafter: dict, resume: bool = False, world: DistInfo | None = None) -> DrafterCore:
    cfg = load_config(write_toml(tmp_path / "c.toml", tiny_cpu_config(drafter=drafter, transport={"ring_slots": 2})))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return DrafterCore(cfg, run_dir, world or DistInfo.single("cpu"), torch.device("cpu"), total_steps=40, resume=resume)


def train(core: DrafterCore, waits: list[float]) -> None:
    views = batches(core, 1)[0]
    for wait in waits:
        core.train_step(views, [0, 0, core.step], wait_s=wait, copy_s=0.0)


def metrics(core: DrafterCore) -> list[dict]:
    return [json.loads(line) for line in core.metrics.path.read_text().splitlines()]


def test_budget_grows_per_window_to_the_cap_and_the_sampler_follows(tmp_path, caplog):
    core = make_core(tmp_path, FOLLOW_WAIT)
    views = batches(core, 1)[0]
    assert core.anchors_per_batch == 8 and core.stats().anchors == 8
    caplog.set_level("INFO", logger="dflash_ipc.drafter.core")
    for i in range(SETTLE + 6):
        core.train_step(views, [0, 0, core.step], wait_s=WAITING, copy_s=0.0)
        if i in (SETTLE, SETTLE + 2):  # mid-window: a held-out pass is no step of a window
            core.evaluate_holdout(views, [1, 0, core.step], pass_batches=1)
    recs = metrics(core)
    assert [r["anchors"] for r in recs] == [8] * (SETTLE + 2) + [16, 16] + [24, 24]
    assert core.anchors_per_batch == 24 and core.stats().anchors == 24  # the cap
    # the sampler trains on at most the budget's anchors, and on more once it grew
    assert all(r["tau_blocks"] <= r["anchors"] for r in recs)
    assert max(r["tau_blocks"] for r in recs if r["anchors"] == 24) > 16
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("anchors per batch")]
    assert [ln.split(":")[0] for ln in lines] == ["anchors per batch 8 -> 16", "anchors per batch 16 -> 24"]
    assert "over the last 2 steps (target 20%)" in lines[0]


def test_checkpoint_carries_the_budget_and_its_ceiling_into_a_resumed_run(tmp_path):
    core = make_core(tmp_path, FOLLOW_WAIT)
    train(core, [WAITING] * (SETTLE + 4) + [BOUND] * 2)  # 8 -> 16 -> 24, then bound at 24: back to 16
    assert core.anchors_per_batch == 16 and core.anchor_budget.state.ceiling == 24
    core.checkpoint("test")
    saved = core.anchor_budget.state
    core.close()

    resumed = make_core(tmp_path, FOLLOW_WAIT, resume=True)
    assert resumed.step == core.step and resumed.anchor_budget.state == saved
    assert resumed.anchors_per_batch == 16
    train(resumed, [WAITING] * (SETTLE + 4))  # waiting again, but 24 made it the bound: not retried yet
    assert [r["anchors"] for r in metrics(resumed)][-(SETTLE + 4) :] == [16] * (SETTLE + 4)
    resumed.close()


def test_fixed_budget_is_the_configured_cap_and_ignores_waits(tmp_path):
    core = make_core(tmp_path, {"max_anchors_per_batch": 8})
    assert core.anchor_budget is None
    train(core, [WAITING] * (SETTLE + 4))
    assert {r["anchors"] for r in metrics(core)} == {8} and core.stats().anchors == 8


def _dp_worker(rank: int, port: int, out_dir: str) -> None:
    with process_group_rank(rank, port) as world:
        core = make_core(Path(out_dir) / f"rank{rank}", FOLLOW_WAIT, world=world)
        seen = []
        for _ in range(SETTLE + 4):
            # rank 0 idles, rank 1 never waits: only the window's sums over both ranks can move rank 1
            core.train_step(batches(core, 1)[0], [0, rank, core.step], wait_s=WAITING if rank == 0 else BOUND, copy_s=0.0)
            seen.append(core.last["anchors"])
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(seen + [core.anchors_per_batch]))
        core.close()


@pytest.mark.slow  # two gloo ranks, each a real core
def test_data_parallel_ranks_move_the_budget_together(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    spawn_ranks(_dp_worker, args=(free_port(), str(tmp_path)))
    seen0, seen1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert seen0 == seen1 == [8] * (SETTLE + 2) + [16, 16] + [24]
