"""``drafter.anchor_chunk = "auto"`` (drafter/training/memory_plan.py) and the chunked CE's in-place passes.

The chunk choice is a pure function of widths and memory figures: given an H200's numbers with a target
beside the drafter, 4,096 anchors at Qwen3-8B and Qwen3.6-27B widths get a chunk whose planned bytes fit,
and the figure per anchor is the one measured at 8B widths. The in-place CE passes give the out-of-place
numbers (fp32: to rounding, 1e-6 relative).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_dflash_loss import packed_views, tiny_model

from dflash_ipc.config import ConfigError, DrafterConfig, TrainingConfig, load_config
from dflash_ipc.drafter.loss import chunked_ce as CE
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.training import memory_plan as M

GIB = 2**30
H200_TOTAL = int(139.8 * GIB)


def widths(hidden, intermediate, q_dim, kv_dim, vocab, tokens, ce_chunk=4096) -> M.DrafterWidths:
    return M.DrafterWidths(
        hidden=hidden, intermediate=intermediate, q_dim=q_dim, kv_dim=kv_dim, num_layers=5, num_planes=5,
        head_rows=vocab, block_size=16, context_tokens=tokens, dtype_bytes=2, ce_chunk_tokens=ce_chunk,
    )  # fmt: skip


QWEN3_8B = widths(4096, 12288, 32 * 128, 8 * 128, 151936, 16384)
QWEN36_27B = widths(5120, 17408, 24 * 256, 4 * 256, 248320, 16384)


def planned(w: M.DrafterWidths, chunk: int) -> int:
    return M.shared_step_bytes(w) + chunk * M.bytes_per_anchor(w)


def test_the_figure_per_anchor_is_the_one_measured_at_8b_widths():
    # one H200: a 2,048-anchor chunk peaked 24.2 GiB above a 1,024-anchor one at these widths
    measured = 24.2 * GIB / 1024
    assert measured <= M.bytes_per_anchor(QWEN3_8B) <= 1.3 * measured


@pytest.mark.parametrize("w, target_gib, drafter_gib", [(QWEN3_8B, 21, 21), (QWEN36_27B, 60, 38)], ids=["qwen3-8b", "qwen3.6-27b"])
def test_4096_anchors_get_a_chunk_that_fits_an_h200_with_the_target_beside_it(w, target_gib, drafter_gib):
    target, fixed = target_gib * GIB, drafter_gib * GIB
    # measured before the target loaded (the warm-up overlaps its load): free memory alone would allow more
    budget = M.device_budget(
        free_bytes=H200_TOTAL - 2 * GIB, total_bytes=H200_TOTAL, drafter_pending=fixed, drafter_fixed=fixed, target_need=target
    )
    assert budget == H200_TOTAL - target - fixed - M.RESERVE_BYTES
    chunk = M.choose_anchor_chunk(w, 4096, budget)
    assert chunk < 4096 and chunk % M.GRANULE == 0
    assert planned(w, chunk) <= budget
    chunks = -(-4096 // chunk)
    assert chunk * (chunks - 1) < 4096  # no empty chunk: the fewest equal chunks
    assert planned(w, chunk + M.GRANULE) > budget or -(-4096 // (chunk + M.GRANULE)) == chunks


def test_the_8b_choice_matches_what_ran_on_one_h200():
    # 4,096 anchors in one forward ran out of memory beside the target; chunks of 2,048 peaked at 73.7 GiB
    budget = M.device_budget(H200_TOTAL, H200_TOTAL, 0, 21 * GIB, 21 * GIB)
    assert M.choose_anchor_chunk(QWEN3_8B, 4096, budget) == 2048


def test_anchors_that_fit_run_in_one_forward_and_nothing_fitting_gives_the_smallest_chunk():
    assert M.choose_anchor_chunk(QWEN3_8B, 1024, 80 * GIB) == 1024
    assert M.choose_anchor_chunk(QWEN3_8B, 4096, 1 * GIB) == M.GRANULE
    assert M.choose_anchor_chunk(QWEN3_8B, 100, 1 * GIB) == 100
    with pytest.raises(ValueError, match="anchors must be >= 1"):
        M.choose_anchor_chunk(QWEN3_8B, 0, 80 * GIB)


def test_free_memory_bounds_the_budget_when_something_else_holds_the_gpu():
    by_total = M.device_budget(H200_TOTAL, H200_TOTAL, 0, 20 * GIB, 20 * GIB)
    by_free = M.device_budget(30 * GIB, H200_TOTAL, 5 * GIB, 20 * GIB, 20 * GIB)
    assert by_free == 25 * GIB - M.RESERVE_BYTES < by_total


def test_wider_heads_and_layers_get_smaller_chunks():
    budget = 70 * GIB
    assert M.choose_anchor_chunk(QWEN36_27B, 8192, budget) < M.choose_anchor_chunk(QWEN3_8B, 8192, budget)


def test_auto_is_a_config_value_refused_with_follow_wait_and_resolved_on_cpu(tmp_path):
    assert DrafterConfig(anchor_chunk="auto").anchor_chunk == "auto"
    with pytest.raises(ValueError, match='must be "auto"'):
        DrafterConfig(anchor_chunk=-1)
    with pytest.raises(ValueError, match="anchor_chunk > 0"):
        DrafterConfig(anchor_chunk="auto", anchor_budget="follow-wait", max_anchors_per_batch=1024)
    path = tmp_path / "c.toml"
    path.write_text('[drafter]\nanchor_chunk = "most"\n')
    with pytest.raises(ConfigError, match="drafter.anchor_chunk"):
        load_config(path)
    path.write_text(
        '[drafter]\nanchor_chunk = "auto"\nnum_anchors = 64\n[data]\nmax_seq_len = 128\nbucket_edges = [128]\n'
        "token_budget = 512\nmax_batch_size = 4\n"
    )
    cfg = load_config(path)
    model, _ = tiny_model(["full_attention"])
    resolved, why = M.resolve_anchor_chunk(cfg, model, "cpu")
    assert resolved.drafter.anchor_chunk == 256 == M.max_anchors_per_batch(cfg.drafter, cfg.data)
    assert "auto: 256" in why and cfg.drafter.anchor_chunk == "auto"
    assert M.resolve_anchor_chunk(resolved, model, "cpu") == (resolved, "")


def test_the_fp8_head_copies_count_in_the_drafters_fixed_state():
    """``training.ce_fp8``: two e4m3 copies of the head (~0.6 GB each at Qwen3-8B's), planned before the first
    step makes them, and exactly what it makes."""
    from dflash_ipc.drafter.model.fp8_head import fp8_head_bytes

    model, _ = tiny_model(["full_attention"])
    plain = M.drafter_fixed_bytes(model)
    planned = M.drafter_fixed_bytes(model, ce_fp8=True)
    assert planned - plain == fp8_head_bytes(*model.lm_head_weight.shape) == model.fp8_head().nbytes
    assert M.drafter_fixed_bytes(model) == plain  # made, they are still no parameter or buffer
    assert 1.2e9 < fp8_head_bytes(151936, 4096) < 1.3e9 and 2.5e9 < fp8_head_bytes(248320, 5120) < 2.6e9


def test_compute_loss_refuses_an_unresolved_auto_chunk():
    model, dc = tiny_model(["full_attention"])
    with pytest.raises(ValueError, match="resolve_anchor_chunk"):
        L.compute_loss(model, packed_views([12, 9]), dataclasses.replace(dc, anchor_chunk="auto"), TrainingConfig())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_ce_passes_match_the_out_of_place_ones(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 301, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 301, (37,), generator=g)
    lse, ce, pred = CE._ce_chunk_stats(logits, labels)
    lse2, ce2, pred2 = CE._ce_chunk_stats_in_place(logits.clone(), labels)
    torch.testing.assert_close(lse2, lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ce2, ce, rtol=1e-6, atol=1e-5)
    assert torch.equal(pred2, pred)
    coef, w = torch.rand(37, generator=g), torch.rand(37, generator=g)
    ref = CE._ce_chunk_grad(logits, lse, coef, labels, w, dtype)
    got = CE._ce_chunk_grad_in_place(logits.clone(), lse, coef, labels, w, dtype)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_bench_random_targets_have_the_models_widths_and_an_unknown_one_is_refused():
    from dflash_ipc.bench.drafter_step import RANDOM_TARGETS, build_bench_drafter
    from dflash_ipc.target_spec.hf_config import text_config

    widths = {name: text_config(make()) for name, make in RANDOM_TARGETS.items()}
    assert (widths["qwen3-8b"].hidden_size, widths["qwen3-8b"].vocab_size) == (4096, 151936)
    c = widths["qwen3.6-27b"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size) == (5120, 17408, 64, 248320)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    with pytest.raises(ValueError, match="unknown target shape"):
        build_bench_drafter(load_config_default(), torch.device("cpu"), random_target=True, shape="llama-70b")


def load_config_default():
    from dflash_ipc.config import DFlashConfig

    return DFlashConfig()
