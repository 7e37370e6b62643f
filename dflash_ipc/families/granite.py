"""Granite: the embeddings are multiplied by ``embedding_multiplier`` and the logits divided by
``logits_scaling`` around plain tables (the residual and attention multipliers stay inside the layers)."""

from __future__ import annotations

from dflash_ipc.families.base import DecoderFamily
from dflash_ipc.families.traits import FrozenHead


class Granite(DecoderFamily):
    model_types = ("granite", "granitemoe", "granitemoeshared")
    packed_checked = True

    def frozen_head(self) -> FrozenHead:
        return FrozenHead(
            embed_scale=float(getattr(self.config, "embedding_multiplier", 1.0)),
            logit_divisor=float(getattr(self.config, "logits_scaling", 1.0)),
            embed_scale_in_dtype=False,  # a Python float times the embeddings: the scale is not rounded first
        )
