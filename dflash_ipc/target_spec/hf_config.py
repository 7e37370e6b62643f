"""The target's transformers config: model specs, building and loading the config, the text
sub-config, and which decoder layers are captured.

Shared by the target (which builds the model from it) and every drafter (which mirrors its
shape and reads its frozen heads), so both derive the same numbers from the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dflash_ipc.config import TargetConfig

# --------------------------------------------------------------------------- layer ids


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """DFlash's default spread: ``k`` layer ids evenly from layer 1 to layer ``L - 3``.

    Matches DFlash's ``build_target_layer_ids`` (64 layers -> [1, 16, 31, 46, 61]; one layer ->
    the middle one). For stacks too shallow to give ``k`` distinct ids in [1, L-3] the spread
    widens to [0, L-1].
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    if num_layers < k:
        raise ValueError(f"cannot capture {k} distinct layers from a {num_layers}-layer target; lower num_capture_layers")
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    ids = [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    if end > start and len(set(ids)) == k and all(0 <= i < num_layers for i in ids):
        return ids
    span = num_layers - 1
    return [int(math.floor(i * span / (k - 1) + 0.5)) for i in range(k)]


def resolve_layer_ids(cfg: TargetConfig, num_layers: int) -> list[int]:
    """``cfg.layer_ids`` if set (validated against the stack depth), else the default spread."""
    ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(num_layers, cfg.num_capture_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target.layer_ids {bad} outside the target's {num_layers} decoder layers (0..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target.layer_ids must be distinct (got {ids})")
    return ids


# --------------------------------------------------------------------------- specs


def _layer_types(num_layers: int, full_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(num_layers)]


def tiny_spec(vocab_size: int = 512) -> dict[str, Any]:
    """A tiny Qwen3.5-style stack for CPU tests: hidden 64, 6 layers (linear, linear, full) x 2."""
    return {
        "vocab_size": int(vocab_size),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "layer_types": _layer_types(6, 3),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }


def qwen36_27b_spec(num_layers: int = 64) -> dict[str, Any]:
    """Qwen3.6-27B-class text stack: 64 layers = 48 GatedDeltaNet + 16 full attention (every 4th)."""
    return {
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": int(num_layers),
        "layer_types": _layer_types(int(num_layers), 4),
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }


def smollm2_135m_config(num_layers: int = 30):
    """SmolLM2-135M's shapes as a ``LlamaConfig`` (tied heads; weights are the caller's): benchmarks
    at its shapes on a machine without the checkpoint."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=int(num_layers),
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


# --------------------------------------------------------------------------- configs


def text_config(hf_config: Any) -> Any:
    """The text decoder's config inside a possibly composite (multimodal) config.

    ``get_text_config(decoder=True)``: the decoder side (what the target runs and the drafter
    mirrors). Without ``decoder=True`` transformers also considers a ``text_encoder`` sub-config
    and refuses configs that carry both as ambiguous. Objects without ``get_text_config`` (plain
    namespaces) give their ``text_config`` attribute, else themselves.
    """
    get = getattr(hf_config, "get_text_config", None)
    if callable(get):
        return get(decoder=True)
    return getattr(hf_config, "text_config", None) or hf_config


def rope_theta(hf_config: Any) -> float:
    """Rope theta of a transformers config (5.x keeps it in ``rope_parameters``, possibly per layer type)."""
    rp = getattr(hf_config, "rope_parameters", None)
    if isinstance(rp, Mapping):
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
        for key in ("full_attention", *rp.keys()):
            sub = rp.get(key)
            if isinstance(sub, Mapping) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    theta = getattr(hf_config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    return 10000.0


def make_hf_config(spec: dict[str, Any], vocab_size: int | None = None, attn_implementation: str | None = None):
    """A ``Qwen3_5TextConfig`` from a spec dict (vocab_size overrides the spec's)."""
    from transformers import Qwen3_5TextConfig

    spec = dict(spec) if spec else tiny_spec(vocab_size or 512)
    if vocab_size is not None:
        spec["vocab_size"] = int(vocab_size)
    spec.setdefault("use_cache", False)
    conf = Qwen3_5TextConfig(**spec)
    if attn_implementation not in (None, "auto"):  # "auto": the target's builder chooses (families.DecoderFamily.attention_implementation)
        conf._attn_implementation = attn_implementation
    return conf


def load_hf_config(cfg: TargetConfig, vocab_size: int | None = None):
    """The target's HF config, built the same way in the target and in every drafter."""
    if cfg.model_path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(cfg.model_path)
    return make_hf_config(cfg.spec, vocab_size, cfg.attn_implementation)


def target_vocab_size(cfg: TargetConfig, tokenizer_size: int) -> int:
    """The target's vocabulary: its checkpoint's, or a random spec's, which takes the tokenizer's size."""
    return int(text_config(load_hf_config(cfg, vocab_size=tokenizer_size)).vocab_size)


def truncated_spec_config(hf_config: Any, num_layers: int):
    """A copy of a Qwen3_5TextConfig with only the first ``num_layers`` layers."""
    d = hf_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype"):
        d.pop(key, None)
    d["num_hidden_layers"] = num_layers
    if d.get("layer_types"):
        d["layer_types"] = list(d["layer_types"])[:num_layers]
    conf = type(hf_config)(**d)
    conf._attn_implementation = getattr(hf_config, "_attn_implementation", None)
    return conf
