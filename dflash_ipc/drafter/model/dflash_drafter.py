"""The DFlash drafter: a small Qwen3-style block-diffusion decoder conditioned on target hidden states.

Architecture (as in the DFlash reference / SpecForge ``DFlashDraftModel`` and the SGLang and
vLLM serving implementations):

* **Context.** The ``k`` captured target planes of each token are concatenated (layer-major)
  into ``[n, k*H]`` and projected once: ``ctx = hidden_norm(fc(concat))`` with
  ``fc = Linear(k*H -> H, bias=False)``.
* **Block input.** Each draft block is ``[embed(anchor), embed(MASK) x (block_size-1)]``, using
  the *target's* (frozen) embedding table.
* **Layers.** Pre-norm Qwen3 decoder layers (RMSNorm, attention with per-head q/k RMSNorm and
  RoPE, SwiGLU MLP). In every layer the context enters as extra keys/values: ``k_proj``/
  ``v_proj`` of ``ctx`` (no ``input_layernorm`` on the context), then that layer's ``k_norm``
  and RoPE at the context token's position. Queries come from the block tokens only.
* **Head.** Final ``norm``, then the *target's* (frozen) LM head.
* **The target's effective tables.** Where the target's family scales its embeddings or transforms its
  logits (``DrafterModelConfig.frozen_head``: Gemma, Granite), :meth:`~DFlashDrafter.embed` and
  :meth:`~DFlashDrafter.compute_logits` do the same (:mod:`dflash_ipc.drafter.model.frozen_head`).

The embedding and LM head are given to the constructor as tensors and kept as frozen
parameters (``requires_grad=False``) that are left out of :meth:`~torch.nn.Module.state_dict`,
so checkpoints and exports hold only the drafter's own weights.

Attention runs through ``torch.nn.attention.flex_attention`` with a ``BlockMask`` (compiled on
CUDA), through ``F.scaled_dot_product_attention`` with a dense boolean mask, or blockwise
(:mod:`dflash_ipc.drafter.model.blockwise`: each document's context range and each block's own keys,
the CPU's default); the masks themselves are built by :mod:`dflash_ipc.drafter.loss.masks` and passed per layer type.
Export for SGLang / vLLM: :mod:`dflash_ipc.drafter.export.layout`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ipc.config import DrafterConfig
from dflash_ipc.drafter.model.blockwise import BlockwiseMask, blockwise_attention
from dflash_ipc.drafter.model.fp8_head import Fp8Head
from dflash_ipc.drafter.model.frozen_head import embed_rows
from dflash_ipc.families import FrozenHead, family_of
from dflash_ipc.platform.devices import as_device, fill_normal_
from dflash_ipc.platform.e4m3 import fp8_device_problem
from dflash_ipc.target_spec.hf_config import rope_theta, text_config

try:  # flex_attention exists in every supported torch (>= 2.11); keep the import soft anyway.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

__all__ = [
    "DrafterModelConfig",
    "DFlashDrafter",
    "RMSNorm",
    "resolve_attention_backend",
    "num_parameters",
]


# --------------------------------------------------------------------------- config


@dataclass
class DrafterModelConfig:
    """Shape of one drafter; :meth:`from_configs` resolves ``0 = same as the target``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    layer_types: list[str]
    sliding_window: int
    block_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_layer_ids: list[int]
    mask_token_id: int
    # Decoder layers of the target (0: unknown); exported as ``num_target_layers``.
    num_target_layers: int = 0
    initializer_range: float = 0.02
    # Rows of the drafter's head (dflash_ipc/data/draft_vocab.py); 0: the whole vocabulary.
    draft_vocab_size: int = 0
    # What the target applies around its embedding table and LM head (families.traits.FrozenHead).
    frozen_head: FrozenHead = FrozenHead()

    def __post_init__(self) -> None:
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unsupported layer types {bad}; use {LAYER_TYPES}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE (got {self.head_dim})")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} outside [0, vocab_size={self.vocab_size}]")

    @property
    def num_context_planes(self) -> int:
        """k: the number of target planes the context concatenates."""
        return len(self.target_layer_ids)

    @classmethod
    def from_configs(
        cls,
        drafter_cfg: DrafterConfig,
        target_hf_config: Any,
        target_layer_ids: list[int],
        mask_token_id: int,
    ) -> DrafterModelConfig:
        """Resolve a :class:`DrafterConfig` against the target's transformers config.

        Zeros in ``drafter_cfg`` mean "same as the target", as its family reads it where layers differ
        or a dense width is missing (:meth:`~dflash_ipc.families.base.DecoderFamily.attention_shape`,
        :meth:`~dflash_ipc.families.base.DecoderFamily.mlp_width`: an MoE target's active experts' width).
        The hidden size must equal the target's: the drafter reads the target's embedding table and LM head directly.
        """
        t = text_config(target_hf_config)
        family = family_of(target_hf_config)
        t_hidden = int(t.hidden_size)
        t_heads, t_kv_heads, t_head_dim = family.attention_shape()
        hidden = drafter_cfg.hidden_size or t_hidden
        if hidden != t_hidden:
            raise ValueError(
                f"drafter.hidden_size ({hidden}) must equal the target's hidden_size ({t_hidden}): "
                "the drafter uses the target's embedding and LM head; set it to 0"
            )
        heads = drafter_cfg.num_attention_heads or t_heads
        kv_heads = drafter_cfg.num_key_value_heads or t_kv_heads
        if drafter_cfg.num_attention_heads and not drafter_cfg.num_key_value_heads and heads % kv_heads:
            kv_heads = heads
        return cls(
            hidden_size=hidden,
            intermediate_size=drafter_cfg.intermediate_size or family.mlp_width(),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=drafter_cfg.head_dim or t_head_dim,
            num_layers=drafter_cfg.num_layers,
            layer_types=drafter_cfg.resolved_layer_types(),
            sliding_window=drafter_cfg.sliding_window,
            block_size=drafter_cfg.block_size,
            vocab_size=int(t.vocab_size),
            rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(t),
            max_position_embeddings=int(getattr(t, "max_position_embeddings", 32768)),
            target_layer_ids=list(target_layer_ids),
            mask_token_id=int(mask_token_id),
            num_target_layers=int(getattr(t, "num_hidden_layers", 0) or 0),
            draft_vocab_size=drafter_cfg.draft_vocab_size,
            frozen_head=family.frozen_head(),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: ``weight * x / rms(x)``, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin ``[len, head_dim]`` for NeoX-style (rotate-half) RoPE, as Qwen3 uses."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [1, heads, L, hd]; cos/sin [L, hd]
    return x * cos + _rotate_half(x) * sin


#: ``DrafterConfig.attention``'s choices.
ATTENTION_KERNELS = ("auto", "flex", "sdpa", "blockwise")


def resolve_attention_backend(attention: str, device: torch.device | str) -> str:
    """``"auto"`` -> ``"flex"`` on CUDA, ``"blockwise"`` elsewhere; explicit choices pass through."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION_KERNELS))} (got {attention!r})")
    if attention != "auto":
        if attention == "flex" and flex_attention is None:  # pragma: no cover
            raise RuntimeError("attention='flex' needs torch.nn.attention.flex_attention")
        return attention
    return "flex" if as_device(device).type == "cuda" else "blockwise"


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (dynamic shapes: every batch differs)."""
    return torch.compile(flex_attention, dynamic=True)


def _flex(q, k, v, block_mask, scale):
    if q.device.type == "cuda":
        fn = _compiled_flex()
    else:  # eager, unfused: fine for tiny CPU checks, no backward on CPU
        fn = flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _sdpa(q, k, v, mask: torch.Tensor, scale):
    """Dense-mask attention. Rows with nothing visible output exactly 0 (as flex does)."""
    row_live = mask.any(dim=-1, keepdim=True)  # [Q, 1]
    if not bool(row_live.all()):
        # Give empty rows one visible key so no kernel sees an all -inf row (NaN on some
        # backends, also in backward), then zero those rows.
        first = torch.zeros_like(mask)
        first[:, 0] = True
        mask = mask | (first & ~row_live)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out * row_live.to(out.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any):
        """x ``[Q, H]`` block tokens, ctx ``[n, H]`` projected context; cos/sin ``[n+Q, hd]``."""
        return self.o_proj(self.attention(*self.project_qkv(x, ctx, cos, sin), mask))

    def project_qkv(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries of the block rows ``x``, keys and values of ``[context | blocks]`` (all ``[1, heads, L, hd]``)."""
        n = ctx.shape[0]
        k, v = self.project_kv(torch.cat([ctx, x], dim=0), cos, sin)  # keys/values: [context | blocks]
        return self.project_q(x, cos[n:], sin[n:]), k, v

    def forward_cached(self, x: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, mask: Any):
        """:meth:`forward` with the context's keys/values from :meth:`project_kv`; cos/sin ``[Q, hd]`` of the blocks only."""
        k, v = self.project_kv(x, cos, sin)
        return self._attend(x, torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2), cos, sin, mask)

    def project_kv(self, inp: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values ``[1, kv_heads, L, hd]`` of ``L`` rows; a row's depend on that row alone."""
        n, hd = inp.shape[0], self.head_dim
        k = self.k_norm(self.k_proj(inp).view(n, self.num_kv_heads, hd)).transpose(0, 1)
        v = self.v_proj(inp).view(n, self.num_kv_heads, hd).transpose(0, 1)
        return _apply_rope(k, cos, sin).unsqueeze(0), v.unsqueeze(0)

    def project_q(self, x: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor) -> torch.Tensor:
        """Queries (q_norm, RoPE) ``[1, heads, Q, hd]`` of the block rows ``x``."""
        nq, hd = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(nq, self.num_heads, hd)).transpose(0, 1)
        return _apply_rope(q, cos_q, sin_q).unsqueeze(0)

    def _attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, mask: Any):
        return self.o_proj(self.attention(self.project_q(x, cos_q, sin_q), k, v, mask))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        """Attention of ``q`` over ``k``/``v`` under ``mask``: ``[Q, heads * hd]``, before ``o_proj``."""
        nq, hd = q.shape[2], self.head_dim
        if BlockMask is not None and isinstance(mask, BlockMask):
            out = _flex(q, k, v, mask, self.scale)
        elif isinstance(mask, BlockwiseMask):
            out = blockwise_attention(q, k, v, mask, self.scale)
        elif isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            out = _sdpa(q, k, v, mask, self.scale)
        else:
            raise TypeError(f"attention mask must be a flex BlockMask, a BlockwiseMask or a bool tensor, got {type(mask).__name__}")
        return out[0].transpose(0, 1).reshape(nq, self.num_heads * hd)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, x, ctx, cos, sin, mask, cached: bool = False, compiled: bool = False):
        """``compiled``: the dense parts before and after attention (norms, projections, RoPE, SwiGLU)
        run through :func:`torch.compile` (:func:`_compiled_dense`); attention itself as without."""
        if cached:
            x = x + self.self_attn.forward_cached(self.input_layernorm(x), ctx, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        before, after = _compiled_dense() if compiled else (_before_attention, _after_attention)
        return after(self, x, self.self_attn.attention(*before(self, x, ctx, cos, sin), mask))


def _before_attention(layer: DFlashDecoderLayer, x, ctx, cos, sin):
    """A layer's dense work up to attention: input norm, q/k/v projections, q/k norms, RoPE."""
    return layer.self_attn.project_qkv(layer.input_layernorm(x), ctx, cos, sin)


def _after_attention(layer: DFlashDecoderLayer, x, attn_out):
    """A layer's dense work after attention: o_proj, residual, post-attention norm, SwiGLU MLP, residual."""
    x = x + layer.self_attn.o_proj(attn_out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@functools.cache
def _compiled_dense():
    """:func:`_before_attention` and :func:`_after_attention` compiled once per process, shared by every
    layer (the layer is an argument: its weights are graph inputs, so one graph serves all layers of
    one shape) with dynamic shapes (every batch has its own row counts: no recompile per batch)."""
    return torch.compile(_before_attention, dynamic=True), torch.compile(_after_attention, dynamic=True)


# --------------------------------------------------------------------------- the model

_FROZEN = ("embed_weight", "lm_head_weight")


def _drop_frozen_from_state_dict(module, state_dict, prefix, local_metadata):
    for name in _FROZEN:
        state_dict.pop(prefix + name, None)


def _frozen_not_missing(module, incompatible_keys):
    for key in list(incompatible_keys.missing_keys):
        if key.rsplit(".", 1)[-1] in _FROZEN:
            incompatible_keys.missing_keys.remove(key)


class DFlashDrafter(nn.Module):
    """DFlash drafter. Parameter names match the SGLang / vLLM DFlash checkpoint layout.

    Args:
        config: the resolved shape.
        embed_weight: the target's input embedding ``[vocab, H]`` (frozen, not copied if
            already on the right device/dtype).
        lm_head_weight: the target's LM head ``[vocab, H]`` (frozen; may be the same tensor as
            ``embed_weight`` for tied targets).
        attention: ``"auto" | "flex" | "sdpa"`` (``DrafterConfig.attention``).
        compile_dense: run each layer's dense parts through ``torch.compile`` in :meth:`forward` while
            grad is on (``DrafterConfig.compile``; :meth:`DFlashDecoderLayer.forward`).
        draft_token_ids: ascending target ids ``[config.draft_vocab_size]`` the head keeps
            (``dflash_ipc.data.draft_vocab``); then ``lm_head_weight`` holds those rows only and
            :meth:`compute_logits` puts ``-inf`` everywhere else. Required iff the size is non-zero.
        target_dtype: the dtype the target computes its embeddings in, where ``config.frozen_head`` scales
            them (a bf16 target rounds scale and product in bf16); None: the embedding table's.
    """

    def __init__(
        self,
        config: DrafterModelConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        attention: str = "auto",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        init_seed: int | None = None,
        compile_dense: bool = False,
        draft_token_ids: torch.Tensor | None = None,
        target_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        resolve_attention_backend(attention, "cpu")  # validate the name early
        self.config = config
        self.attention = attention
        self.compile_dense = compile_dense
        h, v = config.hidden_size, config.vocab_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (v, h):
                raise ValueError(f"{name} must be [vocab_size={v}, hidden_size={h}], got {tuple(w.shape)}")
        # The trainable parts are declared on the meta device and allocated once, where they
        # will live: built on the host in fp32 and moved, a large drafter would stage all its
        # weights in every process's host memory just to be born.
        with torch.device("meta"):
            self.fc = nn.Linear(config.num_context_planes * h, h, bias=False)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
            self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(h, config.rms_norm_eps)
        target = as_device(device) if device is not None else torch.device("cpu")
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(torch.empty(param.shape, device=target, dtype=dtype)))
        self.embed_weight = nn.Parameter(embed_weight.detach().to(target), requires_grad=False)
        self.lm_head_weight = nn.Parameter(lm_head_weight.detach().to(target), requires_grad=False)
        self.target_dtype = target_dtype or embed_weight.dtype
        if lm_head_weight is embed_weight:
            self.lm_head_weight = self.embed_weight
        # Buffers, not state: the ids travel in the run directory and the export, not with the trainable weights.
        self.register_buffer("draft_token_ids", None, persistent=False)
        self.register_buffer("draft_index", None, persistent=False)  # [vocab] int64: a target id's head row, -1 outside
        if bool(config.draft_vocab_size) != (draft_token_ids is not None):
            raise ValueError(f"draft_token_ids must be given exactly when config.draft_vocab_size > 0 (it is {config.draft_vocab_size})")
        if draft_token_ids is not None:
            self._keep_draft_rows(draft_token_ids.to(device=target, dtype=torch.int64))
        self.reset_parameters(int(torch.initial_seed()) if init_seed is None else init_seed)
        # training.ce_fp8's e4m3 copies of the head: a plain attribute, so never state (module docstring of fp8_head)
        self._fp8_head: Fp8Head | None = None
        self._register_state_dict_hook(_drop_frozen_from_state_dict)
        self.register_load_state_dict_post_hook(_frozen_not_missing)

    def _keep_draft_rows(self, ids: torch.Tensor) -> None:
        v = self.config.vocab_size
        if ids.dim() != 1 or ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft_token_ids must be [{self.config.draft_vocab_size}], got {tuple(ids.shape)}")
        ascending = ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all())
        if not ascending or int(ids[0]) < 0 or int(ids[-1]) >= v:
            raise ValueError(f"draft_token_ids must be strictly ascending ids in [0, {v})")
        self.draft_token_ids = ids
        index = torch.full((v,), -1, dtype=torch.int64, device=ids.device)
        index[ids] = torch.arange(ids.numel(), device=ids.device)
        self.draft_index = index
        self.lm_head_weight = nn.Parameter(self.lm_head_weight.detach()[ids].clone(), requires_grad=False)

    # -- parameters --------------------------------------------------------------

    def reset_parameters(self, seed: int) -> None:
        """N(0, initializer_range) linear weights, unit norms: drawn on the host from one generator
        seeded by ``seed``, in module order and fixed row chunks (bounded host memory), so every
        device and every rank gets the same drafter from the same seed."""
        std = self.config.initializer_range
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    fill_normal_(m.weight, std, gen)
                elif isinstance(m, RMSNorm):
                    nn.init.ones_(m.weight)

    def fp8_head(self) -> Fp8Head:
        """The frozen head's e4m3 copies for the loss's GEMMs (``training.ce_fp8``, :mod:`dflash_ipc.drafter.model.fp8_head`):
        quantized at the first call and kept, the head never changing (made again only for a head moved or
        replaced). Neither parameter nor buffer: no ``state_dict``, checkpoint or export holds them."""
        if self._fp8_head is None or not self._fp8_head.made_from(self.lm_head_weight):
            if self.lm_head_weight.device.type == "cuda" and (problem := fp8_device_problem(self.lm_head_weight.device)):
                raise ValueError(f"training.ce_fp8: {problem}; set training.ce_fp8 = false")
            self._fp8_head = None  # the stale copies go before the new ones are made
            self._fp8_head = Fp8Head.quantize(self.lm_head_weight)
        return self._fp8_head

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def attention_backend(self, device: torch.device | str | None = None) -> str:
        return resolve_attention_backend(self.attention, device if device is not None else self.device)

    # -- forward pieces ------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """What the target's layer 0 receives for ``token_ids`` (its table rows, scaled as it scales them)."""
        return embed_rows(self.config.frozen_head, F.embedding(token_ids, self.embed_weight), self.target_dtype, self.dtype)

    def project_context(self, context: torch.Tensor) -> torch.Tensor:
        """``[n, k*H]`` concatenated target planes -> ``hidden_norm(fc(.))`` ``[n, H]``."""
        return self.hidden_norm(self.fc(context.to(self.dtype)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's whole vocabulary (``-inf`` outside a draft vocabulary)."""
        rows = self.compute_head_logits(hidden)
        if self.draft_token_ids is None:
            return rows
        full = rows.new_full((*rows.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_token_ids] = rows
        return full

    def compute_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the head's rows (the whole vocabulary, or the draft vocabulary's ids in order), finished
        as the target finishes its own (divided, soft-capped), in the hidden states' dtype as transformers does."""
        return self.config.frozen_head.finish_logits(F.linear(hidden, self.lm_head_weight.to(hidden.dtype)))

    def block_input_ids(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """``[N]`` anchor tokens -> ``[N, block_size]``: anchor, then mask tokens."""
        ids = anchor_tokens.new_full((anchor_tokens.shape[0], self.config.block_size), self.config.mask_token_id)
        ids[:, 0] = anchor_tokens
        return ids

    def forward(
        self,
        context: torch.Tensor,
        context_position_ids: torch.Tensor,
        block_input_ids: torch.Tensor,
        block_position_ids: torch.Tensor,
        masks: Mapping[str, Any],
    ) -> torch.Tensor:
        """Run all draft blocks of a packed batch at once.

        Args:
            context: ``[n, k*H]`` concatenated target planes (see ``dflash_loss.concat_context``).
            context_position_ids: ``[n]`` RoPE position of each context token (restarts at 0
                in every document).
            block_input_ids: ``[N, block_size]`` (anchor token, then mask tokens).
            block_position_ids: ``[N, block_size]`` RoPE positions of the block tokens
                (anchor's in-document position + 0..block_size-1).
            masks: per layer type (``"full_attention"``, ``"sliding_attention"``) a flex
                ``BlockMask`` or a bool ``[N*block_size, n + N*block_size]`` tensor over keys
                ``[context | blocks]`` (``dflash_loss.build_attention_masks``).

        Returns:
            ``[N*block_size, H]`` final-normed hidden states (apply :meth:`compute_logits`).
        """
        cfg = self.config
        x = self.embed(block_input_ids.reshape(-1))
        ctx = self.project_context(context)
        positions = torch.cat([context_position_ids.reshape(-1), block_position_ids.reshape(-1)])
        cos, sin = _rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        # Passes without grad (held-out tau) stay eager: their graphs would compile on the first held-out
        # pass, in the middle of training, not in the warm-up.
        compiled = self.compile_dense and torch.is_grad_enabled()
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, masks[layer.layer_type], compiled=compiled)
        return self.norm(x)

    def context_kv(self, context: torch.Tensor, context_position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values ``[1, kv_heads, n, hd]`` the context rows give every block. A
        row's depend on that row and its position alone, so a decoder whose context only grows computes
        each row's once and appends (``eval.spec.DrafterProposer``) instead of re-projecting the whole
        context every step."""
        ctx = self.project_context(context)
        cos, sin = _rope_cos_sin(context_position_ids.reshape(-1), self.config.head_dim, self.config.rope_theta, ctx.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward_blocks(self, context_kv, block_input_ids: torch.Tensor, block_position_ids: torch.Tensor, masks: Mapping[str, Any]):
        """:meth:`forward` on the context's keys/values from :meth:`context_kv` (masks over the same keys)."""
        cfg = self.config
        x = self.embed(block_input_ids.reshape(-1))
        cos, sin = _rope_cos_sin(block_position_ids.reshape(-1), cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, kv, cos, sin, masks[layer.layer_type], cached=True)
        return self.norm(x)


def num_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
