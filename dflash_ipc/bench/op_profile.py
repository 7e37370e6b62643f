"""Where a target forward's time goes: ``torch.profiler`` events grouped into op classes.

:func:`profile_classes` runs a callable under the profiler and sums the self time of every
device kernel (on CUDA; of every aten op on CPU, where there are no kernels) into the classes of
:data:`CLASSES`, matched on the kernel's name in order (first match wins): GEMMs (cuBLAS /
CUTLASS / FP8 ``_scaled_mm``), attention (flash / varlen / sdpa kernels), the GatedDeltaNet
chunk (fla's delta-rule kernels), the causal conv (fla's Triton conv, causal-conv1d, torch's
depthwise conv), the FP8 input quantizer, norms, copies (memcpy, cat, index/gather/scatter:
what capture and packing move), elementwise, and the rest. :func:`format_table` prints it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CLASSES", "classify", "format_table", "profile_classes"]

# (class, pattern over the lower-cased kernel / op name); first match wins
CLASSES: tuple[tuple[str, str], ...] = (
    ("fp8_quantize", r"amax|fused_abs|quantize|fp8_quant"),
    ("gdn_chunk", r"chunk_|gated_delta|delta_rule|solve_tril|merge_16x16|recompute_w_u|l2norm|fwd_kernel_h|fwd_kernel_o|kkt"),
    ("conv", r"causal_conv1d|conv_depthwise|depthwise|conv1d|convolution|cudnn"),
    ("attention", r"flash|fmha|attention|varlen_attn|sdpa|_efficient_attention|softmax"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|scaled_mm|f8f8|aten::(mm|addmm|bmm|matmul|linear)$|sm90_|sm100_"),
    ("norm", r"rms|norm|rsqrt|reduce|mean|welford"),
    ("elementwise", r"^triton_(poi|per|red)_fused"),  # inductor's fused kernels (their names list casts as _to_copy)
    ("copy", r"memcpy|memset|copy|\bcat\b|catarraybatched|index|gather|scatter|fill|aten::(cat|index_select|index_copy_|to|_to_copy)$"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|sigmoid|softplus|exp|mul|add|sub|div|neg|pow|where|clamp|triton_|aten::"),
)
_COMPILED = [(name, re.compile(pat)) for name, pat in CLASSES]


def classify(name: str) -> str:
    """The op class of one kernel / op name (``other`` when no pattern matches)."""
    low = name.lower()
    for cls, pat in _COMPILED:
        if pat.search(low):
            return cls
    return "other"


def _self_time_us(evt: Any, on_device: bool) -> float:
    if on_device:
        for attr in ("self_device_time_total", "self_cuda_time_total"):
            t = getattr(evt, attr, None)
            if t:
                return float(t)
        return 0.0
    return float(getattr(evt, "self_cpu_time_total", 0.0) or 0.0)


def _event_rows(prof: Any, on_cuda: bool) -> dict[tuple[str, str], list[float]]:
    """``(class, name) -> [self time in us, calls]`` from the profiler's averages, classed by name."""
    rows: dict[tuple[str, str], list[float]] = {}
    for evt in prof.key_averages():
        is_kernel = "cuda" in str(getattr(evt, "device_type", "")).lower()
        if on_cuda != is_kernel:
            continue
        if not on_cuda and not evt.key.startswith("aten::"):
            continue
        t = _self_time_us(evt, on_cuda)
        if t > 0:
            row = rows.setdefault((classify(evt.key), evt.key), [0.0, 0])
            row[0] += t
            row[1] += int(getattr(evt, "count", 1))
    return rows


