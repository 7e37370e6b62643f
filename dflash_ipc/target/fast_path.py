"""Whether the target's GatedDeltaNet layers run on the fast kernels (flash-linear-attention,
causal-conv1d, hub kernels) or on transformers' slow torch fallbacks, read from the live model."""

from __future__ import annotations

import logging
import sys
from typing import Any

from torch import nn

_ROLE_NAMES = {
    "chunk_gated_delta_rule": ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
    "recurrent_gated_delta_rule": ("fused_recurrent_gated_delta_rule", "recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "causal_conv1d_update": ("causal_conv1d_update", "torch_causal_conv1d_update"),
}


# transformers' logger that advises installing the GPU kernels when a fallback runs.
KERNEL_ADVICE_LOGGER = "transformers.integrations.hub_kernels"


class _NoKernelAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is falling back to its reference PyTorch implementation" not in record.getMessage()


def quiet_kernel_advice_on_cpu() -> None:
    """A target on the CPU: drop transformers' advice to install flash-linear-attention / causal-conv1d.
    Both are CUDA kernels: on the CPU the torch fallback is the only path, and the advice cannot be followed."""
    logger = logging.getLogger(KERNEL_ADVICE_LOGGER)
    if not any(isinstance(f, _NoKernelAdvice) for f in logger.filters):
        logger.addFilter(_NoKernelAdvice())


def resolve_impl(fn: Any) -> Any:
    """Follow transformers' fallback wrappers (closure variable ``implementation``) and plain
    decorators down to the function actually called."""
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        closure = getattr(fn, "__closure__", None)
        if code is not None and closure:
            cells = {}
            for name, cell in zip(code.co_freevars, closure):
                try:
                    cells[name] = cell.cell_contents
                except ValueError:
                    pass
            impl = cells.get("implementation")
            if impl is not None and impl is not fn:
                fn = impl
                continue
            inner = next((v for k, v in cells.items() if k in ("func", "fn", "function", "original_function") and callable(v)), None)
            if inner is not None and inner is not fn:
                fn = inner
                continue
        break
    return fn


def impl_origin(fn: Any) -> str:
    if fn is None:
        return "none"
    mod = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "") or ""
    if mod.startswith("fla"):
        return "fla"
    if mod.startswith("causal_conv1d"):
        return "causal_conv1d"
    if mod.startswith("transformers"):
        return "torch"
    if mod.startswith("kernels") or "hub" in mod or mod.startswith("_"):
        return "hub_kernel"
    return mod or "unknown"


def fast_path_report(model: Any) -> dict[str, Any]:
    """Which implementations the GatedDeltaNet layers actually call.

    Handles both mechanisms: per-instance attributes / a module-level ``is_fast_path_available``
    (qwen3_next-style), and transformers 5.x's ``use_kernel_func_from_hub_with_fallback`` wrappers
    whose resolved ``implementation`` is the fla / causal_conv1d function or the torch fallback.
    """
    import transformers

    stack = getattr(model, "stack", model)  # a TargetModel or a bare decoder stack
    gdn = [m for m in stack.modules() if "GatedDeltaNet" in type(m).__name__]
    report: dict[str, Any] = {
        "transformers": transformers.__version__,
        "gated_delta_net_layers": len(gdn),
    }
    if not gdn:
        report["fast_path"] = None
        return report
    layer = gdn[0]
    modmod = sys.modules.get(type(layer).__module__)
    impls: dict[str, str] = {}
    origins: dict[str, str] = {}
    for role, names in _ROLE_NAMES.items():
        fn = None
        for name in names:  # instance attributes first (older layout), then module globals
            cand = getattr(layer, name, None)
            if callable(cand) and not isinstance(cand, nn.Module):
                fn = cand
                break
        if fn is None and modmod is not None:
            for name in names:
                cand = getattr(modmod, name, None)
                if callable(cand):
                    fn = cand
                    break
        impl = resolve_impl(fn)
        origins[role] = impl_origin(impl)
        impls[role] = (
            f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', '?'))}"
            if impl is not None
            else "none"
        )
    # older layout: attribute explicitly None when the package is missing
    if hasattr(layer, "causal_conv1d_fn") and layer.causal_conv1d_fn is None:
        origins["causal_conv1d_fn"] = "torch"
        impls["causal_conv1d_fn"] = "torch F.conv1d (inline)"
    norm = getattr(layer, "norm", None)
    report["norm"] = type(norm).__name__ if norm is not None else None
    report["norm_fused"] = norm is not None and type(norm).__module__.startswith("fla")
    report["implementations"] = impls
    report["origins"] = origins
    module_flag = getattr(modmod, "is_fast_path_available", None) if modmod is not None else None
    if isinstance(module_flag, bool):
        report["module_is_fast_path_available"] = module_flag
    fast = {"fla", "hub_kernel", "causal_conv1d"}
    report["fla"] = origins["chunk_gated_delta_rule"] in fast
    report["causal_conv1d"] = origins["causal_conv1d_fn"] in fast
    layer_forward_mod = getattr(type(layer).forward, "__module__", "")
    report["layer_forward"] = layer_forward_mod
    if not layer_forward_mod.startswith("transformers"):
        # the whole layer's forward was replaced by a hub kernel (kernelize)
        report["fla"] = report["causal_conv1d"] = True
    report["fast_path"] = bool(report["fla"] and report["causal_conv1d"])
    return report
