"""Per-document attention for a packed row when the target's attention is sdpa (or eager), honouring each
layer's family traits: sliding windows, chunks, sinks, soft-capping, position-scaled queries, value heads
narrower than query heads.

transformers keeps a packed row's documents apart through flash-attention's varlen kernel or
flex-attention's block mask. Qwen3.5 refuses flex_attention and the GPU image has no flash-attn,
so with sdpa transformers would build a dense ``n x n`` block-diagonal mask over the whole row
(quadratic in the batch's tokens: slower than the padded forward, docs/BENCHMARKS.md).

Instead, for the duration of one packed forward (:func:`packed_attention`) the attention layers call
:func:`packed_attention_forward`, registered with transformers' ``AttentionInterface`` under
:data:`PACKED_ATTENTION`. Each call finds its layer's :class:`~dflash_ipc.families.traits.AttentionLayer`
in the forward's :class:`PackedRow` (the target maps every attention module to its layer's traits when it
is built) and checks it against what transformers passed (``sliding_window``, ``s_aux``, ``softcap``): a
disagreement, or an argument it does not know, raises instead of computing something else.

* ``varlen_attn`` (CUDA, bf16/fp16): torch's flash-attention varlen kernel over ``cu_seqlens``, causal,
  a sliding window through its ``window_size``, chunked layers over the chunks' own ``cu_seqlens``,
  sinks folded in from its log-sum-exp (``out * sigmoid(lse - sink)``: the sink's share of the softmax
  denominator), narrower value heads zero-padded to the query heads' size and sliced back.
* ``reference`` (elsewhere: the CPU, fp32): each document right-padded to the longest one and run
  through transformers' eager formula with the layer's own mask (causal, window, chunk), soft-cap and
  sinks; sdpa with that mask where there are neither. Exact: a real token attends to earlier real tokens
  of its own document only, as in its standalone forward.

Queries a layer scaled by their position (Llama 4's NoPE layers scale by the row's positions, which in a
packed row are not the document's) are rescaled to the document's positions first.

A registered name that transformers' mask interface does not know gets no mask at all
(``masking_utils._preprocess_mask_arguments``), so no ``n x n`` mask is ever built. The padded
forward, eval's cached decoding and every other caller keep the configured implementation: the
switch is scoped to one packed forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dflash_ipc.families.traits import AttentionLayer, TemperatureTuning

if TYPE_CHECKING:
    from dflash_ipc.target.varlen import PackedDocs

__all__ = [
    "PACKED_ATTENTION",
    "PackedRow",
    "packed_attention",
    "packed_attention_forward",
    "register_packed_attention",
    "varlen_kernel_usable",
    "varlen_lse_available",
]

PACKED_ATTENTION = "dflash_packed"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: Keyword arguments attention layers pass along that the packed attention reads elsewhere or that do not
#: change the result (the documents' boundaries come from the PackedRow, positions are already in q and k).
_PASSED_THROUGH = frozenset(
    {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache_position", "output_attentions", "use_cache"}
)
_ROW: contextvars.ContextVar[PackedRow | None] = contextvars.ContextVar("dflash_packed_row", default=None)


@functools.cache
def _torch_varlen_attn() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's varlen kernel and its parameter names (they changed across torch versions), looked
    up once per process rather than per layer call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kernel_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch's varlen flash-attention kernel runs here (CUDA, bf16/fp16, a torch with its
    ``window_size`` argument: 2.11 and newer)."""
    kernel = _torch_varlen_attn()
    return torch.device(device).type == "cuda" and dtype in _KERNEL_DTYPES and kernel is not None and "window_size" in kernel[1]


def varlen_lse_available() -> bool:
    """Whether this torch's varlen kernel can return its log-sum-exp (what attention sinks are folded in with)."""
    kernel = _torch_varlen_attn()
    return kernel is not None and "return_aux" in kernel[1]


