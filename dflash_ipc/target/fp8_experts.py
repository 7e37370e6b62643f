"""FP8 routed experts (``target.quantization = "fp8"`` on an MoE target): most of an MoE layer's weights.

transformers 5.x holds an MoE layer's routed experts in one module (``experts``) as 3-D parameters:
``gate_up_proj`` [E, 2I, H] (or ``up_proj`` without a gate) and ``down_proj`` [E, H, I], transposed in some
families (gpt-oss), with per-expert biases in some. :func:`~dflash_ipc.target.fp8.quantize_linears` converts
``nn.Linear`` only; :func:`quantize_experts` replaces each experts module whose forward transformers
dispatches through its experts interface (``use_experts_implementation``: hidden states, each token's top-k
expert ids and routing weights) by an :class:`Fp8Experts`:

* each expert's weights quantized once to e4m3, one fp32 scale per output row of each expert (``[E, N, K]``,
  scales ``[E, N]``: the row-wise scheme of the FP8 linears, per expert), the bf16 weights dropped;
* per call, as transformers' grouped path does: the (token, expert) pairs sorted by expert, their hidden
  states gathered and quantized per row, one GEMM per projection over all experts, the module's own gate
  (SwiGLU, gpt-oss's clamped GLU) between them, biases, the routing weights, the pairs summed per token.
  The GEMM is ``torch._scaled_grouped_mm`` over the experts' row offsets on CUDA (compute capability 9.0
  and above; older GPUs keep their experts in the target's dtype), ``torch._scaled_mm`` per expert that
  received tokens on the CPU (what the CPU tests check the arithmetic with).

Experts modules of another kind stay in the target's dtype and :func:`quantize_experts` counts them (the
target logs their number and bytes): Llama 4's (it multiplies every expert by every token through ``bmm``,
its own dense forward), and any whose widths are not multiples of 16 (the FP8 GEMM's alignment).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_ipc.families.traits import EXPERTS_MODULE
from dflash_ipc.platform.e4m3 import ALIGN, quantize_rows

__all__ = ["ExpertsReport", "Fp8Experts", "grouped_gemm_runs", "quantize_experts"]

Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _dispatched(experts: nn.Module) -> bool:
    """transformers routes this module's forward through its experts interface (the flags its decorator sets)."""
    return all(hasattr(experts, flag) for flag in ("has_gate", "has_bias", "is_transposed", "num_experts"))


def _weight_names(experts: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if experts.has_gate else "up_proj"), "down_proj"


