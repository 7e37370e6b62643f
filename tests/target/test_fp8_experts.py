"""FP8 routed experts (target/fp8_experts.py) on real tiny MoE layers of the zoo: each expert's weights are
quantized per output row, the output is the product of the row-quantized inputs and the dequantized weights
pair by pair (the real ``torch._scaled_mm``, which runs on this CPU), close to the bf16 experts; an MoE target
built with ``target.quantization = "fp8"`` converts its experts and logs what stays in bf16 (Llama 4's, whose
forward is its own); on a GPU the grouped GEMM equals the per-expert loop."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from families.family_zoo import build_checkpoint, family_config

import dflash_ipc.target.model as model_mod
from dflash_ipc.config import TargetConfig
from dflash_ipc.platform.e4m3 import E4M3, quantize_rows
from dflash_ipc.target.fp8_experts import Fp8Experts, grouped_gemm_runs, quantize_experts
from dflash_ipc.target.model import build_target

# An expert is two FP8 GEMMs in series, each of two e4m3 roundings (3 mantissa bits): relative to the output's
# norm (one FP8 linear's bound in tests/target/test_fp8.py is 0.05)
FP8_REL = 0.08


def _moe_layer(name: str, device: str = "cpu"):
    """A real bf16 MoE block of family ``name`` (its router and experts), the layer whose MLP is MoE."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(name), attn_implementation="eager").to(device, torch.bfloat16)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    return block


def _routing(block, tokens: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, block.experts.down_proj.shape[1 if not block.experts.is_transposed else 2], generator=g, device=device)
    x = x.to(torch.bfloat16)
    router = block.gate if hasattr(block, "gate") else block.router
    out = router(x)
    weights, index = out[-2], out[-1]  # (logits, weights, index)
    return x, index, weights


def _emulated(fp8: Fp8Experts, activation, x, index, weights) -> torch.Tensor:
    """Pair by pair: the row-quantized input times the dequantized weights in fp32, rounded to bf16 as the FP8
    GEMM writes, the module's own gate between the two projections, the routing weights, summed per token."""
    up, down = fp8.dequantized("up"), fp8.dequantized("down")
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            xq, xs = quantize_rows(x[t : t + 1])
            h = ((xq.float() * xs) @ up[e].t()).to(torch.bfloat16)
            if fp8.up_bias is not None:
                h = h + fp8.up_bias[e]
            hq, hs = quantize_rows(activation(h))
            o = ((hq.float() * hs) @ down[e].t()).to(torch.bfloat16)
            if fp8.down_bias is not None:
                o = o + fp8.down_bias[e]
            out[t] += (o * weights[t, j]).float()[0]
    return out


@pytest.mark.parametrize("name", ["qwen3_5_moe", "gpt_oss"])
def test_fp8_experts_are_the_quantized_rows_times_the_dequantized_experts(name):
    """Qwen3.5-MoE: SwiGLU over [E, 2I, H] weights; gpt-oss: transposed [E, H, 2I] weights, per-expert biases and
    its clamped, interleaved GLU. The FP8 module's bf16 weights are gone, each expert's e4m3 rows carry their
    own scale, the output is the emulated FP8 arithmetic to bf16 rounding and within FP8's error of bf16."""
    block = _moe_layer(name)
    bf16 = copy.deepcopy(block.experts)
    x, index, weights = _routing(block, tokens=40)
    with torch.no_grad():
        reference = bf16(x, index, weights).float()
        fp8 = Fp8Experts(block.experts)
        got = fp8(x, index, weights).float()
        emulated = _emulated(fp8, bf16._apply_gate, x, index, weights)
    assert not fp8.grouped  # the CPU: the per-expert loop of _scaled_mm
    assert not any(p.dim() == 3 for p in block.experts.parameters())  # the bf16 weights went
    assert fp8.up_fp8.dtype == E4M3 and fp8.up_scale.shape == fp8.up_fp8.shape[:2]
    weight = bf16.gate_up_proj.float()
    weight = weight.transpose(1, 2) if bf16.is_transposed else weight
    assert ((fp8.dequantized("up") - weight).abs() <= 2.0**-4 * weight.abs().amax(-1, keepdim=True)).all()
    assert (got - emulated).abs().max().item() <= 2.0**-7 * emulated.abs().max().item()
    assert ((got - reference).norm() / reference.norm()).item() < FP8_REL


