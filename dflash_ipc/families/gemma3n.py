"""Gemma 3n (text): Gemma 3's attention and scaled embeddings, around AltUp: every decoder layer carries
``altup_num_inputs`` streams of the hidden state (returned stacked, ``[streams, batch, tokens, hidden]``)
and computes on the active one (``altup_active_idx``); the captured hidden state is that stream."""

from __future__ import annotations

from typing import Any

from dflash_ipc.families.gemma import Gemma3


class Gemma3n(Gemma3):
    model_types = ("gemma3n_text", "gemma3n")

    def captured(self, layer_output: Any) -> Any:
        streams = super().captured(layer_output)
        return streams[int(getattr(self.config, "altup_active_idx", 0))]
