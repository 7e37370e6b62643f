"""bench/op_profile.py: kernel / op names to op classes, and a real profiler run summed by class."""

from __future__ import annotations

import pytest
import torch

from dflash_ipc.bench.op_profile import classify, format_table, profile_classes


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        ("cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16", "gemm"),
        ("aten::addmm", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256>>", "attention"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn_chunk"),
        ("merge_16x16_to_64x64_inverse_kernel", "gdn_chunk"),
        ("causal_conv1d_fwd_kernel", "conv"),
        ("void at::native::conv_depthwise2d_forward_kernel<float>", "conv"),
        ("triton_red_fused_abs_amax_clamp_div_0", "fp8_quantize"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("triton_poi_fused__to_copy_mul_silu_0", "elementwise"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
        ("something_unheard_of", "other"),
    ],
)
def test_kernel_names_map_to_classes(name, cls):
    assert classify(name) == cls


def test_profile_of_a_real_forward_sums_to_its_classes():
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)

    def forward():
        with torch.inference_mode():
            y = torch.nn.functional.silu(lin(x))
            return torch.nn.functional.rms_norm(y, (256,))

    prof = profile_classes(forward, on_cuda=False)
    assert prof["device"] == "cpu aten ops" and prof["total_us"] > 0
    assert "gemm" in prof["classes"] and prof["top"]
    assert abs(sum(c["pct"] for c in prof["classes"].values()) - 100.0) < 0.1
    assert "gemm" in format_table("t", prof)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return (x * 3.0).sum()

    @staticmethod
    def backward(ctx, g):
        return torch.full((256, 256), 3.0) * g


def test_scopes_claim_every_op_under_a_matching_range_whatever_its_name():
    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = torch.optim.AdamW([w])

    def step():
        _Scaled.apply(w @ w).backward()
        opt.step()

    plain = profile_classes(step, on_cuda=False)
    scoped = profile_classes(step, on_cuda=False, scopes=(("mine", r"^_scaled"), ("optimizer", r"optimizer\.step")))
    assert "mine" not in plain["classes"] and "optimizer" not in plain["classes"]
    assert {"mine", "optimizer", "gemm"} <= set(scoped["classes"])
    assert {r["class"] for r in scoped["top"] if r["name"] == "aten::mul"} >= {"mine"}  # the forward's x * 3.0
    assert abs(sum(c["pct"] for c in scoped["classes"].values()) - 100.0) < 0.1
