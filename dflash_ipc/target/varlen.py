"""Varlen target forward: a batch's documents back to back in one row, no padding computed.

What keeps the documents apart, layer by layer (transformers 5.x mechanisms, read from the
installed ``modeling_qwen3_5`` / ``masking_utils`` / ``modeling_flash_attention_utils``):

* **Full attention.** ``position_ids`` restart at 0 per document and ``attention_mask`` is None:
  ``masking_utils.find_packed_sequence_indices`` then detects the packed row and
  ``create_causal_mask`` builds a block-diagonal causal mask (sdpa / eager: a dense mask;
  flex_attention: a block-sparse BlockMask). For flash-attention the stack also gets
  ``cu_seq_lens_q/k`` + ``max_length_q/k``, which transformers hands to flash-attn's varlen kernel.
  RoPE reads the same restarted positions, so every document sees positions 0..len-1.
* **GatedDeltaNet** (Qwen3.5 linear attention). The layer forwards ``cu_seq_lens_q`` to
  flash-linear-attention's ``chunk_gated_delta_rule`` as ``cu_seqlens`` (recurrent state reset per
  document). The 4-tap conv must not read the previous document either: with the causal-conv1d
  extension installed, transformers hands it ``seq_idx``; without it, the layer's conv is swapped,
  for the duration of its call, for fla's own Triton causal conv over ``cu_seqlens``
  (:func:`fla_packed_conv`; fla ships it, nothing to build). Transformers' torch fallbacks cannot
  do either: they refuse those arguments (``ValueError``) and, without them, the state and the
  conv leak across documents. So :class:`DocumentResetMixer` wraps every GatedDeltaNet: with a
  varlen chunk kernel and a varlen conv (:func:`packed_conv_kernel`) it adds the arguments;
  otherwise (CPU, or a GPU without fla) it scatters the packed row into a right-padded
  ``[documents, longest, H]`` batch for this layer only, runs the unchanged layer on it (each
  document starts from a zero state and a zero conv window, exactly its standalone forward) and
  gathers the real tokens back. Attention and MLPs stay packed.

The captured planes come out as ``[1, n, H]`` with the documents in batch order: exactly the
slot's layout (:mod:`~dflash_ipc.target.packing` copies them without a gather).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_ipc.families import AttentionLayer, DecoderFamily
from dflash_ipc.target.fast_path import impl_origin, resolve_impl
from dflash_ipc.target.packed_attention import PACKED_ATTENTION, varlen_kernel_usable, varlen_lse_available
from dflash_ipc.target.packing import real_token_index

__all__ = [
    "PackedDocs",
    "DocumentResetMixer",
    "install_document_reset",
    "gated_delta_net_kernels",
    "fla_packed_conv",
    "packed_conv_kernel",
    "attention_modules",
    "packed_attention_kernel",
    "plan_packed_attention",
    "resolve_varlen",
    "uses_packed_attention",
]

_FAST = {"fla", "causal_conv1d", "hub_kernel"}
# Attention implementations that keep a packed row's documents apart at per-document cost; sdpa
# and eager get a dense block-diagonal mask over the whole row instead (quadratic in the batch).
_VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3", "flex_attention"}
# Attention implementations whose packed forward runs per document through packed_attention.py instead.
_SDPA_LIKE = {"sdpa", "eager"}


def uses_packed_attention(attn_implementation: str) -> bool:
    """Whether a packed forward swaps this implementation for :mod:`~dflash_ipc.target.packed_attention`."""
    return attn_implementation in _SDPA_LIKE


@dataclass
class PackedDocs:
    """One packed row: the documents' lengths and everything the layers need to keep them apart."""

    seq_lens: list[int]
    position_ids: torch.Tensor  # [1, n] int64, restarting at 0 per document
    cu_seqlens: torch.Tensor  # [D + 1] int32, document boundaries
    cu_seqlens_cpu: torch.Tensor  # [D + 1] int64 on the host: fla reads its chunk layout without a device sync
    seq_idx: torch.Tensor  # [1, n] int32, the document of each token
    max_len: int

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens_cpu[-1])  # the host copy: no device sync in a layer's check

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device) -> PackedDocs:
        if not seq_lens or any(int(x) < 1 for x in seq_lens):
            raise ValueError(f"packed documents need lengths >= 1 (got {seq_lens})")
        lens = torch.tensor([int(x) for x in seq_lens], dtype=torch.int64)
        n = int(lens.sum())
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        doc = torch.repeat_interleave(torch.arange(len(seq_lens)), lens, output_size=n)
        pos = torch.arange(n, dtype=torch.int64) - cu[:-1].index_select(0, doc)
        return cls(
            seq_lens=[int(x) for x in seq_lens],
            position_ids=pos.view(1, n).to(device, non_blocking=True),
            cu_seqlens=cu.to(torch.int32).to(device, non_blocking=True),
            cu_seqlens_cpu=cu,
            seq_idx=doc.to(torch.int32).view(1, n).to(device, non_blocking=True),
            max_len=int(lens.max()),
        )

    def attention_kwargs(self, attn_implementation: str) -> dict[str, Any]:
        """Extra stack-forward kwargs for the full-attention layers (besides ``position_ids``)."""
        if not (attn_implementation.startswith("flash_attention") or uses_packed_attention(attn_implementation)):
            return {}  # flex: the packed block mask comes from position_ids
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }

    def padded_index(self) -> torch.Tensor:
        """Flat position ``d * max_len + t`` of every packed token in a right-padded [D, max_len] batch."""
        lens = torch.tensor(self.seq_lens, dtype=torch.int64, device=self.position_ids.device)
        return real_token_index(lens, self.max_len, self.n_tokens)


