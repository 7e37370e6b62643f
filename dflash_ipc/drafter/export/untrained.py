"""The step-0 drafter in the export layout (``dflash-ipc export-untrained``): eval's untrained floor (τ ≈ 1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.drafter.export.layout import export_drafter
from dflash_ipc.drafter.model.build import build_drafter


def export_untrained(cfg: DFlashConfig, out_dir: Path, device: torch.device | str = "cpu") -> Path:
    """Export the drafter exactly as step 0 of `up` initialises it: eval's untrained floor (tau ~ 1).
    Over the whole vocabulary: an untrained head drafts nothing the target accepts either way, and the
    floor needs no run directory. Without FP8: the weights are the same, and the export needs no torchao."""
    drafter = dataclasses.replace(cfg.drafter, draft_vocab_size=0, fp8_linears="none")
    model = build_drafter(dataclasses.replace(cfg, drafter=drafter), device)
    return export_drafter(model, out_dir, chat_template_kwargs=cfg.chat_template.kwargs)