def _quantize_experts_weight(weight: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [E, N, K] (``transposed``: [E, K, N]) -> (e4m3 [E, N, K] row-major, scales [E, N] fp32)."""
    w = weight.detach().transpose(1, 2) if transposed else weight.detach()
    experts, n, k = w.shape
    q, scale = quantize_rows(w.reshape(experts * n, k))
    return q.view(experts, n, k).contiguous(), scale.view(experts, n).contiguous()


def grouped_gemm_runs(device: torch.device) -> bool:
    """``torch._scaled_grouped_mm`` with row-wise scales runs on ``device`` (CUDA, compute capability >= 9.0)."""
    device = torch.device(device)
    return device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8Experts(nn.Module):
    """A transformers experts module with its weights in e4m3 per expert and output row (module docstring)."""

    def __init__(self, experts: nn.Module, quantize: Quantizer = quantize_rows, grouped: bool | None = None):
        super().__init__()
        up_name, down_name = _weight_names(experts)
        up, down = getattr(experts, up_name), getattr(experts, down_name)
        self.num_experts = int(experts.num_experts)
        self.out_dtype = up.dtype
        for name, weight in (("up", up), ("down", down)):
            q, scale = _quantize_experts_weight(weight, bool(experts.is_transposed))
            self.register_buffer(f"{name}_fp8", q)
            self.register_buffer(f"{name}_scale", scale)
        bias_names = (f"{up_name}_bias", f"{down_name}_bias") if experts.has_bias else (None, None)
        self.register_buffer("up_bias", None if bias_names[0] is None else getattr(experts, bias_names[0]).detach())
        self.register_buffer("down_bias", None if bias_names[1] is None else getattr(experts, bias_names[1]).detach())
        # the module's own gate (SwiGLU, gpt-oss's clamped GLU) or activation; its weights go (the gate reads none)
        self._activation = experts._apply_gate if experts.has_gate else experts.act_fn
        for name in (up_name, down_name, *filter(None, bias_names)):
            delattr(experts, name)
        self.post_expert_norm = experts.post_expert_norm if getattr(experts, "has_post_expert_norm", False) else None
        self._quantize = quantize
        self.grouped = grouped_gemm_runs(self.up_fp8.device) if grouped is None else grouped

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden = hidden_states.shape
        top_k = top_k_index.shape[-1]
        expert_ids, order = torch.sort(top_k_index.reshape(-1))
        rows = hidden_states[order // top_k]
        # rows per expert without a host sync (bincount reads its maximum back); histc takes floats on the CPU and
        # integers on CUDA (its deterministic kernels), as transformers' grouped path counts them
        ids = expert_ids.float() if expert_ids.device.type == "cpu" else expert_ids.int()
        counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
        out = self._gemm(rows, self.up_fp8, self.up_scale, counts)
        if self.up_bias is not None:
            out = out + self.up_bias[expert_ids]
        out = self._gemm(self._activation(out), self.down_fp8, self.down_scale, counts)
        if self.down_bias is not None:
            out = out + self.down_bias[expert_ids]
        if self.post_expert_norm is not None:
            out = self.post_expert_norm(out)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        unsorted = torch.empty_like(weighted)
        unsorted[order] = weighted
        return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [S, K], its rows sorted by expert (``counts`` per expert), times each row's expert's weight."""
        xq, xs = self._quantize(x if x.is_contiguous() else x.contiguous())
        if self.grouped:
            offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
            return torch._scaled_grouped_mm(xq, weight.transpose(1, 2), xs.reshape(-1), scale, offs=offsets, out_dtype=self.out_dtype)
        out = torch.empty(x.shape[0], weight.shape[1], dtype=self.out_dtype, device=x.device)
        start = 0
        for expert, count in enumerate(int(n) for n in counts.tolist()):  # one host sync per call, as transformers' eager loop
            if count:
                end = start + count
                out[start:end] = torch._scaled_mm(
                    xq[start:end], weight[expert].t(), scale_a=xs[start:end], scale_b=scale[expert : expert + 1], out_dtype=self.out_dtype
                )
                start = end
        return out

    def dequantized(self, name: str) -> torch.Tensor:
        """The ``"up"`` or ``"down"`` weights the FP8 GEMMs multiply by, [E, N, K] in fp32 (for tests)."""
        return getattr(self, f"{name}_fp8").float() * getattr(self, f"{name}_scale").unsqueeze(-1)

    def extra_repr(self) -> str:
        e, n, k = self.up_fp8.shape
        return f"experts={e}, up={n}x{k}, down={tuple(self.down_fp8.shape[1:])}, e4m3 per expert row, grouped={self.grouped}"


@dataclass
class ExpertsReport:
    """What :func:`quantize_experts` converted, and what it kept in the target's dtype and why."""

    fp8: int = 0
    fp8_bytes: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    """Why -> how many experts modules."""
    kept_bytes: int = 0

    def describe(self) -> str:
        line = f"routed experts in FP8 e4m3: {self.fp8} modules ({self.fp8_bytes / 1e9:.2f} GB)"
        if self.kept:
            why = "; ".join(f"{n} {reason}" for reason, n in self.kept.items())
            line += f"; kept in the target's dtype ({self.kept_bytes / 1e9:.2f} GB): {why}"
        return line


def _kept_reason(experts: nn.Module) -> str | None:
    """Why ``experts`` stays in its dtype (None: it converts)."""
    weights = [p for p in experts.parameters() if p.dim() == 3]
    device = weights[0].device if weights else torch.device("cpu")
    if device.type == "cuda" and not grouped_gemm_runs(device):
        # the per-expert _scaled_mm loop was refused by cuBLASLt on an H200 (CUBLAS_STATUS_NOT_SUPPORTED): on a GPU
        # only the grouped GEMM, checked against the quantized operands' product, runs
        return f"{type(experts).__name__} (FP8 experts need torch._scaled_grouped_mm: compute capability >= 9.0)"
    if not _dispatched(experts) or len(weights) != 2:
        return f"{type(experts).__name__} (its own forward, not transformers' experts interface)"
    if any(p.shape[1] % ALIGN or p.shape[2] % ALIGN for p in weights):
        return f"{type(experts).__name__} (widths {[tuple(p.shape[1:]) for p in weights]} not multiples of {ALIGN})"
    return None


def quantize_experts(stack: nn.Module, quantize: Quantizer = quantize_rows) -> ExpertsReport:
    """Replace every eligible experts module under ``stack`` by an :class:`Fp8Experts`, in place (module
    docstring); report what converted and what stayed in the target's dtype."""
    report = ExpertsReport()
    found = [(name, mod) for name, mod in stack.named_modules() if name.rpartition(".")[2] == EXPERTS_MODULE]
    for name, experts in found:
        reason = _kept_reason(experts)
        if reason is not None:
            report.kept[reason] = report.kept.get(reason, 0) + 1
            report.kept_bytes += sum(p.numel() * p.element_size() for p in experts.parameters())
            continue
        fp8 = Fp8Experts(experts, quantize)
        parent_name, _, child = name.rpartition(".")
        setattr(stack.get_submodule(parent_name) if parent_name else stack, child, fp8)
        report.fp8 += 1
        report.fp8_bytes += fp8.up_fp8.numel() + fp8.down_fp8.numel()
    return report
