"""Row-wise e4m3 for ``torch._scaled_mm``: what the FP8 target (``target.quantization = "fp8"``) and the
drafter's FP8 loss head (``training.ce_fp8``) share.

``torch._scaled_mm(a, b, scale_a, scale_b)`` multiplies ``a`` [M, K] (row-major) by ``b`` [K, N]
(column-major: the ``.t()`` of a row-major [N, K]) in FP8 with fp32 accumulation, and applies one fp32
scale per row of ``a`` ([M, 1]) and one per column of ``b`` ([1, N]) in its epilogue: the scales lie on
the product's outer dimensions, so each operand is quantized along the reduced one (:func:`quantize_rows`).
It runs on CUDA devices of compute capability 8.9 and above (Ada, Hopper, Blackwell), where K and N must
be multiples of 16 (:data:`ALIGN`), and on the CPU (slowly: tests).
"""

from __future__ import annotations

import torch

__all__ = ["ALIGN", "E4M3", "E4M3_MAX", "fp8_device_problem", "quantize_rows"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
#: the FP8 GEMM's alignment of its inner (K) and output column (N) dimensions on CUDA
ALIGN = 16
_MIN_CAPABILITY = (8, 9)


def fp8_device_problem(device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """Why FP8 GEMMs cannot run on ``device`` (writing ``dtype``), or None when they can."""
    device = torch.device(device)
    if dtype is not None and dtype != torch.bfloat16:
        return f"FP8 GEMMs here write bf16: the target's dtype must be bfloat16 (got {str(dtype).removeprefix('torch.')})"
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer); {str(device)!r} is not one"
    if not torch.cuda.is_available():
        return f"FP8 GEMMs need a CUDA GPU of compute capability >= 8.9; no CUDA device is visible for {str(device)!r}"
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper or newer); {str(device)!r} ({name}) is {cap[0]}.{cap[1]}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (``q`` [M, K] e4m3, ``scale`` [M, 1] fp32) with ``x ~= q * scale`` row by row:
    each row's largest magnitude maps to e4m3's largest finite value (448)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale
