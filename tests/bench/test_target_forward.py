"""bench/target_forward.py's timing: no timed pass contains the first call of a batch's shape.

Each batch of a plan has its own shape, and on the GPU the first call of a shape pays for
fla's Triton autotuning, torch.compile's recompiles and cuBLAS's heuristics. These tests count
the calls that reach a real tiny Qwen3.5 stack, per shape, through a forward pre-hook."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from dflash_ipc.bench.target_forward import run, time_variant
from dflash_ipc.config import TargetConfig
from dflash_ipc.target_spec.hf_config import tiny_spec

VOCAB = 300


@pytest.fixture(scope="module")
def tiny_target():
    from dflash_ipc.target.model import build_target

    return build_target(TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[1, 2], varlen=True), "cpu")


def _batches(shapes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b, length in shapes:
        lens = [length - (i % 3) for i in range(b)]  # right-padded rows of unequal lengths
        out.append((torch.randint(1, VOCAB, (b, length), generator=g), lens))
    return out


def _record_calls(model) -> tuple[list[tuple], object]:
    """The layout each stack call saw: input shape, and for a packed row its position ids."""
    calls: list[tuple] = []

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        pos = kwargs.get("position_ids")
        calls.append((tuple(ids.shape), None if pos is None else tuple(pos.flatten().tolist())))

    return calls, model.stack.register_forward_pre_hook(pre_hook, with_kwargs=True)


@pytest.mark.parametrize("variant", ["padded", "packed"])
@pytest.mark.parametrize("warmup_passes", [1, 2])
def test_timed_pass_never_holds_the_first_call_of_a_shape(tiny_target, variant, warmup_passes):
    batches = _batches([(3, 20), (2, 33), (5, 12), (3, 20), (1, 40)])
    calls, handle = _record_calls(tiny_target)
    try:
        r = time_variant(tiny_target, variant, batches, peak_tflops=1.0, warmup_passes=warmup_passes)
    finally:
        handle.remove()
    k = len(batches)
    assert len(calls) == (warmup_passes + 1) * k
    warm, timed = calls[: warmup_passes * k], calls[warmup_passes * k :]
    seen = Counter(warm)
    # every distinct layout, each as often as the plan holds it, ran untimed before the timed pass
    assert all(seen[c] == warmup_passes * n for c, n in Counter(timed).items()), (seen, timed)
    assert len(set(timed)) == 4  # the plan repeats one batch layout
    assert r["warmup_passes"] == warmup_passes and r["batches"] == k and len(r["per_batch_ms"]) == k
    assert r["real_tokens"] == sum(sum(lens) for _, lens in batches)


def test_no_warmup_is_refused(tiny_target):
    with pytest.raises(ValueError, match="warmup_passes must be >= 1"):
        time_variant(tiny_target, "padded", _batches([(2, 10)]), peak_tflops=1.0, warmup_passes=0)


def test_whole_bench_on_the_tiny_cpu_config_says_how_it_timed(tmp_path):
    """The module end to end on configs/tiny-cpu.toml (FP8 through CPU ``_scaled_mm``, merged and not): every
    variant's result and the JSON name their warm-up passes; the ratios come from those results."""
    out = tmp_path / "fwd.json"
    run("configs/tiny-cpu.toml", str(out), n_batches=3, warmup_passes=1, agree_batches=1, device="cpu", fp8_off_gpu=True)
    d = json.loads(out.read_text())
    assert d["timing"] == {"warmup_passes_per_variant": 1, "timed_passes_per_variant": 1, "each_warmup_pass": "every batch"}
    assert set(d["results"]) == {"padded-bf16", "packed-bf16", "padded-fp8", "packed-fp8", "packed-fp8-unmerged"}
    assert all(r["warmup_passes"] == 1 and r["batches"] == 3 for r in d["results"].values())
    rate = {k: r["tokens_per_s"] for k, r in d["results"].items()}
    assert d["ratios"]["fp8_over_bf16_packed"] == round(rate["packed-fp8"] / rate["packed-bf16"], 4)
    # the FP8 variants run the product's merged siblings; the unmerged one is their baseline, bit for bit the same here
    assert d["fp8_merged"]["groups"] > 0 and d["merged_vs_unmerged_max_abs"] == 0.0
    assert d["ratios"]["fp8_merged_over_unmerged_packed"] == round(rate["packed-fp8"] / rate["packed-fp8-unmerged"], 4)
    assert [row["layer"] for row in d["agreement_fp8_vs_bf16"]] == d["layer_ids"]
