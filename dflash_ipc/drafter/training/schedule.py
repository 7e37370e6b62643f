"""The drafter's learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

from dflash_ipc.config import TrainingConfig


def lr_at(step: int, cfg: TrainingConfig, total_steps: int) -> float:
    """Learning rate for optimizer step index ``step`` (0-based).

    Linear warmup over ``W`` steps (step 0 uses ``lr / W``), then cosine decay from ``lr`` to
    ``min_lr_ratio * lr`` at ``total_steps``; flat at the minimum afterwards. ``W`` is
    ``warmup_steps``, or ``warmup_fraction * total_steps`` (at least 1) when the fraction is set.
    """
    base = cfg.lr
    min_lr = cfg.min_lr_ratio * base
    warmup = cfg.resolved_warmup_steps(total_steps)
    if warmup > 0 and step < warmup:
        return base * (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / decay_steps))
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
