"""FLOPs of the target forward (for MFU), for any decoder family, from its transformers config.

Counted from the model transformers builds for the config, on the meta device (no memory, no weights: a
fraction of a second, once per target), so every family is counted from its own modules rather than
from a formula per family. A multiply-add is 2 FLOPs; forward only; no embedding lookup, final norm or
LM head:

* **weights**: every decoder layer, 2 x its matmul weights x tokens. A matmul weight is a parameter of
  two or more dimensions that is not a bias: each ``nn.Linear``'s weight, the routers' weights, the
  routed experts' 3-D tensors, a depthwise conv's kernel (kernel-size multiply-adds per channel and
  token). The routed experts (the module transformers names ``experts``) count at active / num_experts
  of their weights: the work each token's routing asks for, whatever the kernel runs (transformers'
  Llama 4 multiplies every expert by every token, most of them by a zero weight). Routers and shared
  experts count whole.
* **attention**: per layer, QK^T over the (query, key) pairs its mask lets through at
  2 x heads x the query/key head size per pair, and PV at 2 x heads x the value head size per pair
  (they differ under DeepSeek's latent attention). Per document of L tokens: L(L+1)/2 causal pairs; a
  sliding window of w keys caps each query at w of them; chunked attention restarts at every chunk
  boundary; bidirectional attention sees every pair (within a window: ``|q - k| <= w``, transformers'
  rule). :func:`attention_pairs` mirrors transformers' mask functions (``tests/target/test_flops.py`` holds
  them equal).
* **GatedDeltaNet**: the state recurrence, ``6 * d_k * d_v`` per value head per token (state
  decay/read-out/update of the recurrent form; chunked kernels do the same order).

Pass the lengths the forward computed per document: the padded forward computes its padding too (its
padded lengths are the work run, the real ones the useful work).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from torch import nn

from dflash_ipc.families import AttentionLayer, family_of
from dflash_ipc.families.traits import EXPERTS_MODULE
from dflash_ipc.target_spec.hf_config import text_config

__all__ = ["ForwardFlops", "attention_pairs", "forward_flops", "layer_matmul_params"]

log = logging.getLogger(__name__)


def attention_pairs(spec: AttentionLayer, length: int) -> int:
    """(query, key) pairs ``spec``'s mask lets through in one document of ``length`` tokens."""
    n = int(length)
    if spec.kind == "linear":
        return 0
    if not spec.causal:
        if spec.kind == "sliding" and spec.window:
            reach = min(int(spec.window), n - 1)  # keys on each side within the window
            return n + 2 * (reach * n - reach * (reach + 1) // 2)
        return n * n
    if spec.kind == "sliding" and spec.window:
        w = int(spec.window)
        return n * (n + 1) // 2 if n <= w else w * (w + 1) // 2 + (n - w) * w
    if spec.kind == "chunked" and spec.chunk:
        c = int(spec.chunk)
        whole, rest = divmod(n, c)
        return whole * c * (c + 1) // 2 + rest * (rest + 1) // 2
    return n * (n + 1) // 2


def _meta_decoder_layers(hf_config: Any) -> nn.ModuleList:
    """The decoder layers transformers builds for ``hf_config``'s text decoder, on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config(hf_config), attn_implementation="eager")
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"{type(model).__name__} has no decoder layers (an nn.ModuleList named 'layers')")


def _is_matmul_weight(name: str, param: nn.Parameter) -> bool:
    return param.dim() >= 2 and not name.rpartition(".")[2].endswith("bias")


def layer_matmul_params(hf_config: Any) -> list[int]:
    """Per decoder layer, the matmul weights a token multiplies by (module docstring): a dense layer's every
    linear and conv weight; an MoE layer's router and shared experts whole and its routed experts at
    active / num_experts."""
    family = family_of(hf_config)
    experts = family.experts()
    counts = []
    for index, layer in enumerate(_meta_decoder_layers(hf_config)):
        total = 0
        for name, param in layer.named_parameters():
            if not _is_matmul_weight(name, param):
                continue
            if EXPERTS_MODULE not in name.split(".")[:-1]:
                total += param.numel()
                continue
            if experts is None:
                raise ValueError(f"{family.name}: layer {index} has routed experts ({name}) but the config names no expert counts")
            if param.numel() % experts.num_experts:
                raise ValueError(f"{family.name}: {name} of {tuple(param.shape)} is not {experts.num_experts} experts' weights")
            total += param.numel() // experts.num_experts * experts.active
        counts.append(total)
    return counts


class ForwardFlops:
    """The FLOP count of one target config's forward (module docstring), its per-layer parts counted once.

    A layer whose token mixer the family does not know (a Mamba or conv layer of a hybrid without a family entry)
    counts its matmul weights alone, said once in the log: its mixing work is not in the figure."""

    def __init__(self, hf_config: Any):
        tc = text_config(hf_config)
        self.family = family_of(hf_config)
        self.weights = layer_matmul_params(hf_config)
        self.layers: list[AttentionLayer | None] = []
        unknown: dict[str, None] = {}
        for i in range(len(self.weights)):
            try:
                self.layers.append(self.family.attention_layer(i))
            except ValueError as e:
                self.layers.append(None)
                unknown.setdefault(str(e), None)
        # GatedDeltaNet (transformers' "linear_attention" layers): per token, the state update
        names = ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        self.recurrence = math.prod(int(getattr(tc, name, 0) or 0) for name in names) * 6
        if self.recurrence == 0 and any(spec is not None and spec.kind == "linear" for spec in self.layers):
            unknown.setdefault(f"{self.family.name}: linear-attention layers without GatedDeltaNet's widths", None)
        if unknown:
            log.warning("target FLOPs count these layers' matmul weights only (their mixing is left out): %s", "; ".join(unknown))

    def __call__(self, layers_run: int | Iterable[int], seq_lens: Iterable[int]) -> float:
        """FLOPs of one forward over documents of ``seq_lens`` tokens through ``layers_run`` decoder layers (an
        int N: layers 0..N-1, or the layer indices)."""
        lens = [int(n) for n in seq_lens]
        tokens = sum(lens)
        indices = range(int(layers_run)) if isinstance(layers_run, int) else [int(i) for i in layers_run]
        pairs_of: dict[AttentionLayer, int] = {}
        total = 0
        for i in indices:
            spec = self.layers[i]
            total += 2 * self.weights[i] * tokens
            if spec is None:
                continue
            if spec.kind == "linear":
                total += self.recurrence * tokens
                continue
            if spec not in pairs_of:
                pairs_of[spec] = sum(attention_pairs(spec, n) for n in lens)
            total += 2 * spec.num_heads * (spec.qk_head_dim + spec.v_head_dim) * pairs_of[spec]
        return float(total)


def forward_flops(hf_config: Any, layers_run: int | Iterable[int], seq_lens: Iterable[int]) -> float:
    """:class:`ForwardFlops` of ``hf_config`` for one forward (counts the layers anew: hold a ``ForwardFlops``
    to count many forwards)."""
    return ForwardFlops(hf_config)(layers_run, seq_lens)