def _scoped_rows(prof: Any, on_cuda: bool, scopes: tuple[tuple[str, str], ...]) -> dict[tuple[str, str], list[float]]:
    """As :func:`_event_rows`, but a kernel (CPU: an aten op) launched under a range whose name matches a
    pattern of ``scopes`` (an autograd function's forward or backward node, ``Optimizer.step``) goes to
    that class whatever its own name: what a loss or an optimizer costs, GEMMs and casts included."""
    compiled = [(cls, re.compile(pat)) for cls, pat in scopes]

    def scope_of(evt: Any) -> str | None:
        while evt is not None:
            low = evt.name.lower()
            for cls, pat in compiled:
                if pat.search(low):
                    return cls
            evt = evt.cpu_parent
        return None

    rows: dict[tuple[str, str], list[float]] = {}
    for evt in prof.events():
        if on_cuda:
            timed = [(k.name, float(k.duration)) for k in getattr(evt, "kernels", ()) or ()]
        elif evt.name.startswith("aten::") and "cpu" in str(getattr(evt, "device_type", "cpu")).lower():
            timed = [(evt.name, float(evt.self_cpu_time_total))]
        else:
            timed = []
        if not timed:
            continue
        scope = scope_of(evt)
        for name, t in timed:
            if t > 0:
                row = rows.setdefault((scope or classify(name), name), [0.0, 0])
                row[0] += t
                row[1] += 1
    if on_cuda:  # kernels no host op claimed (launched outside any recorded op) still count, by their name
        device: dict[str, float] = {}
        for evt in prof.events():
            if "cuda" in str(getattr(evt, "device_type", "")).lower():
                device[evt.name] = device.get(evt.name, 0.0) + float(evt.time_range.end - evt.time_range.start)
        claimed: dict[str, float] = {}
        for (_, name), (t, _) in rows.items():
            claimed[name] = claimed.get(name, 0.0) + t
        for name, t in device.items():
            if t - claimed.get(name, 0.0) > 1.0:
                row = rows.setdefault((classify(name), name), [0.0, 0])
                row[0] += t - claimed.get(name, 0.0)
    return rows


def profile_classes(fn: Callable[[], Any], on_cuda: bool, top: int = 25, scopes: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Run ``fn`` once under ``torch.profiler``; its time by op class and the ``top`` kernels.

    Returns ``{"unit": "us", "total_us", "classes": {cls: {"us", "pct", "kernels"}}, "top": [...]}``;
    on CUDA the device kernels' self time (host ops, which launch them, are left out), on CPU the
    aten ops' self time. ``scopes``: ``(class, pattern)`` over the lower-cased names of enclosing
    ranges, checked before the kernel's own name (:func:`_scoped_rows`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if on_cuda:
            torch.cuda.synchronize()
    rows = _scoped_rows(prof, on_cuda, scopes) if scopes else _event_rows(prof, on_cuda)
    total = sum(t for t, _ in rows.values())
    classes: dict[str, dict[str, float]] = {}
    for (cls, _), (t, calls) in rows.items():
        c = classes.setdefault(cls, {"us": 0.0, "pct": 0.0, "kernels": 0})
        c["us"] += t
        c["kernels"] += calls
    for c in classes.values():
        c["us"] = round(c["us"], 1)
        c["pct"] = round(100.0 * c["us"] / total, 2) if total else 0.0
    ordered = dict(sorted(classes.items(), key=lambda kv: -kv[1]["us"]))
    top_rows = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "unit": "us",
        "device": "cuda kernels" if on_cuda else "cpu aten ops",
        "total_us": round(total, 1),
        "classes": ordered,
        "top": [{"name": name[:160], "class": cls, "us": round(t, 1), "calls": int(calls)} for (cls, name), (t, calls) in top_rows],
    }


def format_table(title: str, result: dict[str, Any]) -> str:
    """One profile as a text table: class, share, time, kernel launches; then the top kernels."""
    lines = [f"{title}: {result['total_us'] / 1e3:.1f} ms of {result['device']}", f"  {'class':<14}{'share':>8}{'ms':>10}{'calls':>8}"]
    for cls, c in result["classes"].items():
        lines.append(f"  {cls:<14}{c['pct']:>7.1f}%{c['us'] / 1e3:>10.2f}{c['kernels']:>8}")
    lines.append("  top kernels:")
    for r in result["top"][:12]:
        lines.append(f"    {r['us'] / 1e3:>8.2f} ms  {r['class']:<12} x{r['calls']:<5} {r['name'][:100]}")
    return "\n".join(lines)
