"""Qwen3.5 / Qwen3.6 hybrids (dense and MoE) and Qwen3-Next: GatedDeltaNet linear-attention layers between
gated full-attention ones, zero-centered RMSNorms (``x * (1 + w)``), SwiGLU MLPs (the dense ones and the MoE
layers' shared expert): the modules :mod:`~dflash_ipc.target.fused` fuses."""

from __future__ import annotations

from dflash_ipc.families.base import DecoderFamily
from dflash_ipc.families.traits import FusibleModules


class Qwen3_5(DecoderFamily):
    model_types = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
    packed_checked = True
    #: The class-name stem of each model type's modules (Qwen3_5RMSNorm, Qwen3_5MoeRMSNorm, Qwen3NextRMSNorm, ...).
    CLASS_STEMS = {
        "qwen3_5_text": "Qwen3_5",
        "qwen3_5": "Qwen3_5",
        "qwen3_5_moe_text": "Qwen3_5Moe",
        "qwen3_5_moe": "Qwen3_5Moe",
        "qwen3_next": "Qwen3Next",
    }

    def fusible(self) -> FusibleModules:
        stem = self.CLASS_STEMS[self.model_type]
        return FusibleModules(
            zero_centered_norms=frozenset({f"{stem}RMSNorm"}),
            gated_norms=frozenset({f"{stem}RMSNormGated"}),
            swiglu_mlps=frozenset({f"{stem}MLP"}),
        )
