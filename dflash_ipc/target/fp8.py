"""FP8 target (``target.quantization = "fp8"``): the frozen decoder's linear layers in e4m3.

Every ``nn.Linear`` of the decoder stack whose widths are multiples of 16 (the FP8 GEMM's
alignment) becomes an :class:`Fp8Linear`:

* its weight is quantized once, at build time, to ``float8_e4m3fn`` with one fp32 scale per
  output row (``w ~= w_fp8 * scale_w[n]``), and the bf16 weight is dropped;
* at each call the input is quantized per token (one fp32 scale per row of ``x``, from its
  absolute maximum), and ``torch._scaled_mm`` multiplies the two in FP8 with fp32 accumulation
  and the row-wise scales applied in its epilogue, writing bf16.

Embeddings, norms, the GatedDeltaNet conv and gates, attention itself and the LM head (never
built for capture) stay in bf16; so do the captured hidden states: capture is unchanged. An MoE's
routed experts are 3-D parameters, not ``nn.Linear``: :mod:`~dflash_ipc.target.fp8_experts` converts them.
:mod:`~dflash_ipc.target.fp8_merge` then merges sibling layers that project one input (q/k/v,
gate/up, ...) into one quantization and one GEMM.

Row-wise ``_scaled_mm`` runs on CUDA devices of compute capability 8.9 and above (Ada, Hopper,
Blackwell) with a bf16 output; :func:`~dflash_ipc.platform.e4m3.fp8_device_problem` says why a device cannot, and the
preflight refuses such a config before any process starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from dflash_ipc.platform.e4m3 import ALIGN, E4M3, fp8_device_problem, quantize_rows

log = logging.getLogger(__name__)

__all__ = ["E4M3", "Fp8Linear", "fp8_device_problem", "input_quantizer", "quantize_linears", "quantize_rows"]


class Fp8Linear(nn.Module):
    """A frozen ``nn.Linear`` in FP8: e4m3 weight with per-output-row scales, inputs quantized per
    token at each call, ``torch._scaled_mm`` with row-wise scales (see the module docstring)."""

    def __init__(self, linear: nn.Linear, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_rows):
        super().__init__()
        w = linear.weight.detach()
        q, scale = quantize_rows(w)
        bias = None if linear.bias is None else linear.bias.detach().to(w.dtype)
        self._set_parts(q, scale.reshape(1, -1).contiguous(), bias, w.dtype, quantize)

    @classmethod
    def from_parts(
        cls,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
        quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> Fp8Linear:
        """An FP8 linear over an already quantized weight (``weight_fp8`` [N, K] e4m3 row-major,
        ``weight_scale`` [1, N] fp32)."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod._set_parts(weight_fp8, weight_scale, bias, out_dtype, quantize)
        return mod

    def _set_parts(self, weight_fp8, weight_scale, bias, out_dtype, quantize) -> None:
        self.out_features, self.in_features = weight_fp8.shape
        self.out_dtype = out_dtype
        self.register_buffer("weight_fp8", weight_fp8)  # [N, K] row-major: its .t() is the column-major operand
        self.register_buffer("weight_scale", weight_scale)  # [1, N]
        self.register_buffer("bias", bias)
        self._quantize = quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul_quantized(*self.quantize_input(x))

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
        """``x`` [..., K] -> (``xq`` [M, K] e4m3, ``xs`` [M, 1] fp32, the leading shape ``...``)."""
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        xq, xs = self._quantize(x2)
        return xq, xs, x.shape[:-1]

    def matmul_quantized(
        self, xq: torch.Tensor, xs: torch.Tensor, lead: tuple[int, ...] | torch.Size, rows: slice | None = None
    ) -> torch.Tensor:
        """The GEMM on an input already quantized per token (``xq`` [M, K] e4m3, ``xs`` [M, 1]),
        e.g. by a kernel that fused the quantization into the op before it (target/fused.py).
        ``rows``: only these output rows of the weight (a contiguous block of them)."""
        w, w_scale, bias = self.weight_fp8, self.weight_scale, self.bias
        if rows is not None:
            w, w_scale, bias = w[rows], w_scale[:, rows], None if bias is None else bias[rows]
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale, bias=bias, out_dtype=self.out_dtype)
        return y.view(*lead, w.shape[0])

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the FP8 GEMM multiplies by, in fp32 (for error figures and tests)."""
        return self.weight_fp8.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-row weight / per-token input scales"


def input_quantizer(compile_quantizer: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The per-token input quantizer the FP8 GEMMs take: :func:`quantize_rows`, through ``torch.compile``
    with ``compile_quantizer``."""
    return _compiled_quantizer() if compile_quantizer else quantize_rows


def _compiled_quantizer() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`quantize_rows` through ``torch.compile`` (one fused kernel instead of five passes
    over the activations); falls back to the eager function, with a warning, if compiling fails."""
    compiled = torch.compile(quantize_rows, dynamic=True)
    state: dict[str, Callable] = {"fn": compiled}

    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return state["fn"](x)
        except Exception as e:  # inductor / triton trouble must cost speed, not the run
            if state["fn"] is quantize_rows:
                raise
            log.warning("torch.compile of the FP8 input quantizer failed (%s: %s); quantizing eagerly", type(e).__name__, e)
            state["fn"] = quantize_rows
            return quantize_rows(x)

    return quantize


def quantize_linears(stack: nn.Module, compile_quantizer: bool | None = None) -> dict[str, int]:
    """Replace every eligible ``nn.Linear`` under ``stack`` by an :class:`Fp8Linear`, in place.

    ``stack`` is the decoder stack (its embedding is an ``nn.Embedding``, untouched; no LM head
    is ever part of it). ``compile_quantizer``: fuse the per-token input quantization with
    ``torch.compile`` (default: on CUDA). Returns counts: ``fp8`` layers, layers ``kept`` in
    their dtype (widths not multiples of 16), and the FP8 weight ``bytes``."""
    param = next(stack.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if compile_quantizer is None:
        compile_quantizer = device.type == "cuda"
    quantize = input_quantizer(compile_quantizer)
    counts = {"fp8": 0, "kept": 0, "bytes": 0}
    targets = [(name, mod) for name, mod in stack.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        if mod.in_features % ALIGN or mod.out_features % ALIGN:
            counts["kept"] += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = stack.get_submodule(parent_name) if parent_name else stack
        fp8 = Fp8Linear(mod, quantize)
        setattr(parent, child, fp8)  # the bf16 weight goes with the old module
        counts["fp8"] += 1
        counts["bytes"] += fp8.weight_fp8.numel()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return counts