def gated_delta_net_kernels(layer: nn.Module) -> dict[str, str]:
    """Origin (``fla`` / ``causal_conv1d`` / ``torch`` ...) of the two functions a GatedDeltaNet
    layer calls for a prefill, resolved through transformers' fallback wrappers."""
    mod = sys.modules.get(type(layer).__module__)
    out = {}
    for role, name in (("chunk", "torch_chunk_gated_delta_rule"), ("conv", "causal_conv1d_fn")):
        fn = getattr(mod, name, None) if mod is not None else None
        out[role] = impl_origin(resolve_impl(fn)) if fn is not None else "none"
    return out


def _fla_causal_conv() -> Callable[..., Any] | None:
    """fla's Triton causal conv (``fla.modules.causal_conv1d.causal_conv1d``), or None where fla
    (or the triton it needs) does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # ImportError, or triton failing to initialise on a CPU-only host
        return None
    return causal_conv1d


def packed_conv_kernel(kernels: dict[str, str]) -> str | None:
    """How a packed row's conv keeps documents apart for a layer on ``kernels``: ``"seq_idx"``
    (the causal-conv1d extension transformers already calls), ``"fla"`` (fla's Triton conv over
    ``cu_seqlens``, swapped in by :class:`DocumentResetMixer`) or None (no varlen conv here)."""
    if kernels["conv"] in _FAST:
        return "seq_idx"
    if kernels["chunk"] in _FAST and _fla_causal_conv() is not None:
        return "fla"
    return None


_KERNEL_NAMES = {
    "seq_idx": "causal-conv1d causal_conv1d_fn(seq_idx)",
    "fla": "fla.modules.causal_conv1d.causal_conv1d(cu_seqlens, triton)",
}


def fla_packed_conv(docs: PackedDocs) -> Callable[..., torch.Tensor]:
    """A drop-in for transformers' ``causal_conv1d_fn`` (x ``[1, D, n]``, weight ``[D, W]``) that
    runs fla's Triton causal conv over ``docs``' boundaries: no tap reads another document."""
    conv = _fla_causal_conv()
    if conv is None:
        raise RuntimeError("fla's causal_conv1d does not import here (flash-linear-attention and triton are needed)")

    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias=None, activation=None, **_: Any) -> torch.Tensor:
        # fla takes [B, T, D]; transposing back the layer's [B, D, T] view costs no copy
        out, _state = conv(
            hidden_states.transpose(1, 2),
            weight,
            bias,
            activation=activation,
            cu_seqlens=docs.cu_seqlens,
            cu_seqlens_cpu=docs.cu_seqlens_cpu,
        )
        return out.transpose(1, 2)

    return causal_conv1d_fn


@contextlib.contextmanager
def _layer_conv(layer: nn.Module, conv: Callable[..., torch.Tensor]) -> Iterator[None]:
    """The GatedDeltaNet's module calls ``conv`` as its ``causal_conv1d_fn`` for one call."""
    mod = sys.modules[type(layer).__module__]
    before = mod.causal_conv1d_fn
    mod.causal_conv1d_fn = conv
    try:
        yield
    finally:
        mod.causal_conv1d_fn = before


