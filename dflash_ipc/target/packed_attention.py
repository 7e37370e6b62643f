"""Per-document attention for a packed row when the target's attention is sdpa (or eager).

transformers keeps a packed row's documents apart through flash-attention's varlen kernel or
flex-attention's block mask. Qwen3.5 refuses flex_attention and the GPU image has no flash-attn,
so with sdpa transformers would build a dense ``n x n`` block-diagonal mask over the whole row
(quadratic in the batch's tokens: slower than the padded forward, docs/BENCHMARKS.md).

Instead, for the duration of one packed forward (:func:`packed_attention`) the full-attention
layers call :func:`packed_attention_forward`, registered with transformers' ``AttentionInterface``
under :data:`PACKED_ATTENTION`:

* on CUDA in bf16/fp16: torch's own flash-attention varlen kernel
  (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.9) over ``cu_seqlens`` — causal within
  each document, nothing computed across documents;
* elsewhere (CPU, fp32): each document right-padded to the longest one and run through
  ``scaled_dot_product_attention(is_causal=True)`` — exact, since with right padding a real token
  only ever attends to earlier real tokens of its own document.

A registered name that transformers' mask interface does not know gets no mask at all
(``masking_utils._preprocess_mask_arguments``), so no ``n x n`` mask is ever built. The padded
forward, eval's cached decoding and every other caller keep the configured implementation: the
switch is scoped to one packed forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from dflash_ipc.target.packing import real_token_index

__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_attention_forward", "register_packed_attention", "varlen_kernel_usable"]

PACKED_ATTENTION = "dflash_packed"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _torch_varlen_attn() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """torch's varlen kernel and its parameter names (they changed across torch versions), looked
    up once per process rather than per layer call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kernel_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch's varlen flash-attention kernel runs here (CUDA, bf16/fp16, torch >= 2.9)."""
    return torch.device(device).type == "cuda" and dtype in _KERNEL_DTYPES and _torch_varlen_attn() is not None


def register_packed_attention() -> None:
    """Make :data:`PACKED_ATTENTION` a name transformers' attention layers can dispatch to
    (idempotent; called when a packed target is built, never at import)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


@contextlib.contextmanager
def packed_attention(config: Any) -> Iterator[None]:
    """Route ``config``'s attention layers through :func:`packed_attention_forward` for one forward."""
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of a packed row: query [1, Hq, n, D], key/value
    [1, Hkv, n, D] -> ([1, n, Hq, D], None), the layout transformers' attention functions return."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"{PACKED_ATTENTION} attention runs only inside a packed forward (cu_seq_lens_q and max_length_q missing)")
    if attention_mask is not None:
        raise ValueError("a packed row has no padding: attention_mask must be None")
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"packed attention needs one row of equal query/key length (got {tuple(query.shape)} / {tuple(key.shape)})")
    if dropout:
        raise ValueError("packed attention is forward-only (dropout must be 0)")
    head_dim = query.shape[-1]
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [n, H, D]
    if varlen_kernel_usable(q.device, q.dtype):
        out = _varlen_kernel(q, k, v, cu_seq_lens_q, int(max_length_q), scale)
    else:
        out = _padded_per_document(q, k, v, cu_seq_lens_q, int(max_length_q), scale)
    return out.unsqueeze(0), None


def _varlen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    kernel = _torch_varlen_attn()
    assert kernel is not None
    varlen_attn, params = kernel
    kw: dict[str, Any] = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:  # torch >= 2.11: (-1, 0) is causal
        kw["window_size"] = (-1, 0)
    else:  # torch 2.9-2.10
        kw["is_causal"] = True
    if "scale" in params:
        kw["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no scale argument and the layer's scaling is {scale}, not head_dim**-0.5")
    cu = cu.to(torch.int32)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kw)


def _padded_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    n, docs = q.shape[0], cu.numel() - 1
    index = real_token_index((cu[1:] - cu[:-1]).to(torch.int64), max_len, n)

    def padded(t: torch.Tensor) -> torch.Tensor:  # [n, H, D] -> [docs, H, max_len, D]
        out = t.new_zeros((docs * max_len, *t.shape[1:]))
        out.index_copy_(0, index, t)
        return out.view(docs, max_len, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # [docs, Hq, max_len, D]
    return out.transpose(1, 2).reshape(docs * max_len, *q.shape[1:]).index_select(0, index)