def test_an_moe_target_in_fp8_converts_its_experts_and_logs_what_stays_bf16(tmp_path, monkeypatch, caplog):
    """``target.quantization = "fp8"`` (the GPU check lifted: this CPU's ``_scaled_mm`` stands in): Qwen3.5-MoE's
    experts go FP8 and the first layer's capture with FP8 experts alone stays close to bf16 (its router sees the
    same input, so the same experts run; past it a token near a routing tie may switch experts); Llama 4's
    experts run their own dense forward and stay bf16, and the log says how many and how many bytes."""
    monkeypatch.setattr(model_mod, "fp8_device_problem", lambda device, dtype: None)
    ids = torch.randint(3, 1000, (2, 30), generator=torch.Generator().manual_seed(2))
    for name, converted in (("qwen3_5_moe", 2), ("llama4", 0)):  # layers 0 and 1 built: two MoE layers, one
        checkpoint = build_checkpoint(name, tmp_path)
        cfg = TargetConfig(model_path=str(checkpoint), tokenizer="builtin", layer_ids=[0, 1], dtype="bfloat16", varlen=False)
        with caplog.at_level(logging.INFO, logger=model_mod.__name__):
            caplog.clear()
            fp8 = build_target(TargetConfig(**{**cfg.__dict__, "quantization": "fp8"}), "cpu")
        assert sum(isinstance(m, Fp8Experts) for m in fp8.stack.modules()) == converted
        assert all(torch.isfinite(plane).all() for plane in fp8.capture(ids))
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("routed experts"))
        bf16 = build_target(cfg, "cpu")
        if converted:
            assert line == f"routed experts in FP8 e4m3: {converted} modules (0.00 GB)"
            experts_only = build_target(cfg, "cpu")
            assert quantize_experts(experts_only.stack).fp8 == converted
            a, b = bf16.capture(ids)[0].float(), experts_only.capture(ids)[0].float()
            assert 0 < ((a - b).norm() / a.norm()).item() < FP8_REL
        else:
            experts = [layer.feed_forward.experts for layer in bf16.stack.layers if hasattr(layer.feed_forward, "experts")]
            kept = sum(p.numel() * p.element_size() for e in experts for p in e.parameters())
            assert len(experts) == 1 and "kept in the target's dtype (0.00 GB): 1 Llama4TextExperts (its own forward" in line
            report = quantize_experts(bf16.stack)
            assert (report.fp8, sum(report.kept.values()), report.kept_bytes) == (0, 1, kept) and kept > 0


def test_the_grouped_gemms_operands_pass_torchs_own_checks():
    """The CUDA path's ``torch._scaled_grouped_mm`` call, its operands on the meta device: torch's meta kernel
    checks what the CUDA kernel requires (e4m3 operands, the row-major input and column-major experts, 1-D
    input scales, [E, N] expert scales, int32 offsets) and gives the output's shape and dtype."""
    fp8 = Fp8Experts(_moe_layer("qwen3_5_moe").experts).to("meta")
    fp8.grouped = True
    rows, counts = 37, torch.empty(fp8.num_experts, dtype=torch.long, device="meta")
    x = torch.empty(rows, fp8.up_fp8.shape[2], dtype=torch.bfloat16, device="meta")
    out = fp8._gemm(x, fp8.up_fp8, fp8.up_scale, counts)
    assert (tuple(out.shape), out.dtype) == ((rows, fp8.up_fp8.shape[1]), torch.bfloat16)


def test_widths_off_the_fp8_alignment_stay_bf16():
    block = _moe_layer("qwen3_moe")
    with torch.no_grad():
        block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj[:, :, :24].clone())  # I = 24: not a multiple of 16
    report = quantize_experts(torch.nn.ModuleDict({"mlp": block}))
    assert report.fp8 == 0 and list(report.kept.values()) == [1] and "not multiples of 16" in next(iter(report.kept))


@pytest.mark.gpu
def test_cuda_grouped_fp8_experts_equal_the_product_of_their_quantized_operands():
    """On an H100/H200: ``torch._scaled_grouped_mm`` over the experts' row offsets gives, per projection, the fp32
    product of the row-quantized inputs and each expert's dequantized weights rounded once to bf16, at gpt-oss and
    Qwen3-30B-A3B-like widths, experts receiving no token included; the whole module stays within FP8's error of bf16."""
    if not grouped_gemm_runs(torch.device("cuda", 0)):
        pytest.skip("torch._scaled_grouped_mm needs compute capability >= 9.0")
    for name in ("qwen3_5_moe", "gpt_oss"):
        block = _moe_layer(name, "cuda")
        x, index, weights = _routing(block, tokens=777, device="cuda")
        index[:, 0] = index[:, 0].clamp(max=1)  # skew the routing: some experts get no token
        bf16 = copy.deepcopy(block.experts)
        grouped = Fp8Experts(block.experts)
        assert grouped.grouped
        rows = torch.randn(300, grouped.up_fp8.shape[2], device="cuda", dtype=torch.bfloat16)
        counts = torch.tensor([100, 0, 150, 50] + [0] * (grouped.num_experts - 4), device="cuda")
        xq, xs = quantize_rows(rows)
        want = torch.cat(
            [
                (xq[a:b].float() * xs[a:b]) @ grouped.dequantized("up")[e].T
                for e, (a, b) in enumerate(zip([0, 100, 100, 250], [100, 100, 250, 300]))
            ]
        ).to(torch.bfloat16)
        got = grouped._gemm(rows, grouped.up_fp8, grouped.up_scale, counts)
        assert (got.float() - want.float()).abs().max().item() <= 2.0**-7 * want.float().abs().max().item()
        with torch.no_grad():
            a, ref = grouped(x, index, weights).float(), bf16(x, index, weights).float()
        assert ((a - ref).norm() / ref.norm()).item() < FP8_REL
