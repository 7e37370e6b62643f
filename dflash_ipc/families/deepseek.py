"""DeepSeek-V3 layouts (DeepSeek-V3/R1, Kimi-K2): multi-head latent attention, whose query/key heads
(``qk_nope_head_dim + qk_rope_head_dim``) are wider than its value heads (``v_head_dim``); routed experts
plus shared ones after ``first_k_dense_replace`` dense layers."""

from __future__ import annotations

from dflash_ipc.families.base import DecoderFamily


class DeepseekV3(DecoderFamily):
    model_types = ("deepseek_v3", "deepseek_v2", "kimi_k2")
    packed_checked = True

    def head_dims(self, layer: int) -> tuple[int, int]:
        qk = int(self.config.qk_nope_head_dim) + int(self.config.qk_rope_head_dim)
        return qk, int(self.config.v_head_dim)
