"""gpt-oss: alternating sliding-window and full attention, each with a learned per-head sink logit that
joins every softmax's denominator (``s_aux``); MoE experts in every layer; no sdpa in transformers (eager
or flash/flex only: :meth:`~dflash_ipc.families.base.DecoderFamily.attention_implementations` reads that
from the model class)."""

from __future__ import annotations

import dataclasses

from dflash_ipc.families.base import DecoderFamily
from dflash_ipc.families.traits import AttentionLayer


class GptOss(DecoderFamily):
    model_types = ("gpt_oss",)
    packed_checked = True

    def attention_layer(self, layer: int) -> AttentionLayer:
        return dataclasses.replace(super().attention_layer(layer), sinks=True)
