"""Anchor micro-batching: one optimizer step over K anchor chunks equals one step over all anchors.

The drafter's blocks never see each other and the loss is a token-weighted *sum* divided once by
the (global) weight, so running the anchors chunk by chunk (backward after each, gradients added
in the trainer's flat buffer) must give the same gradients and the same updated weights as one
forward over all of them, also when the batch is split over data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import free_port, process_group_rank, spawn_ranks
from test_dflash_loss import packed_views, split_by_documents, tiny_model

from dflash_ipc.config import DrafterConfig, TrainingConfig
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.training.trainer import DrafterTrainer
from dflash_ipc.transport.slots import SlotViews

LAYERS = ["sliding_attention", "full_attention"]
LENS = [9, 14, 7, 12]
TC = TrainingConfig(lr=1e-2, warmup_steps=0, max_steps=3, grad_clip=0.0, ce_chunk_tokens=16)
# D-PACE: weights from the drafter's own confidence, normalised by the blocks or by the weights' sum
DPACE = dataclasses.replace(TC, loss_weighting="dpace")
DPACE_W = dataclasses.replace(DPACE, dpace_normalizer="weights")
WEIGHTING_TCS = {"decay": TC, "dpace-blocks": DPACE, "dpace-weights": DPACE_W}
WEIGHTINGS = pytest.mark.parametrize("tc", list(WEIGHTING_TCS.values()), ids=list(WEIGHTING_TCS))


def chunked(dc: DrafterConfig, anchor_chunk: int) -> DrafterConfig:
    return dataclasses.replace(dc, anchor_chunk=anchor_chunk)


def test_compute_loss_chunks_add_up_to_the_whole_batch():
    model, dc = tiny_model(LAYERS, num_anchors=64)
    views = packed_views(LENS, seed=3)
    outs, grads = [], []
    for chunk in (0, 5, 1):
        model.zero_grad()
        out = L.compute_loss(model, views, chunked(dc, chunk), TC, torch.Generator().manual_seed(1))
        out.loss_sum.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    whole = outs[0]
    assert whole.num_blocks > 5  # several chunks really ran
    for out, g in zip(outs[1:], grads[1:]):
        assert out.num_blocks == whole.num_blocks and out.num_query_tokens == whole.num_query_tokens
        assert torch.equal(out.weight_sum, whole.weight_sum)  # the whole batch's weight, not a chunk's
        torch.testing.assert_close(out.loss_sum, whole.loss_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.ce_sum, whole.ce_sum, rtol=1e-5, atol=1e-5)
        assert torch.equal(out.correct_per_pos, whole.correct_per_pos)
        assert torch.equal(out.count_per_pos, whole.count_per_pos)
        assert g.keys() == grads[0].keys()
        for n in g:
            torch.testing.assert_close(g[n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def _train(anchor_chunk: int, views_per_step: list[SlotViews], trainer_kwargs: dict | None = None, tc: TrainingConfig = TC):
    model, dc = tiny_model(LAYERS, num_anchors=64, seed=5)
    dc = chunked(dc, anchor_chunk)
    # Adam's eps keeps the update Lipschitz in the gradient: at the default 1e-8 a gradient element near 0
    # turns into a ~sign step, and fp32 summation-order noise (1e-7) would move it by up to lr.
    tr = DrafterTrainer(model, tc, eps=1e-3, **(trainer_kwargs or {}))
    calls = []

    def accumulate(loss_sum):
        calls.append(float(loss_sum.detach()))
        tr.accumulate(loss_sum)

    stats, grads = [], []
    for views in views_per_step:
        out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(1), accumulate)
        stats.append(tr.step(out.loss_sum, out.weight_sum))
        grads.append(tr._grad_flat.clone())  # the global-weight-normalised gradient of this step
    tr.close()
    return tr.trainable_state_dict(), stats, grads, len(calls)


@WEIGHTINGS
def test_one_step_over_k_chunks_equals_one_step_over_all_anchors(tc):
    steps = [packed_views(LENS, seed=s) for s in (3, 4, 5)]
    ref_w, ref_stats, ref_g, ref_calls = _train(0, steps, tc=tc)
    assert ref_calls == 0
    for chunk in (4, 7):
        w, st, g, calls = _train(chunk, steps, tc=tc)
        assert calls >= 3 * 2  # every step ran several chunks, all but the last through accumulate
        for a, b in zip(g, ref_g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)  # fp32 summation order
        for s, r in zip(st, ref_stats):
            assert s.global_weight == pytest.approx(r.global_weight, rel=1e-6)
            assert s.global_loss == pytest.approx(r.global_loss, rel=1e-5)  # all chunks' loss, not the last's
            assert s.grad_norm == pytest.approx(r.grad_norm, rel=1e-5)
        for n in ref_w:
            torch.testing.assert_close(w[n], ref_w[n], rtol=1e-5, atol=1e-6, msg=n)
        assert any(not torch.equal(w[n], _train(0, [])[0][n]) for n in w)  # the steps did move the weights


def test_bf16_compute_accumulates_chunks_in_the_fp32_gradient():
    model, dc = tiny_model(LAYERS, num_anchors=64, seed=5)
    views = packed_views(LENS, seed=3)
    norms = []
    for chunk in (0, 4):
        m, _ = tiny_model(LAYERS, num_anchors=64, seed=5)
        m = m.to(torch.bfloat16)
        tr = DrafterTrainer(m, TC, compute_dtype=torch.bfloat16)
        v = SlotViews(views.planes.bfloat16(), views.token_ids, views.loss_mask, views.seq_lens)
        out = L.compute_loss(m, v, chunked(dc, chunk), TC, torch.Generator().manual_seed(1), tr.accumulate)
        norms.append(tr.step(out.loss_sum, out.weight_sum).grad_norm)
        assert all(p.grad is None for p in tr.params)  # nothing left behind for the next step
        tr.close()
    assert norms[1] == pytest.approx(norms[0], rel=2e-2)


# --------------------------------------------------------------------------- two gloo ranks


def _halves(seed: int) -> list[SlotViews]:
    return split_by_documents(packed_views(LENS, seed=seed), LENS, 2)


def _dp_worker(rank: int, port: int, out_dir: str) -> None:
    """Every weighting in one pair of ranks (one process group, not one per weighting)."""
    with process_group_rank(rank, port) as world:
        for name, tc in WEIGHTING_TCS.items():
            weights, stats, _, calls = _train(3, [_halves(s)[rank] for s in (3, 4)], {"world": world, "bucket_mb": 1e-4}, tc)
            out = {"weights": weights, "weight": [s.global_weight for s in stats], "calls": calls}
            torch.save(out, os.path.join(out_dir, f"{name}-rank{rank}.pt"))


@pytest.mark.slow  # two gloo ranks
def test_two_ranks_with_anchor_chunks_equal_one_rank_without(tmp_path):
    """Data parallel + micro-batching: each rank chunks its half; the token-weighted reduction
    (global loss sum / global weight) still gives the one-process, one-forward step, for each
    weighting. D-PACE's normaliser (blocks, or its confidence-dependent weights) is a sum over
    blocks, all-reduced alike."""
    spawn_ranks(_dp_worker, args=(free_port(), str(tmp_path)))
    model, dc = tiny_model(LAYERS, num_anchors=64, seed=5)
    for name, tc in WEIGHTING_TCS.items():
        r0, r1 = (torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=True) for r in range(2))
        ref_w, ref_stats, _, _ = _train(0, [packed_views(LENS, seed=s) for s in (3, 4)], tc=tc)
        w_a, w_b = (float(L.compute_loss(model, h, dc, tc, torch.Generator().manual_seed(1)).weight_sum) for h in _halves(3))
        assert abs(w_a - w_b) > 0.5, name  # unequal halves: a mean of per-rank means would differ
        assert r0["calls"] > 0 and r1["calls"] > 0, name
        for gw0, gw1, r in zip(r0["weight"], r1["weight"], ref_stats):
            assert gw0 == gw1 == pytest.approx(r.global_weight, rel=1e-6), name
        for n in ref_w:
            assert torch.equal(r0["weights"][n], r1["weights"][n]), (name, n)
            torch.testing.assert_close(r0["weights"][n], ref_w[n], rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")