def packed_attention_kernel(attn_implementation: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The kernel a packed row's attention runs on (one of :data:`~dflash_ipc.families.PACKED_KERNELS`):
    transformers' own varlen path for flash/flex, else torch's varlen kernel where it runs (CUDA, bf16/fp16),
    else the per-document reference of :mod:`~dflash_ipc.target.packed_attention`."""
    if attn_implementation in _VARLEN_ATTENTION:
        return attn_implementation
    return "varlen_attn" if varlen_kernel_usable(device, dtype) else "reference"


def plan_packed_attention(setting: bool | str, family: DecoderFamily, attn_implementation: str, device, dtype) -> tuple[bool, str]:
    """Whether the attention layers let a packed row run (``target.varlen``: true, false or "auto"), and why.

    "auto" packs where the kernel reproduces every attention layer of the family exactly and runs on
    varlen kernels (the per-document reference is exact but slower than padding). ``true`` refuses a
    (family, kernel) pair that is not exact, naming what is missing; ``false`` never packs. Called by the
    target when it is built and by the preflight (check-config, before any process starts)."""
    if not isinstance(setting, bool) and setting != "auto":
        raise ValueError(f"target.varlen must be true, false or 'auto' (got {setting!r})")
    if setting is False:
        return False, "target.varlen = false"
    kernel = packed_attention_kernel(attn_implementation, device, dtype)
    # an unchecked family may have layers of kinds no reader knows (an LFM2 conv): packed_problems refuses it first
    has_attention = not family.packed_checked or bool(family.known_attention_layers())
    problems = family.packed_problems(kernel, lse=varlen_lse_available()) if has_attention else []
    if problems:
        why = f"the packed {kernel} attention cannot reproduce {family.name} exactly: {'; '.join(problems)}"
        if setting is True:
            raise ValueError(f'target.varlen = true: {why}; set target.varlen = "auto" (the padded forward) or false')
        return False, f"auto: padded, {why}"
    if not has_attention:
        return True, ""
    how = f"torch varlen_attn via {PACKED_ATTENTION}" if kernel == "varlen_attn" else kernel
    if kernel == "reference":
        if setting is True:
            return True, f"attention: {attn_implementation} per document, padded"
        no_kernel = "(torch's varlen_attn needs CUDA and bf16/fp16)"
        return False, f"auto: padded, {attn_implementation} attention has no varlen kernel here {no_kernel}"
    features = family.attention_features()
    return True, f"attention: {how}" + (f" ({', '.join(features)})" if features else "")


def resolve_varlen(setting: bool | str, stack: nn.Module, attn_implementation: str, family: DecoderFamily) -> tuple[bool, str]:
    """Whether the packed forward runs, and why, naming the kernels a packed row runs on
    (``target.varlen``: true, false or "auto").

    The attention layers as :func:`plan_packed_attention` decides; every GatedDeltaNet on fla's chunk
    kernel with a varlen conv (:func:`packed_conv_kernel`: fla's own Triton conv is enough, causal-conv1d is
    used when present). Without them each document would run padded inside that layer, or attend through a
    dense block-diagonal mask, and packing was measured slower than padding (docs/BENCHMARKS.md)."""
    param = next(stack.parameters(), None)
    device, dtype = (param.device, param.dtype) if param is not None else ("cpu", torch.float32)
    packs, attention_how = plan_packed_attention(setting, family, attn_implementation, device, dtype)
    if setting is False:
        return False, attention_how
    why_padded = [attention_how.removeprefix("auto: padded, ")] if not packs else []
    kernels_used = [attention_how] if packs and attention_how else []
    linear = [layer.linear_attn for layer in getattr(stack, "layers", []) if getattr(layer, "linear_attn", None) is not None]
    if linear:
        inner = linear[0].inner if isinstance(linear[0], DocumentResetMixer) else linear[0]
        kernels = gated_delta_net_kernels(inner)
        conv = packed_conv_kernel(kernels) if kernels["chunk"] in _FAST else None
        if conv is None:
            why_padded.append(f"GatedDeltaNet chunk={kernels['chunk']} conv={kernels['conv']} (packing needs fla)")
            kernels_used.append("GatedDeltaNet: each document padded inside the layer")
        else:
            kernels_used.append(f"GatedDeltaNet: fla chunk_gated_delta_rule(cu_seqlens) + {_KERNEL_NAMES[conv]}")
    if setting is True:
        return True, "target.varlen = true" + (f" ({'; '.join(kernels_used)})" if kernels_used else "")
    if why_padded:
        return False, "auto: padded, " + "; ".join(why_padded)
    return True, f"auto: packed ({'; '.join(kernels_used)})"


def attention_modules(stack: nn.Module, family: DecoderFamily) -> dict[nn.Module, AttentionLayer]:
    """Each attention module of ``stack`` (a decoder layer's ``self_attn``) -> its layer's traits, what the
    packed attention looks a call's layer up by."""
    out: dict[nn.Module, AttentionLayer] = {}
    for i, layer in enumerate(stack.layers):
        spec = family.attention_layers[i]
        attention = getattr(layer, "self_attn", None)
        if spec.kind != "linear" and attention is not None:
            out[attention] = spec
    return out


class DocumentResetMixer(nn.Module):
    """A GatedDeltaNet that keeps the documents of a packed row apart (see the module docstring).

    ``docs`` is set by :meth:`TargetModel.capture_packed` for one forward and cleared after it;
    while it is None the layer runs unchanged (the padded path). ``conv``: how the packed conv
    keeps documents apart (:func:`packed_conv_kernel`), None for the padded per-layer fallback."""

    def __init__(self, inner: nn.Module, conv: str | None):
        super().__init__()
        self.inner = inner
        self.conv = conv
        self.reset_documents = True  # tests only: False shows the leak across documents
        self.docs: PackedDocs | None = None
        self._padded_index: torch.Tensor | None = None
        self._fla_conv: Callable[..., torch.Tensor] | None = None

    @property
    def use_kernels(self) -> bool:
        """fla's chunk over cu_seqlens and a varlen conv (else the padded per-layer fallback)."""
        return self.conv is not None

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        docs = self.docs
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            kwargs.pop(key, None)  # only this wrapper decides what the linear attention gets
        if docs is None or not self.reset_documents:
            return self.inner(hidden_states, **kwargs)
        if hidden_states.shape[0] != 1 or hidden_states.shape[1] != docs.n_tokens:
            raise ValueError(f"packed hidden states must be [1, {docs.n_tokens}, H] (got {tuple(hidden_states.shape)})")
        if kwargs.get("attention_mask") is not None:
            raise ValueError("a packed row has no padding: attention_mask must be None")
        if self.conv == "seq_idx":
            return self.inner(hidden_states, cu_seq_lens_q=docs.cu_seqlens, seq_idx=docs.seq_idx, **kwargs)
        if self.conv == "fla":
            assert self._fla_conv is not None
            with _layer_conv(self.inner, self._fla_conv):
                return self.inner(hidden_states, cu_seq_lens_q=docs.cu_seqlens, cu_seqlens_cpu=docs.cu_seqlens_cpu, **kwargs)
        # Torch fallback: this layer alone runs right-padded, one document per row.
        if self._padded_index is None:
            self._padded_index = docs.padded_index()
        idx = self._padded_index
        width = hidden_states.shape[-1]
        padded = hidden_states.new_zeros((len(docs.seq_lens) * docs.max_len, width))
        padded.index_copy_(0, idx, hidden_states[0])
        out = self.inner(padded.view(len(docs.seq_lens), docs.max_len, width), **kwargs)
        return out.reshape(-1, out.shape[-1]).index_select(0, idx).unsqueeze(0)

    def set_docs(
        self, docs: PackedDocs | None, padded_index: torch.Tensor | None = None, fla_conv: Callable[..., torch.Tensor] | None = None
    ) -> None:
        self.docs = docs
        self._padded_index = padded_index
        self._fla_conv = fla_conv


def install_document_reset(stack: nn.Module) -> tuple[list[DocumentResetMixer], bool]:
    """Wrap every GatedDeltaNet of ``stack`` (its ``linear_attn``) in a :class:`DocumentResetMixer`.

    Returns the wrappers and whether they all run on varlen kernels (fla's chunk and a varlen
    conv: one without the other cannot reset both the state and the conv, so the padded
    fallback runs)."""
    mixers: list[DocumentResetMixer] = []
    for layer in stack.layers:
        inner = getattr(layer, "linear_attn", None)
        if inner is None or isinstance(inner, DocumentResetMixer):
            if isinstance(inner, DocumentResetMixer):
                mixers.append(inner)
            continue
        kernels = gated_delta_net_kernels(inner)
        conv = packed_conv_kernel(kernels) if kernels["chunk"] in _FAST else None
        wrapper = DocumentResetMixer(inner, conv)
        layer.linear_attn = wrapper
        mixers.append(wrapper)
    return mixers, bool(mixers) and all(m.use_kernels for m in mixers)
