"""What a target family is made of, as plain data: each decoder layer's attention, the MoE experts, and
the effective embedding and LM head. Read from a transformers config by
:class:`~dflash_ipc.families.base.DecoderFamily` (and the family modules that refine it); read by the
target (packed attention, capture), the drafter's frozen pieces, eval, preflight, FP8, fusion and FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EXPERTS_MODULE", "AttentionLayer", "ExpertLayout", "FrozenHead", "FusibleModules", "LayerKind", "TemperatureTuning"]

#: A decoder layer's token mixer: causal attention over the whole document ("full"), over the last
#: ``window`` tokens ("sliding"), within fixed chunks of the document ("chunked"), or a linear-attention
#: recurrence (GatedDeltaNet: "linear").
LayerKind = Literal["full", "sliding", "chunked", "linear"]


@dataclass(frozen=True)
class TemperatureTuning:
    """Llama 4's NoPE layers scale each query by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``,
    ``p`` the token's position in its document."""

    floor_scale: float
    attn_scale: float

    def scales(self, positions: Any) -> Any:
        """The query scale of each position (a float tensor of ``positions``' shape)."""
        import torch

        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


@dataclass(frozen=True)
class AttentionLayer:
    """One decoder layer's token mixer, as the packed forward must reproduce it."""

    kind: LayerKind
    window: int | None = None
    """Tokens a query sees, itself included (transformers' ``sliding_window``), for "sliding"."""
    chunk: int | None = None
    """Tokens per attention chunk, counted from the document's start, for "chunked"."""
    sinks: bool = False
    """A learned per-head logit joins every softmax's denominator (gpt-oss)."""
    softcap: float | None = None
    """Attention scores pass through ``softcap * tanh(s / softcap)`` (Gemma 2)."""
    temperature_tuning: TemperatureTuning | None = None
    """Queries scaled by their position (Llama 4's NoPE layers)."""
    causal: bool = True
    num_heads: int = 0
    num_kv_heads: int = 0
    qk_head_dim: int = 0
    v_head_dim: int = 0
    """Differs from ``qk_head_dim`` under multi-head latent attention (DeepSeek-V3)."""

    def features(self) -> list[str]:
        """What this layer does beyond plain causal attention over the whole document, in words."""
        out = []
        if self.kind == "sliding":
            out.append(f"sliding window of {self.window}")
        if self.kind == "chunked":
            out.append(f"chunked attention of {self.chunk}")
        if self.sinks:
            out.append("attention sinks")
        if self.softcap is not None:
            out.append(f"attention soft-capping at {self.softcap:g}")
        if self.temperature_tuning is not None:
            out.append("position-scaled queries (NoPE temperature tuning)")
        if not self.causal:
            out.append("bidirectional attention")
        if self.v_head_dim and self.qk_head_dim and self.v_head_dim != self.qk_head_dim:
            out.append(f"value head size {self.v_head_dim} != query/key head size {self.qk_head_dim}")
        return out


#: The module transformers 5.x keeps an MoE layer's routed experts in (what the FLOP count and FP8 look for).
EXPERTS_MODULE = "experts"


@dataclass(frozen=True)
class ExpertLayout:
    """A mixture-of-experts target's routed experts (what most of its weights are)."""

    num_experts: int
    active: int
    """Experts each token is routed to (top-k)."""
    expert_intermediate: int
    shared_intermediate: int = 0
    """Width of the always-on shared expert(s), 0 without."""

    def __post_init__(self) -> None:
        if not 0 < self.active <= self.num_experts:
            raise ValueError(f"{self.active} active experts of {self.num_experts}")

    @property
    def active_fraction(self) -> float:
        return self.active / self.num_experts


@dataclass(frozen=True)
class FrozenHead:
    """How the target turns ids into its first hidden state and its last one into logits, beyond a plain
    table lookup and a plain matmul: what the drafter's frozen embedding and head must apply to equal it.

    ``embed(ids) = table[ids] * embed_scale``; ``logits = cap(h @ head.T / logit_divisor)`` with
    ``cap(x) = c * tanh(x / c)`` when ``final_logit_softcap`` is ``c``."""

    embed_scale: float = 1.0
    logit_divisor: float = 1.0
    final_logit_softcap: float | None = None
    embed_scale_in_dtype: bool = True
    """Gemma multiplies by the scale cast to the hidden states' dtype first (a bf16 sqrt(H) is not sqrt(H))."""

    @property
    def is_plain(self) -> bool:
        return self.embed_scale == 1.0 and self.logit_divisor == 1.0 and self.final_logit_softcap is None

    def scale_embeddings(self, x: Any) -> Any:
        if self.embed_scale == 1.0:
            return x
        import torch

        scale = torch.tensor(self.embed_scale, dtype=x.dtype if self.embed_scale_in_dtype else torch.float32, device=x.device)
        return (x * scale).to(x.dtype)

    def finish_logits(self, logits: Any) -> Any:
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.final_logit_softcap is not None:
            import torch

            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def describe(self) -> str:
        if self.is_plain:
            return "plain"
        parts = []
        if self.embed_scale != 1.0:
            parts.append(f"embeddings x {self.embed_scale:.6g}")
        if self.logit_divisor != 1.0:
            parts.append(f"logits / {self.logit_divisor:.6g}")
        if self.final_logit_softcap is not None:
            parts.append(f"logits soft-capped at {self.final_logit_softcap:g}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "embed_scale": self.embed_scale,
            "embed_scale_in_dtype": self.embed_scale_in_dtype,
            "logit_divisor": self.logit_divisor,
            "final_logit_softcap": self.final_logit_softcap,
        }


@dataclass(frozen=True)
class FusibleModules:
    """Class names of the modules :mod:`~dflash_ipc.target.fused` can route through fused kernels."""

    zero_centered_norms: frozenset[str] = field(default_factory=frozenset)
    """RMSNorms computing ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32."""
    gated_norms: frozenset[str] = field(default_factory=frozenset)
    """GatedDeltaNet output norms: ``w * norm(x) * silu(gate)``."""
    swiglu_mlps: frozenset[str] = field(default_factory=frozenset)
    """Dense MLPs ``down(silu(gate(x)) * up(x))`` with ``gate_proj``, ``up_proj``, ``down_proj``."""

    def __bool__(self) -> bool:
        return bool(self.zero_centered_norms or self.gated_norms or self.swiglu_mlps)
