"""Tiny random-weight checkpoints of every target family dflash-ipc trains drafters for, built in the test
from transformers' own config and model classes (no hub), over the project's built-in tokenizer.

Every model: hidden 64, 4 decoder layers, 4 query heads over 2 key/value heads, a vocabulary of the
built-in tokenizer's 1,024 ids. Sliding windows and attention chunks are :data:`WINDOW` tokens, shorter
than the test documents, so a path that ignores them differs. MoE models have 4 experts, 2 active (Llama 4: 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WINDOW = 8
#: Documents longer than WINDOW (and than two chunks), of unequal lengths.
DOC_LENGTHS = (21, 13, 9)

_COMMON = dict(
    vocab_size=1024,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)
_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_SLIDING_FULL = ["sliding_attention", "full_attention"] * 2
_MOE = dict(num_experts_per_tok=2)


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(intermediate_size=128, **_COMMON),
        "qwen2": lambda: T.Qwen2Config(intermediate_size=128, **_COMMON),
        "qwen3": lambda: T.Qwen3Config(intermediate_size=128, head_dim=16, **_COMMON),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, head_dim=16, **_MOE, **_COMMON
        ),
        "phi3": lambda: T.Phi3Config(intermediate_size=128, **_COMMON),
        "olmo2": lambda: T.Olmo2Config(intermediate_size=128, **_COMMON),
        "granite": lambda: T.GraniteConfig(
            intermediate_size=128,
            embedding_multiplier=12.0,
            logits_scaling=8.0,
            residual_multiplier=0.22,
            attention_multiplier=0.05,
            **_COMMON,
        ),
        "mistral": lambda: T.MistralConfig(intermediate_size=128, sliding_window=WINDOW, **_COMMON),
        "mixtral": lambda: T.MixtralConfig(intermediate_size=64, num_local_experts=4, sliding_window=WINDOW, **_MOE, **_COMMON),
        "gemma3": lambda: T.Gemma3TextConfig(
            intermediate_size=128, head_dim=16, sliding_window=WINDOW, layer_types=_SLIDING_FULL, final_logit_softcapping=30.0, **_COMMON
        ),
        "gemma2": lambda: T.Gemma2Config(
            intermediate_size=128, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_COMMON
        ),
        "gpt_oss": lambda: T.GptOssConfig(
            intermediate_size=64, num_local_experts=4, head_dim=16, sliding_window=WINDOW, layer_types=_SLIDING_FULL, **_MOE, **_COMMON
        ),
        "deepseek_v3": lambda: T.DeepseekV3Config(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            n_group=1,
            topk_group=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **_MOE,
            **{**_COMMON, "num_key_value_heads": 4},
        ),
        "glm4_moe": lambda: T.Glm4MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            head_dim=16,
            n_group=1,
            topk_group=1,
            **_MOE,
            **_COMMON,
        ),
        "llama4": lambda: T.Llama4TextConfig(
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_local_experts=4,
            num_experts_per_tok=1,
            head_dim=16,
            attention_chunk_size=WINDOW,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            floor_scale=4,
            attn_scale=0.5,
            **_COMMON,
        ),
        "qwen3_next": lambda: T.Qwen3NextConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"] * 2,
            **_HYBRID,
            **_MOE,
            **_COMMON,
        ),
        "qwen3_5": lambda: T.Qwen3_5TextConfig(
            intermediate_size=128, head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, **_HYBRID, **_COMMON
        ),
        "qwen3_5_moe": lambda: T.Qwen3_5MoeTextConfig(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"] * 2,
            **_HYBRID,
            **_MOE,
            **_COMMON,
        ),
        "gemma4": lambda: T.Gemma4TextConfig(
            intermediate_size=128,
            head_dim=16,
            global_head_dim=32,
            sliding_window=WINDOW,
            layer_types=_SLIDING_FULL,
            final_logit_softcapping=30.0,
            vocab_size_per_layer_input=1024,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=0,
            **_COMMON,
        ),
        "gemma3n": lambda: T.Gemma3nTextConfig(
            intermediate_size=128,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=_SLIDING_FULL,
            vocab_size_per_layer_input=1024,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=0,
            laurel_rank=4,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0] * 4,
            **_COMMON,
        ),
    }


FAMILIES: tuple[str, ...] = tuple(_configs())


def unknown_hybrid_config() -> Any:
    """A hybrid no family entry describes: LFM2, short-conv layers between full-attention ones."""
    from transformers import Lfm2Config

    return Lfm2Config(intermediate_size=128, layer_types=["conv", "full_attention"] * 2, **_COMMON)


def family_config(name: str) -> Any:
    """The transformers config of family ``name``."""
    return _configs()[name]()


def build_checkpoint(name: str, root: Path, seed: int = 0) -> Path:
    """``root/name``: a saved random-weight ``*ForCausalLM`` of family ``name`` with the built-in tokenizer
    beside its weights (so ``target.model_path`` alone names model and tokenizer). Built once per ``root``."""
    from transformers import AutoModelForCausalLM

    from dflash_ipc.data.tokenizer import build_builtin_tokenizer

    out = Path(root) / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name))
    model.save_pretrained(out)
    build_builtin_tokenizer().save_pretrained(out)
    return out


def model_type(path: Path) -> str:
    return str(json.loads((Path(path) / "config.json").read_text())["model_type"])


def _vision_wrapper_configs() -> dict[str, Callable[[], Any]]:
    import transformers as T

    return {
        "qwen3_5": lambda: T.Qwen3_5Config(
            text_config=family_config("qwen3_5").to_dict(),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4),
        ),
        "gemma3": lambda: T.Gemma3Config(
            text_config=family_config("gemma3").to_dict(),
            vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
            ),
            mm_tokens_per_image=4,
        ),
    }


VISION_WRAPPED: tuple[str, ...] = tuple(_vision_wrapper_configs())


def build_vision_wrapped_checkpoint(name: str, root: Path, seed: int = 0) -> Path:
    """``root/name-vl``: family ``name``'s text model inside its image-text ``*ForConditionalGeneration`` wrapper
    (a one-layer vision tower), as multimodal checkpoints ship, with the built-in tokenizer beside it."""
    from transformers import AutoModelForImageTextToText

    from dflash_ipc.data.tokenizer import build_builtin_tokenizer

    out = Path(root) / f"{name}-vl"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(_vision_wrapper_configs()[name]()).save_pretrained(out)
    build_builtin_tokenizer().save_pretrained(out)
    return out