def register_packed_attention() -> None:
    """Make :data:`PACKED_ATTENTION` a name transformers' attention layers can dispatch to
    (idempotent; called when a packed target is built, never at import)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


@dataclass
class PackedRow:
    """One packed forward's documents and the attention layers that will see them."""

    layers: Mapping[torch.nn.Module, AttentionLayer]
    """Each attention module of the stack -> its layer's traits (from the target's family)."""
    docs: PackedDocs
    use_kernel: bool
    """torch's varlen kernel (else the reference path)."""
    _chunks: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    _retune: dict[TemperatureTuning, torch.Tensor] = field(default_factory=dict)
    _padded_index: torch.Tensor | None = None

    def padded_index(self) -> torch.Tensor:
        """:meth:`PackedDocs.padded_index`, computed once per forward rather than by every layer of the reference path."""
        if self._padded_index is None:
            self._padded_index = self.docs.padded_index()
        return self._padded_index

    def chunk_bounds(self, chunk: int) -> tuple[torch.Tensor, int]:
        """(cu_seqlens of every document cut into chunks of ``chunk`` tokens from its start, longest chunk)."""
        if chunk not in self._chunks:
            bounds = [0]
            cu_cpu = self.docs.cu_seqlens_cpu
            for start, end in zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist()):
                bounds += list(range(start + chunk, end, chunk)) + [end]
            cu = torch.tensor(bounds, dtype=torch.int32).to(self.docs.cu_seqlens.device, non_blocking=True)
            self._chunks[chunk] = (cu, min(chunk, self.docs.max_len))
        return self._chunks[chunk]

    def retune_factor(self, tuning: TemperatureTuning) -> torch.Tensor:
        """[n] fp32: the query scale at each token's document position over the one its layer applied at
        its row position (a layer scales by ``arange(n)``, the positions of one unpacked sequence)."""
        if tuning not in self._retune:
            positions = self.docs.position_ids.view(-1)
            row = torch.arange(self.docs.n_tokens, device=positions.device)
            self._retune[tuning] = tuning.scales(positions) / tuning.scales(row)
        return self._retune[tuning]


@contextlib.contextmanager
def packed_attention(config: Any, row: PackedRow) -> Iterator[None]:
    """Route ``config``'s attention layers through :func:`packed_attention_forward` over ``row`` for one forward."""
    before = config._attn_implementation
    config._attn_implementation = PACKED_ATTENTION
    token = _ROW.set(row)
    try:
        yield
    finally:
        _ROW.reset(token)
        config._attn_implementation = before


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each document of the current :class:`PackedRow`: query [1, Hq, n, Dqk], key [1, Hkv, n, Dqk],
    value [1, Hkv, n, Dv] -> ([1, n, Hq, Dv], None), the layout transformers' attention functions return."""
    row = _ROW.get()
    if row is None:
        raise ValueError(f"{PACKED_ATTENTION} attention runs only inside a packed forward (target.model's capture_packed)")
    spec = row.layers.get(module)
    if spec is None:
        raise ValueError(f"{type(module).__name__} is not an attention layer of the stack this packed forward was set up for")
    unknown = sorted(set(kwargs) - _PASSED_THROUGH - {"is_causal"})
    if unknown:
        raise ValueError(f"packed attention does not know how to honour {', '.join(unknown)} (passed by {type(module).__name__})")
    if attention_mask is not None:
        raise ValueError("a packed row has no padding: attention_mask must be None")
    if dropout:
        raise ValueError("packed attention is forward-only (dropout must be 0)")
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or query.shape[2] != row.docs.n_tokens:
        raise ValueError(f"packed attention needs one row of {row.docs.n_tokens} tokens (got {tuple(query.shape)} / {tuple(key.shape)})")
    _check_agreement(spec, sliding_window, s_aux, softcap, kwargs.get("is_causal", True), type(module).__name__)
    if spec.temperature_tuning is not None:
        query = (query.float() * row.retune_factor(spec.temperature_tuning).view(1, 1, -1, 1)).to(query.dtype)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [n, H, D]
    if row.use_kernel:
        out = _varlen_kernel(q, k, v, row, spec, scale, s_aux)
    else:
        out = _reference(q, k, v, row, spec, scale, s_aux)
    return out.unsqueeze(0), None


