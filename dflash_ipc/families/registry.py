"""Which family module describes a target, by its transformers ``model_type``: one row per family.

Families whose modeling follows transformers' shared conventions need no module of their own: their row
names :class:`CheckedDecoder`, the generic reader with the packed forward checked for them by the family
matrix (tests/families). A model type with no row gets the generic :class:`~dflash_ipc.families.base.DecoderFamily`
(padded forward only). ``tests/families/test_registry.py`` fails when a row has no family-matrix entry.
"""

from __future__ import annotations

from typing import Any

from dflash_ipc.families.base import DecoderFamily
from dflash_ipc.families.deepseek import DeepseekV3
from dflash_ipc.families.gemma import Gemma3, Gemma4
from dflash_ipc.families.gemma3n import Gemma3n
from dflash_ipc.families.gpt_oss import GptOss
from dflash_ipc.families.granite import Granite
from dflash_ipc.families.llama4 import Llama4
from dflash_ipc.families.qwen3_5 import Qwen3_5
from dflash_ipc.target_spec.hf_config import text_config

__all__ = ["FAMILIES", "CheckedDecoder", "family_of"]


class CheckedDecoder(DecoderFamily):
    """A family read by the generic rules alone, its packed forward checked by the family matrix."""

    packed_checked = True


#: model_type -> family class. Dense and MoE decoders that follow the shared conventions map to CheckedDecoder.
FAMILIES: dict[str, type[DecoderFamily]] = {
    "llama": CheckedDecoder,
    "mistral": CheckedDecoder,
    "mixtral": CheckedDecoder,
    "qwen2": CheckedDecoder,
    "qwen3": CheckedDecoder,
    "qwen3_moe": CheckedDecoder,
    "phi3": CheckedDecoder,
    "olmo2": CheckedDecoder,
    "glm4_moe": CheckedDecoder,
    **{t: family for family in (DeepseekV3, Gemma3, Gemma3n, Gemma4, GptOss, Granite, Llama4, Qwen3_5) for t in family.model_types},
}


def family_of(hf_config: Any) -> DecoderFamily:
    """The family reader of a transformers config (composite configs: their text decoder's)."""
    model_type = str(getattr(text_config(hf_config), "model_type", "") or "")
    return FAMILIES.get(model_type, DecoderFamily)(hf_config)
