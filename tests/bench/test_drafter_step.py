"""The drafter step's speed options (drafter.compile, training.ce_compile) keep its numbers and compile
once for all batch shapes; `dflash-ipc bench drafter-step` times the real step on the tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

from dflash_ipc.bench.drafter_step import (
    build_bench_drafter,
    document_lengths,
    gemm_flops,
    synthetic_batches,
    variant_config,
    variant_overrides,
)
from dflash_ipc.cli import main
from dflash_ipc.config import load_config
from dflash_ipc.drafter.loss.objective import chunked_lm_loss, compute_loss

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
# fp32 on the CPU: inductor's fused kernels sum in another order than eager's, so values agree to a
# few ulps of their magnitude, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _loss_and_grads(model, views, cfg, seed=0):
    model.zero_grad(set_to_none=True)
    out = compute_loss(model, views, cfg.drafter, cfg.training, torch.Generator().manual_seed(seed))
    out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_compiled_layers_match_eager_and_a_new_batch_shape_compiles_nothing(fresh_dynamo):
    cfg = load_config(str(TINY))
    model = build_bench_drafter(cfg, torch.device("cpu"), random_target=False)
    first, second = synthetic_batches(model, cfg, 2, 700, 90, 0.7)
    assert first.seq_lens.tolist() != second.seq_lens.tolist()
    loss_eager, grads_eager = _loss_and_grads(model, first, cfg)
    assert _graphs() == 0  # eager by default: nothing compiled
    model.compile_dense = True
    loss_compiled, grads_compiled = _loss_and_grads(model, first, cfg)
    after_first = _graphs()
    # before- and after-attention graphs, each once for layer 0 (its input, the frozen embedding, needs
    # no grad) and once for the layers above: one graph per guard set, shared by every layer
    assert 1 <= after_first <= 4
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=RTOL, atol=ATOL)
    for name, g in grads_eager.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(grads_compiled[name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)
    _loss_and_grads(model, second, cfg)
    assert _graphs() == after_first, "a batch of another shape recompiled the dense parts"
    with torch.no_grad():  # a held-out pass runs eager: nothing compiles in the middle of training
        held_out = compute_loss(model, second, cfg.drafter, cfg.training, torch.Generator().manual_seed(0))
    assert _graphs() == after_first
    model.compile_dense = False
    with torch.no_grad():
        eager = compute_loss(model, second, cfg.drafter, cfg.training, torch.Generator().manual_seed(0))
    assert torch.equal(held_out.loss_sum, eager.loss_sum)
    assert counters["stats"]["calls_captured"] > 0


def test_compiled_ce_chunks_match_eager_and_compile_once(fresh_dynamo):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 32, generator=g) * 0.2

    def run(rows: int, compiled: bool):
        hidden = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows), requires_grad=True)
        labels = torch.randint(0, 300, (rows,), generator=torch.Generator().manual_seed(rows + 1))
        w = torch.rand(rows, generator=torch.Generator().manual_seed(rows + 2))
        res = chunked_lm_loss(hidden, weight, labels, w, 48, compiled=compiled)  # rows % 48 != 0: a short last chunk
        res.loss_sum.backward()
        return res, hidden.grad

    eager, grad_eager = run(130, False)
    compiled, grad_compiled = run(130, True)
    graphs = _graphs()
    assert graphs >= 1
    torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=RTOL, atol=ATOL)
    assert torch.equal(compiled.pred, eager.pred)
    torch.testing.assert_close(grad_compiled, grad_eager, rtol=1e-4, atol=1e-6)
    run(77, True)  # another row count, another last-chunk length
    assert _graphs() == graphs


def test_compute_loss_with_ce_compile_matches_eager(fresh_dynamo):
    cfg = load_config(str(TINY))
    model = build_bench_drafter(cfg, torch.device("cpu"), random_target=False)
    (views,) = synthetic_batches(model, cfg, 1, 400, 80, 0.8)
    loss_eager, grads_eager = _loss_and_grads(model, views, cfg)
    ce_cfg = variant_config(cfg, "ce-compile+ce-chunk-64")
    assert ce_cfg.training.ce_compile and ce_cfg.training.ce_chunk_tokens == 64
    loss_compiled, grads_compiled = _loss_and_grads(model, views, ce_cfg)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=RTOL, atol=ATOL)
    for name, g in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], g, rtol=1e-4, atol=1e-5 * (float(g.abs().max()) or 1.0), msg=name)


def test_gemm_flops_equal_what_torch_counts_in_a_real_step():
    # attention is left out of gemm_flops (its work follows the mask, not the widths): the dense SDPA
    # kernel keeps its products out of aten.mm/bmm, where the blockwise path's would be counted
    cfg = load_config(str(TINY), sets=["drafter.attention=sdpa"])
    model = build_bench_drafter(cfg, torch.device("cpu"), random_target=False)
    (views,) = synthetic_batches(model, cfg, 1, 300, 60, 0.8)
    with FlopCounterMode(display=False) as counter:
        out = compute_loss(model, views, cfg.drafter, cfg.training, torch.Generator().manual_seed(0))
        out.loss_sum.backward()
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counted.items() if str(op) in ("aten.mm", "aten.addmm", "aten.bmm"))
    layers, head = gemm_flops(model, 300, out.num_query_tokens, int(out.count_per_pos.sum()))
    assert layers + head == matmuls
    assert 0 < head < layers + head


def test_variant_names_and_document_lengths():
    assert variant_overrides("base") == {"drafter": {}, "training": {}}
    assert variant_overrides("compile+ce-chunk-8192") == {"drafter": {"compile": True}, "training": {"ce_chunk_tokens": 8192}}
    assert variant_overrides("eager") == {"drafter": {"compile": False}, "training": {"ce_compile": False}}
    assert variant_overrides("attn-sdpa") == {"drafter": {"attention": "sdpa"}, "training": {}}
    with pytest.raises(ValueError, match=r"variant 'attn-dense': drafter\.attention"):
        variant_config(load_config(str(TINY)), "attn-dense")
    both = {"drafter": {"anchor_chunk": 4, "draft_vocab_size": 16384}, "training": {}}
    assert variant_overrides("anchor-chunk-4+draft-vocab-16384") == both
    with pytest.raises(ValueError, match=r"variant 'ce-chunk-8': training\.ce_chunk_tokens: must be >= 16"):
        variant_config(load_config(str(TINY)), "ce-chunk-8")
    for bad in ("fast", "ce-chunk-", "ce-chunk-0", "compile+nope"):
        with pytest.raises(ValueError, match="variant"):
            variant_overrides(bad)
    with pytest.raises(ValueError, match=r"variant 'ce-chunk-8': training\.ce_chunk_tokens: must be >= 16"):
        variant_config(load_config(str(TINY)), "ce-chunk-8")
    lens = document_lengths(5000, 200, 256, torch.Generator().manual_seed(0))
    assert sum(lens) == 5000 and min(lens) >= 2
    assert all(100 <= n <= 256 for n in lens[:-1])


def test_bench_cli_times_the_real_step_in_variants_with_a_profile(tmp_path):
    out = tmp_path / "step.json"
    args = ["bench", "drafter-step", "--config", str(TINY), "--variants", "base,ce-chunk-64", "--steps", "2", "--batches", "2"]
    r = CliRunner().invoke(main, [*args, "--tokens", "512", "--doc-len", "100", "--profile", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(r.output.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    assert list(result["variants"]) == ["base", "ce-chunk-64"]
    for v in result["variants"].values():
        med = v["median_s"]
        assert all(med[p] > 0 for p in ("prep", "forward", "loss", "backward", "optimizer", "step"))
        assert med["step"] >= med["forward"] + med["backward"]
        assert v["blocks_per_batch"] > 0 and v["query_tokens_per_batch"] == 8 * v["blocks_per_batch"]
        assert v["graphs_compiled_timed"] == 0
        assert 0 < v["loss_rows_per_batch"] <= v["query_tokens_per_batch"]
        assert v["gemm_tflops_per_s"] > 0 and 0 < v["lm_head_share_of_gemm_flops"] < 1
    # the same weights, batch and anchors: chunking the CE changes no number
    assert result["ratios"]["ce-chunk-64"]["loss_step0_rel_diff"] < 1e-6
    assert result["ratios"]["base"]["step"] == 1.0
    prof = result["profile"]["base"]["classes"]
    assert {"ce_loss", "optimizer", "gemm"} <= set(prof)
    assert abs(sum(c["pct"] for c in prof.values()) - 100.0) < 0.1


def test_bench_cli_refuses_an_unknown_variant_before_building_anything():
    for variants, why in (("base,turbo", "unknown variant 'turbo'"), ("ce-chunk-4", "training.ce_chunk_tokens: must be >= 16")):
        r = CliRunner().invoke(main, ["bench", "drafter-step", "--config", str(TINY), "--variants", variants])
        assert r.exit_code == 2, r.output
        assert why in r.output


@pytest.mark.gpu
def test_on_the_gpu_compiled_layers_and_ce_chunks_keep_the_bf16_step_and_compile_once(fresh_dynamo):
    """SmolLM2-135M shapes, bf16, flex attention (compiled on its own): both compile options against eager."""
    # the file sets both options itself: the baseline is its eager variant
    cfg = variant_config(load_config(str(Path(__file__).resolve().parents[2] / "configs" / "smollm2-1gpu-synth.toml")), "eager")
    model = build_bench_drafter(cfg, torch.device("cuda:0"), random_target=True)
    assert not model.compile_dense
    first, second = synthetic_batches(model, cfg, 2, 4096, 270, 0.85)

    def loss_and_grads(c, views):
        model.zero_grad(set_to_none=True)
        out = compute_loss(model, views, c.drafter, c.training, torch.Generator(device="cuda:0").manual_seed(0))
        out.loss_sum.backward()
        return out.loss_sum.detach().float(), torch.cat([p.grad.float().flatten() for p in model.trainable_parameters()])

    loss_eager, grad_eager = loss_and_grads(cfg, first)
    graphs_eager = _graphs()  # flex attention's own compile
    fast = variant_config(cfg, "compile+ce-compile")
    model.compile_dense = True
    loss_fast, grad_fast = loss_and_grads(fast, first)
    graphs = _graphs()
    assert graphs > graphs_eager
    # bf16 activations: the fused kernels round in other places than eager's
    torch.testing.assert_close(loss_fast, loss_eager, rtol=2e-3, atol=0.0)
    assert float(torch.nn.functional.cosine_similarity(grad_fast, grad_eager, dim=0)) > 0.999
    loss_and_grads(fast, second)
    assert _graphs() == graphs, "a batch of another shape recompiled"