def _check_agreement(
    spec: AttentionLayer, window: int | None, sinks: torch.Tensor | None, softcap: float | None, causal: bool, who: str
) -> None:
    """What transformers passed must be what the family says of this layer: a layer the family misread raises."""
    problems = []
    if (window or None) != (spec.window if spec.kind == "sliding" else None):
        problems.append(f"sliding_window {window} (the family says {spec.kind} attention, window {spec.window})")
    if (sinks is not None) != spec.sinks:
        problems.append(f"sinks {'passed' if sinks is not None else 'not passed'} (the family says {'with' if spec.sinks else 'without'})")
    if (softcap or None) != spec.softcap:
        problems.append(f"softcap {softcap} (the family says {spec.softcap})")
    if causal is False or not spec.causal:
        problems.append("non-causal attention")
    if problems:
        raise ValueError(f"packed attention of {who}: {'; '.join(problems)}")


def _varlen_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: PackedRow, spec: AttentionLayer, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    kernel = _torch_varlen_attn()
    assert kernel is not None
    varlen_attn, params = kernel
    if spec.softcap is not None:
        raise ValueError("torch's varlen_attn has no attention soft-cap: this layer cannot run packed on it")
    cu, max_len = row.chunk_bounds(spec.chunk) if spec.kind == "chunked" and spec.chunk else (row.docs.cu_seqlens, row.docs.max_len)
    kw: dict[str, Any] = {"scale": scale, "window_size": (spec.window - 1, 0) if spec.kind == "sliding" and spec.window else (-1, 0)}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # torch 2.11's kernel takes as many key/value heads as query heads
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:  # latent attention's narrower value heads: zero columns add nothing to any output
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    elif value_dim > q.shape[-1]:
        raise ValueError(f"value heads ({value_dim}) wider than query heads ({q.shape[-1]}) cannot run on varlen_attn")
    if sinks is not None:
        if "return_aux" not in params:
            raise ValueError("attention sinks need this torch's varlen_attn to return its log-sum-exp (return_aux)")
        from torch.nn.attention.varlen import AuxRequest

        kw["return_aux"] = AuxRequest(lse=True)
    cu = cu.to(torch.int32)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kw)
    if sinks is not None:
        out, lse = out
        lse = lse if lse.shape[0] == q.shape[0] else lse.transpose(0, 1)  # -> [n, H]
        out = out * torch.sigmoid(lse.float() - sinks.float().view(1, -1)).unsqueeze(-1).to(out.dtype)
    return out[..., :value_dim]


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: PackedRow, spec: AttentionLayer, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Each document right-padded to the longest, through the layer's own mask and transformers' eager formula."""
    n_docs, longest = len(row.docs.seq_lens), row.docs.max_len
    index = row.padded_index()

    def padded(t: torch.Tensor) -> torch.Tensor:  # [n, H, D] -> [docs, H, longest, D]
        out = t.new_zeros((n_docs * longest, *t.shape[1:]))
        out.index_copy_(0, index, t)
        return out.view(n_docs, longest, *t.shape[1:]).transpose(1, 2)

    qp, kp, vp = padded(q), padded(k), padded(v)
    positions = torch.arange(longest, device=q.device)
    allowed = positions.view(1, -1) <= positions.view(-1, 1)  # [query, key]: causal within the document
    if spec.kind == "sliding" and spec.window:
        allowed &= positions.view(1, -1) > positions.view(-1, 1) - spec.window
    if spec.kind == "chunked" and spec.chunk:
        allowed &= (positions.view(1, -1) // spec.chunk) == (positions.view(-1, 1) // spec.chunk)
    if sinks is None and spec.softcap is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed, scale=scale, enable_gqa=qp.shape[1] != kp.shape[1])
    else:
        groups = qp.shape[1] // kp.shape[1]
        kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
        scores = torch.matmul(qp, kp.transpose(2, 3)) * scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if sinks is not None:
            sink = sinks.reshape(1, -1, 1, 1).expand(n_docs, -1, longest, 1).to(scores.dtype)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(qp.dtype)
        out = torch.matmul(probs.to(vp.dtype), vp)
    # [docs, Hq, longest, Dv] -> the real tokens, [n, Hq, Dv]
    return out.transpose(1, 2).reshape(n_docs * longest, out.shape[1], out.shape[-1]).index_select(0, index)
