"""Fused elementwise work of the frozen decoder (measured by ``dflash-ipc bench target-forward --fuse``).

In eager mode a Qwen3.5 decoder layer spends a large share of its kernels outside the GEMMs: each
zero-centered RMSNorm is seven passes over the hidden states (cast to fp32, square, mean, add,
rsqrt, scale by ``1 + w``, cast back) and the SwiGLU two more over the 17,408-wide MLP activations
(SiLU, product), plus, with an FP8 target, the down projection's input quantizer (three more).
:func:`fuse_elementwise` replaces those forwards, per module instance, by ``torch.compile``'d free
functions of their tensors (one compile per function for the whole stack, dynamic in the token
count; the GEMMs stay cuBLAS / ``_scaled_mm``). Which module classes compute these formulas is the
target family's word (:meth:`~dflash_ipc.families.base.DecoderFamily.fusible`: Qwen3.5, Qwen3.5-MoE and
Qwen3-Next today, whose classes differ in name only); a family that names none stays eager:

* the zero-centered RMSNorms (decoder, q/k and final norms) and the GatedDeltaNet's gated norm
  (norm, weight, SiLU gate) -> one fused kernel each, same formulas;
* the SwiGLU MLPs with SiLU (dense MLPs and an MoE layer's shared expert; the routed experts are
  transformers' own kernels) -> ``down(silu(gate(x)) * up(x))`` with the product fused, and with an
  FP8 down projection the product and its per-token quantization fused into one kernel.

:func:`unfuse_elementwise` puts the modules' own forwards back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ipc.families import family_of
from dflash_ipc.target.fp8 import Fp8Linear, quantize_rows

__all__ = ["fuse_elementwise", "unfuse_elementwise", "wants_fused_elementwise"]


def _rms_norm_zero_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _silu_mul_quantize(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = F.silu(gate) * up
    return quantize_rows(h.reshape(-1, h.shape[-1]))


def _norm_forward(fn: Callable, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return fn(x, norm.weight, norm.eps)


def _gated_norm_forward(fn: Callable, norm: nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return fn(x, gate, norm.weight, norm.variance_epsilon)


def _mlp_forward(fns: dict[str, Callable], mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    if isinstance(down, Fp8Linear):
        xq, xs = fns["silu_mul_quantize"](gate, up)
        return down.matmul_quantized(xq, xs, gate.shape[:-1])
    return down(fns["silu_mul"](gate, up))


def wants_fused_elementwise(setting: bool | str, device: torch.device) -> bool:
    """``target.fuse_elementwise``: "auto" fuses on CUDA only (Triton compiles the kernels there; on the
    CPU inductor would build C++ per shape for no gain measured)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def fuse_elementwise(stack: nn.Module) -> dict[str, int]:
    """Route the stack's zero-centered RMSNorms and SiLU MLPs, the classes its family names (``stack.config``'s),
    through compiled fused functions (see the module docstring); returns how many of each were routed."""
    fusible = family_of(stack.config).fusible()
    fns: dict[str, Any] = {
        "norm": torch.compile(_rms_norm_zero_centered, dynamic=True),
        "gated_norm": torch.compile(_rms_norm_gated, dynamic=True),
        "silu_mul": torch.compile(_silu_mul, dynamic=True),
        "silu_mul_quantize": torch.compile(_silu_mul_quantize, dynamic=True),
    }
    counts = {"norms": 0, "gated_norms": 0, "mlps": 0}
    for mod in stack.modules():
        name = type(mod).__name__
        if name in fusible.zero_centered_norms:
            mod.forward = functools.partial(_norm_forward, fns["norm"], mod)
            counts["norms"] += 1
        elif name in fusible.gated_norms and getattr(mod, "activation", "silu") == "silu":
            mod.forward = functools.partial(_gated_norm_forward, fns["gated_norm"], mod)
            counts["gated_norms"] += 1
        elif name in fusible.swiglu_mlps and getattr(mod.config, "hidden_act", "silu") == "silu":
            mod.forward = functools.partial(_mlp_forward, fns, mod)
            counts["mlps"] += 1
    return counts


def unfuse_elementwise(stack: nn.Module) -> None:
    """Back to each module's own forward."""
    for mod in stack.modules():
        if isinstance(mod.__dict__.get("forward"), functools.partial):
            del mod.forward
