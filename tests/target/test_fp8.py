"""FP8 target (target/fp8.py): quantization error bounds, the real ``torch._scaled_mm`` against the
dequantized product, a real tiny Qwen3.5 stack quantized in place, and the refusals.

``torch._scaled_mm`` with row-wise scales also runs on CPU in the test venv's torch, so the same
module is exercised here as on the GPU; the product still refuses FP8 off CUDA >= 8.9 (it would
be slow there), which the config/preflight tests check."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.fp8 import E4M3, Fp8Linear, fp8_device_problem, quantize_linears, quantize_rows
from dflash_ipc.target.model import build_target
from dflash_ipc.target_spec.hf_config import tiny_spec

# e4m3 keeps 3 mantissa bits: a value rounds to within 2^-4 of itself, relative (normal range)
E4M3_REL = 2.0**-4


def test_quantize_rows_maps_each_row_max_to_448_and_round_trips():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)  # rows of very different scales
    q, scale = quantize_rows(x.to(torch.bfloat16))
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (64, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), 448.0))
    back = q.float() * scale
    xb = x.to(torch.bfloat16).float()
    # relative to each row's largest value (small entries fall to e4m3's subnormals)
    err = ((back - xb).abs() / xb.abs().amax(dim=1, keepdim=True)).max().item()
    assert err <= E4M3_REL, err
    z, zs = quantize_rows(torch.zeros(2, 32))
    assert torch.equal(z.float(), torch.zeros(2, 32)) and bool((zs > 0).all())  # an all-zero row: no nan


def test_fp8_linear_is_the_scaled_product_and_close_to_bf16():
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(128, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 128, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 5, 128, generator=g).to(torch.bfloat16)
    fp8 = Fp8Linear(lin)
    y = fp8(x)
    assert y.shape == (3, 5, 48) and y.dtype == torch.bfloat16
    xq, xs = quantize_rows(x.reshape(-1, 128))
    exact = (xq.float() * xs) @ fp8.dequantized_weight().t() + lin.bias.float()
    # _scaled_mm accumulates in fp32 and rounds once to bf16
    assert (y.reshape(-1, 48).float() - exact).abs().max().item() <= 2.0**-8 * exact.abs().max().item()
    ref = lin(x).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # what FP8 costs on a random product (two e4m3 roundings)
    assert fp8.weight_fp8.dtype == E4M3 and not any(p.requires_grad for p in fp8.parameters())


def test_fp8_linear_at_27b_width_is_e4m3_rounding_and_nothing_more():
    """A 5120-wide input (27B's hidden size) against the exact fp32 product: weight rows and
    tokens of magnitudes 100x apart, outlier channels (50x) and outlier tokens (10x), so a
    scale of the wrong granularity (per tensor, or transposed) would push the small rows into
    e4m3's subnormals and show. Rows are independent under per-row scales, so 2,048 of the
    FFN's 17,408 output rows stand for all of them.

    e4m3 rounds to nearest with 3 mantissa bits: a relative error uniform over a spacing of
    2^-3 of the leading power of two, i.e. rms 2^-3 / sqrt(12) * sqrt(E[1/m^2]) = 0.0266 for
    mantissas m log-uniform on [1, 2). Two rounded operands over random signs: sqrt(2) * 0.0266
    = 0.038 on the product. The tolerances below are those figures with 20 % margin."""
    g = torch.Generator().manual_seed(5)
    k, n, m = 5120, 2048, 96
    w = torch.randn(n, k, generator=g) * 0.02 * torch.logspace(-1, 1, n).unsqueeze(1)
    x = torch.randn(m, k, generator=g) * torch.exp(0.5 * torch.randn(k, generator=g))
    x[:, torch.randperm(k, generator=g)[:8]] *= 50
    x[torch.randperm(m, generator=g)[:4]] *= 10
    x = x * torch.logspace(-1, 1, m).unsqueeze(1)
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    xb, wb = x.to(torch.bfloat16), lin.weight.detach().float()
    fp8 = Fp8Linear(lin)
    y = fp8(xb).float()
    exact = xb.float() @ wb.t()

    def rel(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        return (a - b).norm(dim=dim) / b.norm(dim=dim)

    w_err = rel(fp8.dequantized_weight(), wb, dim=1)  # per output row
    assert 0.8 * 0.0266 < w_err.mean().item() < 1.2 * 0.0266 and w_err.max().item() < 0.035, w_err
    xq, xs = quantize_rows(xb)
    x_err = rel(xq.float() * xs, xb.float(), dim=1)  # per token
    assert x_err.max().item() < 1.2 * 0.0266, x_err
    per_token = rel(y, exact, dim=1)
    assert per_token.max().item() < 1.2 * 0.038, per_token
    # the GEMM adds one bf16 rounding to the dequantized product, nothing more
    deq = (xq.float() * xs) @ fp8.dequantized_weight().t()
    assert rel(y, deq).item() < 2.0**-8


def test_quantize_linears_on_a_real_tiny_target_keeps_capture_close():
    """Every linear of the tiny Qwen3.5 stack whose widths are multiples of 16 goes FP8 (the
    4-wide GatedDeltaNet gates stay), embeddings untouched; the captured planes stay close."""
    cfg = TargetConfig(spec=tiny_spec(300), layer_ids=[1, 3, 5], dtype="bfloat16", varlen=False)
    ref = build_target(cfg, "cpu")
    quant = build_target(cfg, "cpu")
    counts = quantize_linears(quant.stack)
    linears = [m for m in ref.stack.modules() if type(m) is nn.Linear]
    gates = [m for m in linears if m.out_features % 16]
    assert counts["fp8"] == len(linears) - len(gates) > 0 and counts["kept"] == len(gates) > 0
    assert isinstance(quant.stack.embed_tokens, nn.Embedding)
    assert type(quant.stack.layers[3].mlp.down_proj) is Fp8Linear
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    for a, b in zip(ref.capture(ids), quant.capture(ids)):
        a, b = a.float().flatten(0, 1), b.float().flatten(0, 1)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
        assert cos > 0.99, cos


def test_fp8_refused_where_it_cannot_run():
    assert "compute capability >= 8.9" in fp8_device_problem("cpu", torch.bfloat16)
    assert "bfloat16" in fp8_device_problem("cuda:0", torch.float32)
    with pytest.raises(ValueError, match=r'target\.quantization = "fp8": .*8\.9'):
        build_target(TargetConfig(spec=tiny_spec(300), layer_ids=[1], dtype="bfloat16", quantization="fp8"), "cpu")


def _quantizers(stack: nn.Module) -> set:
    return {m._quantize for m in stack.modules() if isinstance(m, Fp8Linear)}


def test_the_quantizer_compiles_only_where_the_target_compiles(monkeypatch, tmp_path):
    """The per-token quantizer goes through torch.compile only in a target that fuses its elementwise
    work; an eager target and eval's decoding LM (both of its build paths: a checkpoint, a spec) quantize
    eagerly: eval forwards a few tokens at a time in each worker, where compiles cost more than they save.
    The FP8 device check is lifted so the CPU's ``_scaled_mm`` stands in for the GPU's."""
    import transformers

    import dflash_ipc.target.model as model_mod
    from dflash_ipc.eval.target_lm import build_target_lm

    monkeypatch.setattr(model_mod, "fp8_device_problem", lambda device, dtype: None)
    spec = tiny_spec(300)
    fused = build_target(TargetConfig(spec=spec, layer_ids=[1, 3], dtype="bfloat16", quantization="fp8", fuse_elementwise=True), "cpu")
    assert quantize_rows not in _quantizers(fused.stack) and len(_quantizers(fused.stack)) == 1
    eager = build_target(TargetConfig(spec=spec, layer_ids=[1, 3], dtype="bfloat16", quantization="fp8"), "cpu")
    assert _quantizers(eager.stack) == {quantize_rows}  # "auto" on the CPU: unfused

    spec_cfg = TargetConfig(spec=spec, layer_ids=[1, 3], dtype="bfloat16", quantization="fp8")
    lm = build_target_lm(spec_cfg, "cpu", vocab_size=300, dtype="bfloat16")
    assert _quantizers(lm.model) == {quantize_rows}
    conf = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    transformers.LlamaForCausalLM(conf).save_pretrained(tmp_path / "llama")
    # as on the GPU, where eval's LM would otherwise compile: the CPU default is already eager, so force it
    monkeypatch.setattr(model_mod, "quantize_linears", _forcing_compile(model_mod.quantize_linears))
    checkpoint_cfg = TargetConfig(model_path=str(tmp_path / "llama"), layer_ids=[1], dtype="bfloat16", quantization="fp8")
    lm = build_target_lm(checkpoint_cfg, "cpu", dtype="bfloat16")
    assert _quantizers(lm.model) == {quantize_rows}


def _forcing_compile(quantize_linears_fn):
    """``quantize_linears`` that compiles unless told False explicitly (its CUDA default)."""

    def wrapped(stack, compile_quantizer=None):
        return quantize_linears_fn(stack, compile_quantizer=True if compile_quantizer is None else compile_quantizer)

    return wrapped


@pytest.mark.gpu
def test_cuda_fp8_linear_matches_the_dequantized_product():
    """On the GPU: ``_scaled_mm`` row-wise (fused quantizer compiled) against the fp32 product of
    the dequantized operands: within one bf16 rounding of the output."""
    if not torch.cuda.is_available() or fp8_device_problem("cuda:0", torch.bfloat16):
        pytest.skip("needs a CUDA GPU of capability >= 8.9")
    g = torch.Generator(device="cuda").manual_seed(3)
    lin = nn.Linear(5120, 6144, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02, generator=g)
    weight = lin.weight.detach().float().clone()
    stack = nn.Sequential(lin)
    quantize_linears(stack)
    fp8 = stack[0]
    x = torch.randn(1000, 5120, device="cuda", generator=g).to(torch.bfloat16)
    y = fp8(x).float()
    xq, xs = quantize_rows(x)
    exact = (xq.float() * xs) @ fp8.dequantized_weight().t()
    assert (y - exact).abs().max().item() <= 2.0**-7 * exact.abs().max().item()
    ref = x.float() @ weight.t()
    assert ((y - ref).norm() / ref.norm()).item() < 0.05


def test_fused_elementwise_matches_the_eager_modules():
    """target/fused.py: the compiled fused norms and SwiGLU give the eager stack's planes (fp32,
    1e-5); with FP8 linears, the fused SwiGLU + quantizer gives the unfused FP8 planes; unfusing
    restores the modules' own forwards."""
    from dflash_ipc.target.fused import fuse_elementwise, unfuse_elementwise

    model = build_target(TargetConfig(spec=tiny_spec(300), layer_ids=[1, 2], varlen=False), "cpu")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(4))
    eager = model.capture(ids)
    counts = fuse_elementwise(model.stack)
    # 3 layers built (2 GatedDeltaNet, 1 attention): 2 norms each, q/k norms, final norm; a gated norm per GatedDeltaNet
    assert counts == {"norms": 2 * 3 + 2 + 1, "gated_norms": 2, "mlps": 3}
    fused = model.capture(ids)
    assert max((a - b).abs().max().item() for a, b in zip(eager, fused)) <= 1e-5
    unfuse_elementwise(model.stack)
    assert all("forward" not in m.__dict__ for m in model.stack.modules())
    quantize_linears(model.stack, compile_quantizer=False)
    fp8_eager = model.capture(ids)
    fuse_elementwise(model.stack)
    fp8_fused = model.capture(ids)
    assert max((a - b).abs().max().item() / a.abs().max().item() for a, b in zip(fp8_eager, fp8_fused)) <= 1e-2
