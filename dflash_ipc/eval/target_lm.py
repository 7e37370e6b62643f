"""The target as a causal LM for decoding: logits and the captured features, on a KV cache.

:func:`build_target_lm` gives the same weights the training target runs (a checkpoint loaded
whole, LM head included; or the random spec stack of :func:`~dflash_ipc.target.model.build_target`
with its regenerated LM head), wrapped in the transformers ``*ForCausalLM`` class so batched
``generate`` (gen-data) works too. :class:`TargetLM` runs one forward on a cache and returns the
greedy token after every position and the concatenated outputs of the captured decoder
layers (layer-major, as the drafter's ``fc`` expects them).

Rolling a cache back by ``r`` tokens (:attr:`TargetLM.rollback`), the policy of the export's own decoder
(:func:`~dflash_ipc.drafter.export.hf_modeling.rollback_cache`): the cache is transformers' ``DynamicCache`` for
the model's config with each sliding-window or chunked attention layer (Mistral, Mixtral, Gemma 3/3n/4,
gpt-oss, Llama 4) replaced by a layer that keeps every token, as a full-attention layer does; the masks
transformers builds from the config still apply the window or the chunks, over the whole length.
transformers' own sliding layers keep only the last ``window - 1`` tokens and refuse ``crop`` once the
window is full; a layer that keeps every token crops exactly. Where every layer is such a layer, or holds
nothing (Gemma 3n's and Gemma 4's KV-shared layers read an earlier layer's keys within one forward), the
cache crops (``"crop"``). A layer with recurrent state (Qwen3.5's and Qwen3-Next's GatedDeltaNet) cannot
forget tokens, nor can a layer of a kind not known to crop exactly, so the caller snapshots such a cache
before a verification and re-runs the kept prefix from the snapshot (``"recompute"``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import logging
from typing import Any

import torch
from torch import nn

from dflash_ipc.config import TargetConfig
from dflash_ipc.families import family_of
from dflash_ipc.platform.devices import dtype_from_name

log = logging.getLogger(__name__)

__all__ = ["TargetLM", "build_target_lm"]


def build_target_lm(cfg: TargetConfig, device, vocab_size: int | None = None, dtype: str | None = None) -> nn.Module:
    """The full causal LM of the target on ``device`` in ``dtype`` (default: ``cfg.dtype``)."""
    from dflash_ipc.target.model import build_target
    from dflash_ipc.target_spec.heads import target_head_weights
    from dflash_ipc.target_spec.hf_config import load_hf_config

    device = torch.device(device)
    # the attention kernel the training target runs: the one asked for, where the family has it
    attention = family_of(load_hf_config(cfg, vocab_size)).attention_implementation(cfg.attn_implementation)
    # eval forwards a few tokens at a time on a cache: compiling fused kernels per worker would cost more than it saves
    cfg = dataclasses.replace(
        cfg, dtype=dtype or cfg.dtype, capture_last_hidden=True, fuse_elementwise=False, attn_implementation=attention
    )
    torch_dtype = dtype_from_name(cfg.dtype)
    if cfg.model_path:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attention}
        if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
            kwargs["device_map"] = {"": str(device) if device.index is not None else f"{device.type}:0"}
        lm = AutoModelForCausalLM.from_pretrained(cfg.model_path, **kwargs).to(device)
        if cfg.quantization == "fp8":  # the decoder's linears; the LM head stays in the target's dtype
            from dflash_ipc.target.model import apply_fp8, find_decoder_stack

            apply_fp8(find_decoder_stack(lm), device, torch_dtype, compile_quantizer=False)
    else:
        from transformers import Qwen3_5ForCausalLM

        target = build_target(cfg, device, vocab_size=vocab_size)
        _, head = target_head_weights(cfg, target.hf_config, device, torch_dtype)
        conf = copy.deepcopy(target.hf_config)
        with torch.device("meta"):
            lm = Qwen3_5ForCausalLM(conf)
        lm.model = target.stack
        lm.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False, device=device, dtype=torch_dtype)
        with torch.no_grad():
            lm.lm_head.weight.copy_(head)
    lm.config.use_cache = True
    lm.eval()
    lm.requires_grad_(False)
    return lm


class TargetLM:
    """Forwards on a cache that return greedy tokens and captured features. Call :meth:`close`."""

    def __init__(self, lm: nn.Module, layer_ids: list[int]):
        from dflash_ipc.drafter.export.hf_modeling import crops_exactly
        from dflash_ipc.target.model import find_decoder_stack

        self.lm = lm
        self.layer_ids = list(layer_ids)
        self.device = next(lm.parameters()).device
        self.family = family_of(lm.config)
        layers = find_decoder_stack(lm).layers
        bad = [i for i in self.layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"drafter's target_layer_ids {bad} outside the target's {len(layers)} decoder layers")
        self._captured: dict[int, torch.Tensor] = {}
        self._capture = False
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]
        self.rollback = "crop" if crops_exactly(self.new_cache()) else "recompute"
        # transformers 5.x renames ``past_key_values`` to ``cache`` (the old name warns)
        self._cache_kw = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            if self._capture:
                # the hidden state the next layer reads (Gemma 3n's layers return all their AltUp streams)
                self._captured[layer_id] = self.family.captured(output)

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_cache(self):
        from dflash_ipc.drafter.export.hf_modeling import rollback_cache

        return rollback_cache(self.lm.config)

    @torch.no_grad()
    def forward(self, ids: list[int], cache, capture: bool = True) -> tuple[list[int], torch.Tensor | None]:
        """Feed ``ids`` after what ``cache`` holds; returns (greedy token after each position,
        features ``[len(ids), k*H]`` or None)."""
        logits, feats = self.forward_logits(ids, cache, capture)
        return logits.float().argmax(-1).tolist(), feats

    @torch.no_grad()
    def forward_logits(self, ids: list[int], cache, capture: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`forward`, with the logits ``[len(ids), V]`` (the model's dtype) instead of the greedy tokens."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        self._capture = capture
        self._captured.clear()
        try:
            out = self.lm(input_ids=x, use_cache=True, **{self._cache_kw: cache})
        finally:
            self._capture = False
        feats = None
        if capture:
            feats = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)
        self._captured.clear()
        return out.logits[0], feats

    def roll_back(self, cache, snapshot, kept_ids: list[int], removed: int):
        """The cache holding only ``kept_ids`` of the last forward: cropped, or ``snapshot`` + a re-run."""
        if removed == 0:
            return cache
        if self.rollback == "crop":
            cache.crop(-removed)
            return cache
        self.forward(kept_ids, snapshot, capture=False)
        return snapshot
