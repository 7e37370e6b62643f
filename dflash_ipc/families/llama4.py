"""Llama 4 (text): chunked attention on its RoPE layers (``attention_chunk_size`` tokens from each
document's start), full attention on its NoPE layers, whose queries are scaled by their position
(``attn_temperature_tuning``); MoE layers every ``interleave_moe_layer_step`` with a shared expert, dense
MLPs of ``intermediate_size_mlp`` between them."""

from __future__ import annotations

import dataclasses

from dflash_ipc.families.base import DecoderFamily, first_int
from dflash_ipc.families.traits import AttentionLayer, ExpertLayout, TemperatureTuning


class Llama4(DecoderFamily):
    model_types = ("llama4_text", "llama4")
    packed_checked = True

    def uses_rope(self, layer: int) -> bool:
        return bool(self.config.no_rope_layers[layer])

    def attention_layer(self, layer: int) -> AttentionLayer:
        spec = super().attention_layer(layer)
        if getattr(self.config, "attn_temperature_tuning", False) and not self.uses_rope(layer):
            tuning = TemperatureTuning(float(self.config.floor_scale), float(self.config.attn_scale))
            spec = dataclasses.replace(spec, temperature_tuning=tuning)
        return spec

    def experts(self) -> ExpertLayout | None:
        n = first_int(self.config, "num_local_experts")
        if not n:
            return None
        width = int(self.config.intermediate_size)  # each expert's; the shared expert has the same width
        return ExpertLayout(n, first_int(self.config, "num_experts_per_tok") or 1, width, shared_intermediate=width)

    def mlp_width(self) -> int:
        return first_int(self.config, "intermediate_size_mlp") or super().mlp_width()
