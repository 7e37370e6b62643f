"""Gemma 3 and Gemma 4 (text): sliding-window and full attention layers, embeddings scaled by
``sqrt(hidden_size)`` (the scale cast to the hidden states' dtype first, as the scaled embedding module
does), the final logits soft-capped where the config says so; Gemma 4's full-attention layers may have
wider heads than its sliding ones (``global_head_dim``, or transformers' per-layer config)."""

from __future__ import annotations

import dataclasses
import math

from dflash_ipc.families.base import DecoderFamily, first_int
from dflash_ipc.families.traits import FrozenHead


class Gemma3(DecoderFamily):
    model_types = ("gemma3_text", "gemma3", "gemma2")
    packed_checked = True

    def frozen_head(self) -> FrozenHead:
        # the generic reader's final-logit soft-cap, with Gemma's scaled embeddings
        return dataclasses.replace(super().frozen_head(), embed_scale=math.sqrt(int(self.config.hidden_size)))


class Gemma4(Gemma3):
    model_types = ("gemma4_text", "gemma4")

    def head_dims(self, layer: int) -> tuple[int, int]:
        per_layer = getattr(self.config, "per_layer_config", None)
        if per_layer:
            hd = int(per_layer[layer].head_dim)
        elif self.layer_types()[layer] == "full_attention" and first_int(self.config, "global_head_dim"):
            hd = first_int(self.config, "global_head_dim")
        else:
            hd = int(self.config.head_dim)
        return hd, hd
