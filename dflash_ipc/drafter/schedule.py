"""The drafter's learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

from dflash_ipc.config import TrainingConfig


def lr_at(step: int, cfg: TrainingConfig, total_steps: int) -> float:
    """Learning rate for optimizer step index ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (step 0 uses ``lr / warmup_steps``), then cosine decay
    from ``lr`` to ``min_lr_ratio * lr`` at ``total_steps``; flat at the minimum afterwards.
    """
    base = cfg.lr
    min_lr = cfg.min_lr_ratio * base
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / decay_steps))
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
