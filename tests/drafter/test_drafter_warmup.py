"""The drafter's handshake warm-up: one forward+backward on a dummy batch that changes nothing.

A real :class:`DrafterCore` (tiny-cpu config: builtin tokenizer, random Qwen3.5-family heads) warms
up, then trains; its weights, step, RNG streams and metrics must be bit-identical to a core that
never warmed up, before and after training, and its optimizer state after training too (the warm-up
makes AdamW's zero moments early; nothing else).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.config import load_config
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.training.distributed import DistInfo
from dflash_ipc.drafter.training.time_budget import MEASURE_FROM
from dflash_ipc.transport.slots import SlotViews


def make_core(tmp_path: Path, name: str, drafter: dict) -> DrafterCore:
    cfg = load_config(write_toml(tmp_path / f"{name}.toml", tiny_cpu_config(drafter=drafter)))
    run_dir = tmp_path / name
    run_dir.mkdir()
    torch.manual_seed(123)  # the core seeds the global RNG itself; this only makes a leak visible
    return DrafterCore(cfg, run_dir, DistInfo.single("cpu"), torch.device("cpu"), total_steps=10, resume=False)


def batches(core: DrafterCore, n: int = 2) -> list[SlotViews]:
    g = torch.Generator().manual_seed(7)
    lens = torch.tensor([300, 200, 124], dtype=torch.int32)
    t = int(lens.sum())
    k = core.model.config.num_context_planes
    return [
        SlotViews(
            planes=torch.randn(k, t, core.target_hidden_size, generator=g),
            token_ids=torch.randint(0, core.model.config.vocab_size, (t,), generator=g),
            loss_mask=(torch.rand(t, generator=g) > 0.2).to(torch.uint8),
            seq_lens=lens,
        )
        for _ in range(n)
    ]


def state(core: DrafterCore) -> dict:
    return {
        "trainer": core.trainer.state_dict(),
        "generator": core.generator.get_state(),
        "rng": torch.get_rng_state(),
        "step": core.step,
        "grads": core.trainer._grad_buf.clone(),
    }


def assert_identical(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("anchor_chunk", [0, 24])
def test_warm_up_changes_nothing_and_training_matches(tmp_path, anchor_chunk):
    drafter = {"anchor_chunk": anchor_chunk}
    warm, cold = make_core(tmp_path, "warm", drafter), make_core(tmp_path, "cold", drafter)
    before = state(warm)
    assert_identical(before, state(cold))
    seconds = warm.warm_up()
    assert seconds > 0 and warm.warmup_s == seconds and warm.stats().warmup_s == seconds
    assert cold.stats().warmup_s is None
    after = state(warm)
    # AdamW's state now exists as its first step makes it (zero moments, step 0); nothing else moved.
    made = after["trainer"]["optimizer"].pop("state")
    assert not before["trainer"]["optimizer"].pop("state")
    assert len(made) == len(warm.trainer.master_params)
    for per_param in made.values():
        assert float(per_param["step"]) == 0 and not per_param["exp_avg"].any() and not per_param["exp_avg_sq"].any()
    assert_identical(after, before)  # weights, step, RNG streams, gradient buffer
    assert all(p.grad is None or not p.grad.any() for p in warm.trainer.params)
    assert not warm.metrics.path.exists()  # the warm-up is no step: nothing logged, nothing in the ledger
    assert len(warm.ledger) == 0 and not warm._new_ids
    recs = {}
    for name, core in (("warm", warm), ("cold", cold)):
        recs[name] = [core.train_step(v, [0, i], 0.0, 0.0) for i, v in enumerate(batches(core))]
    assert_identical(state(warm), state(cold))
    for rw, rc in zip(recs["warm"], recs["cold"]):
        assert rw["loss"] == rc["loss"] and rw["grad_norm"] == rc["grad_norm"] and rw["acc_per_pos"] == rc["acc_per_pos"]
    assert recs["warm"][-1]["step"] == 2
    # the live rate starts after the steps that compile (drafter/core.py RecentRate, from MEASURE_FROM on),
    # warm-up or not: none after two steps, then the span from step MEASURE_FROM to the last
    assert MEASURE_FROM > 2 and warm.stats().recent_step_s is None
    more = [warm.train_step(v, [0, 2 + i], 0.0, 0.0) for i, v in enumerate(batches(warm, MEASURE_FROM))]
    by_step = {r["step"]: r for r in recs["warm"] + more}
    start, last = by_step[MEASURE_FROM], more[-1]
    work = warm.stats()
    assert work.recent_step_s == pytest.approx((last["elapsed_s"] - start["elapsed_s"]) / (last["step"] - MEASURE_FROM))
    tokens = sum(by_step[s]["tokens"] for s in range(MEASURE_FROM + 1, last["step"] + 1))
    assert work.recent_tokens_per_s == pytest.approx(tokens / (last["elapsed_s"] - start["elapsed_s"]))
    warm.close()
    cold.close()
