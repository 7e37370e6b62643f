"""``[drafter]``: the drafter's shape, its anchors and how they are budgeted, its speed options and its head.

Validated in ``__post_init__`` like every section (:mod:`dflash_ipc.config.loader` loads it); the
checks against the target (sizes, the vocabulary) are the preflight's (:mod:`dflash_ipc.runtime.preflight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ipc.config.fields import require

#: ``drafter.fp8_linears``: "none", or one of torchao's float8 training recipes by name
FP8_LINEARS_RECIPES = ("none", "rowwise", "tensorwise")


@dataclass
class DrafterConfig:
    num_layers: int = 5
    """Decoder layers of the drafter."""
    layer_types: list[Literal["sliding_attention", "full_attention"]] = field(default_factory=list)
    """Each layer's attention from the bottom; empty: all sliding except the last (the DFlash default 4+1)."""
    sliding_window: int = 2048
    """Window of the sliding_attention layers, in tokens."""
    block_size: int = 16
    """Tokens the drafter proposes per block (2..64): an anchor and the block_size - 1 tokens after it."""
    num_anchors: int = 512
    """Anchors (block starts) sampled per document, SpecForge's per-sample budget."""
    max_anchors_per_batch: int = 0
    """Cap on a batch's anchors: a uniform subset of them; 0: no cap."""
    anchor_chunk: int | Literal["auto"] = 0
    """Anchors per drafter forward+backward inside one optimizer step (gradient accumulation over anchor chunks:
    memory follows the chunk, not the anchor count); 0: all anchors at once; "auto": the most this GPU fits beside
    a target sharing it, chosen at the drafter's start (drafter/training/memory_plan.py)."""
    anchor_budget: Literal["fixed", "follow-wait"] = "fixed"
    """How many anchors each batch trains on. "fixed": ``max_anchors_per_batch``, always. "follow-wait": starts at
    ``max_anchors_per_batch``; every ``anchor_window`` steps moves it by one ``anchor_chunk``, up while the drafter
    waits for batches more than ``anchor_target_wait`` of its time, down while it has become the bound."""
    anchor_target_wait: float = 0.2
    """follow-wait: the share of drafter time spent waiting that it aims at, in (0, 1)."""
    max_anchors_auto: int = 0
    """follow-wait: the most anchors per batch it may reach (a multiple of ``anchor_chunk``); 0: 8 x
    ``max_anchors_per_batch``."""
    anchor_window: int = 8
    """follow-wait: steps measured per decision (one chunk up or down at most)."""
    warm_up: bool = True
    """One forward+backward on a dummy batch of the configured shapes before the handshake (flex compile, first-step
    allocations), so the targets never wait on the drafter's first step."""
    hidden_size: int = 0
    """Hidden size; 0: the target's (it must equal the target's: the drafter reads its embedding and LM head)."""
    intermediate_size: int = 0
    """SwiGLU intermediate size; 0: the target's."""
    num_attention_heads: int = 0
    """Attention heads; 0: the target's."""
    num_key_value_heads: int = 0
    """Key/value heads (must divide the attention heads); 0: the target's."""
    head_dim: int = 0
    """Head dimension (even, for RoPE); 0: the target's."""
    noise_std: float = 0.0
    """Standard deviation of Gaussian noise added to the captured hidden states in training; 0: none."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The drafter's weights and compute (the optimizer state stays float32)."""
    attention: Literal["auto", "flex", "sdpa", "blockwise"] = "auto"
    """Attention kernel: "flex" (FlexAttention with block-sparse masks, CUDA), "sdpa" (dense masks), "blockwise"
    (each document's context range and each block's own keys in plain matmuls, no dense mask), "auto": flex on
    CUDA, blockwise on the CPU."""
    compile: bool = False
    """torch.compile each layer's norms, projections, RoPE and SwiGLU (dynamic shapes; attention as set above)."""
    fp8_linears: Literal["none", "rowwise", "tensorwise"] = "none"
    """The drafter's trainable linear layers (fc, q/k/v/o, gate/up/down) with FP8 matmuls, through torchao's float8
    training recipe of this name: "rowwise" (a scale per row, e4m3 throughout) or "tensorwise" (one scale per
    tensor); "none": all in ``dtype``. Only layers whose widths are multiples of 16 and large enough to gain convert
    (torchao's size thresholds: at Qwen3-8B widths all but k/v); the drafter logs how many. Weights, optimizer,
    checkpoints and the export stay as without it (a checkpoint loads either way). Needs torchao (``pip install
    'dflash-ipc[fp8]'``) and a CUDA GPU of compute capability >= 8.9, and pays with ``compile`` on (the casts fuse
    there). The CPU runs it too, with FP8 rounding and no speed-up (the tests use it)."""
    mask_token_id: int = -1
    """Token id of the masked block positions; -1: a reserved or unused id of the tokenizer, never a stop token."""
    init_from_target: list[int] = field(default_factory=list)
    """Start from the target's own weights: one target layer index per drafter layer (negative: from the top),
    copied with the target's final norm; fc starts as the identity on the captured plane nearest the first copied
    layer's input. Empty: random weights."""
    draft_vocab_size: int = 0
    """Rows of the drafter's head: the data's N most frequent answer tokens; 0: the target's whole vocabulary."""

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "num_layers", "must be >= 1")
        require(self.draft_vocab_size >= 0, "draft_vocab_size", "must be >= 0 (0 = the target's whole vocabulary)")
        self.init_from_target = [int(i) for i in self.init_from_target]
        require(
            not self.init_from_target or len(self.init_from_target) == self.num_layers,
            "init_from_target",
            f"must name one target layer per drafter layer (drafter.num_layers = {self.num_layers}), e.g. "
            f"{list(range(self.num_layers))}, or be empty for a random start; got {self.init_from_target}",
        )
        require(
            not self.layer_types or len(self.layer_types) == self.num_layers,
            "layer_types",
            f"must list exactly drafter.num_layers ({self.num_layers}) entries or be empty",
        )
        require(self.sliding_window >= 1, "sliding_window", "must be >= 1")
        require(2 <= self.block_size <= 64, "block_size", "must be between 2 and 64")
        require(self.num_anchors >= 1, "num_anchors", "must be >= 1")
        require(self.max_anchors_per_batch >= 0, "max_anchors_per_batch", "must be >= 0 (0 = no cap)")
        require(
            self.anchor_chunk == "auto" or self.anchor_chunk >= 0,
            "anchor_chunk",
            'must be "auto" (the most this GPU fits) or >= 0 (0 = all anchors in one forward)',
        )
        self._check_anchor_budget()
        require(self.noise_std >= 0, "noise_std", "must be >= 0")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            require(getattr(self, name) >= 0, name, "must be >= 0 (0 = same as the target)")
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        require(
            not (heads and kv_heads and heads % kv_heads),
            "num_attention_heads",
            f"must be a multiple of drafter.num_key_value_heads ({kv_heads}); got {heads}",
        )
        require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE (got {self.head_dim})")
        require(
            self.fp8_linears in FP8_LINEARS_RECIPES,
            "fp8_linears",
            f"must be one of {', '.join(repr(r) for r in FP8_LINEARS_RECIPES)} (got {self.fp8_linears!r}); "
            '"none" trains the linears in drafter.dtype',
        )
        require(self.mask_token_id >= -1, "mask_token_id", "must be a token id >= 0, or -1 for the tokenizer's mask token")

    def _check_anchor_budget(self) -> None:
        wait = self.anchor_target_wait
        require(0 < wait < 1, "anchor_target_wait", f"must be a fraction between 0 and 1 (got {wait})")
        require(self.anchor_window >= 1, "anchor_window", f"must be >= 1 step (got {self.anchor_window})")
        require(self.max_anchors_auto >= 0, "max_anchors_auto", "must be >= 0 (0 = 8 x drafter.max_anchors_per_batch)")
        if self.anchor_budget != "follow-wait":
            return
        require(
            self.anchor_chunk != "auto" and self.anchor_chunk > 0,
            "anchor_budget",
            "follow-wait moves the budget one drafter.anchor_chunk at a time: set drafter.anchor_chunk > 0 "
            "(the anchors one forward holds, e.g. 2048)",
        )
        require(
            self.max_anchors_per_batch > 0,
            "anchor_budget",
            "follow-wait starts at drafter.max_anchors_per_batch and never goes below it: set it > 0 (e.g. 2048)",
        )
        require(
            self.max_anchors_auto % self.anchor_chunk == 0,
            "max_anchors_auto",
            f"must be a multiple of drafter.anchor_chunk ({self.anchor_chunk}), or 0; got {self.max_anchors_auto}",
        )
        require(
            self.max_anchors_auto == 0 or self.max_anchors_auto >= self.max_anchors_per_batch,
            "max_anchors_auto",
            f"must be >= drafter.max_anchors_per_batch ({self.max_anchors_per_batch}), the start; got {self.max_anchors_auto}",
        )

    def resolved_max_anchors_auto(self) -> int:
        """follow-wait's cap: max_anchors_auto, or 8 x the start."""
        return self.max_anchors_auto or 8 * self.max_anchors_per_batch

    def resolved_layer_types(self) -> list[str]:
        if self.layer_types:
            return list(self.layer_types)
        return ["sliding_attention"] * (self.num_layers - 1) + ["full_attention"]
