"""``[training]``: the drafter's optimizer, schedule, loss, checkpoints and held-out measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dflash_ipc.config.fields import require

__all__ = ["TrainingConfig"]


@dataclass
class TrainingConfig:
    lr: float = 6e-4
    """Peak learning rate of AdamW (cosine schedule after the warm-up)."""
    min_lr_ratio: float = 0.1
    """The cosine ends at ``lr`` times this, in [0, 1]."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    warmup_fraction: float = 0.0
    """> 0: warm up over this share of the schedule's steps instead of ``warmup_steps`` (SpecForge: ~0.04)."""
    max_steps: int = 0
    """Optimizer steps to train; 0: until the data (``data.num_epochs``) is exhausted. ``up --max-steps`` overrides it."""
    weight_decay: float = 0.01
    """AdamW weight decay, on matrices only (norms and biases: none), in [0, 1); SpecForge uses 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas, two numbers in [0, 1); SpecForge uses [0.9, 0.999]."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0: no clipping."""
    loss_gamma: float = 7.0
    """"decay" weighting: slot s >= 1 of a block weighs exp(-(s-1)/loss_gamma)."""
    loss_weighting: Literal["decay", "dpace"] = "decay"
    """Per-slot loss weights: "decay" (fixed, ``loss_gamma``) or "dpace" (D-PACE, arXiv 2605.18810: from the
    drafter's own confidence)."""
    dpace_alpha: float = 0.5
    """D-PACE smoothing q~ = (1 - alpha) q + alpha of the confidence q, in (0, 1]; 1: fixed weights."""
    dpace_normalizer: Literal["blocks", "weights"] = "blocks"
    """D-PACE: divide the loss by the number of blocks or by the sum of the weights."""
    ce_chunk_tokens: int = 2048
    """Tokens per chunk of the cross-entropy over the vocabulary (memory follows the chunk), >= 16."""
    ce_compile: bool = False
    """torch.compile each CE chunk's fp32 passes (cast, logsumexp, softmax grad) into fused kernels."""
    ce_fp8: bool = False
    """The frozen LM head's two GEMMs in the CE (logits, and the gradient to the drafter's hidden state) in FP8
    (e4m3, row-wise scales; two e4m3 copies of the head, 2 x vocab x hidden bytes). Needs CUDA devices of compute
    capability >= 8.9 (the CPU runs it slowly); the KL term's target distribution and held-out passes stay bf16."""
    kl_weight: float = 0.0
    """Weight of a KL term against the target's distribution (needs ``target.capture_last_hidden`` and
    ``drafter.draft_vocab_size = 0``); 0: cross-entropy only."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps; 0: only at the end and on shutdown."""
    keep_checkpoints: int = 2
    """Checkpoints kept in ``RUN_DIR/checkpoints``; older ones are removed."""
    export_on_finish: bool = True
    """Export the trained drafter (``RUN_DIR/export/drafter``) when training ends."""
    checkpoint_on_finish: bool = True
    """Write a checkpoint when training ends (benchmarks turn it off: at large shapes it is many GB)."""
    holdout_every: int = 0
    """About every N steps a pass over ``data.holdout_paths`` measures tau_holdout; 0: off."""
    holdout_batches: int = 4
    """Batches per held-out pass; 0: all of them."""
    holdout_max_new: int = 0
    """tau_holdout simulates eval's decode over the first N tokens of each held-out answer: set it to eval's
    ``--max-new``; 0: whole answers."""
    max_seconds: float = 0.0
    """Training time budget: the schedule's length is planned from the measured pace so the cosine ends as the seconds
    run out; ``max_steps``, when set, caps it. 0: no budget."""
    max_consecutive_skipped_updates: int = 20
    """This many optimizer updates in a row skipped for a non-finite loss or gradient end the run (exit 1, no
    export): the weights stopped moving. 0: never stop."""

    def __post_init__(self) -> None:
        require(
            self.max_consecutive_skipped_updates >= 0,
            "max_consecutive_skipped_updates",
            f"must be >= 0 (got {self.max_consecutive_skipped_updates}); e.g. 20, or 0 to never stop on skipped updates",
        )
        for key in ("holdout_every", "holdout_batches"):
            require(getattr(self, key) >= 0, key, "must be >= 0 (0: off / every held-out batch in a pass)")
        require(self.holdout_max_new >= 0, "holdout_max_new", "must be >= 0 (eval's --max-new, or 0 for whole answers)")
        require(self.max_seconds >= 0 and math.isfinite(self.max_seconds), "max_seconds", "must be >= 0 seconds (0: no time budget)")
        require(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a positive number")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(
            0 <= self.warmup_fraction < 1,
            "warmup_fraction",
            f"must be in [0, 1) (got {self.warmup_fraction}); e.g. 0.04 warms up over 4% of the steps, 0 uses training.warmup_steps",
        )
        require(self.max_steps >= 0, "max_steps", "must be >= 0 (0 = until the data is exhausted)")
        require(
            0 <= self.weight_decay < 1 and math.isfinite(self.weight_decay),
            "weight_decay",
            f"must be in [0, 1) (got {self.weight_decay}); AdamW multiplies it by the learning rate, 0 disables it",
        )
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"must be two numbers in [0, 1), e.g. [0.9, 0.95] (got {self.betas})",
        )
        require(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        require(self.loss_gamma > 0, "loss_gamma", "must be > 0")
        require(0 < self.dpace_alpha <= 1, "dpace_alpha", f"must be in (0, 1] (got {self.dpace_alpha}); 0.5 is the paper's")
        require(self.ce_chunk_tokens >= 16, "ce_chunk_tokens", "must be >= 16")
        require(self.kl_weight >= 0, "kl_weight", "must be >= 0")
        require(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")

    def resolved_warmup_steps(self, total_steps: int) -> int:
        """Warm-up length for a schedule of ``total_steps``: warmup_fraction of it (at least 1) if set."""
        if self.warmup_fraction > 0:
            return max(1, round(self.warmup_fraction * total_steps))
        return self.warmup_steps
