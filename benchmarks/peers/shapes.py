"""Target shapes shared by the peer benches and the dflash-ipc configs (random weights only), and the
document-length distributions both trainers read.

smollm2     : SmolLM2-135M (LlamaForCausalLM, hidden 576, 30 layers, 9/3 heads, FFN 1536, vocab 49152, tied head)
qwen3-8b    : Qwen3-8B     (Qwen3ForCausalLM, hidden 4096, 36 layers, 32/8 heads of 128, FFN 12288, vocab 151936)
qwen3.6-27b : Qwen3.6-27B  (Qwen3_5ForCausalLM, the Qwen3.5 hybrid: hidden 5120, FFN 17408, 24 q / 4 kv heads x 256,
              GatedDeltaNet 16 key / 48 value heads x 128, conv 4, vocab 248,320, every 4th layer full attention),
              as a **16-layer slice** (12 GatedDeltaNet + 4 full attention, the first 16 of its 64 layers) with 4 x 2048
              tokens per step: SpecForge's trainer keeps the target, a 1.8 B-parameter drafter with bf16 + fp32
              optimizer state, a second copy of the 248k x 5120 embedding and head, and whole-vocabulary logits on
              one GPU; with all 64 layers (54 GB of weights) its step does not fit one H200 at 2,048 anchors.
              ``qwen3.6-27b-full`` is the whole 64-layer stack (dflash-ipc alone, or a larger GPU).
tiny-llama / tiny-qwen3 / tiny-qwen3.5: CPU smoke shapes.

Drafter settings per shape mirror what dflash-ipc runs at that size (configs/smollm2-x2.toml and
smollm2-1gpu-synth.toml for SmolLM2; configs/bench-9b-x2.toml / h200-1gpu.toml for the 8B class; the same
block 16 / gamma 7 at 27B): 5 layers, 4 sliding (window 2048) + 1 full, lr 6e-4.

Lengths (:func:`doc_lengths`): ``fixed`` (every document ``seq_len`` tokens) or ``mixed``: a log-normal of
median ``MIXED_MEDIAN`` tokens and sigma ``MIXED_SIGMA``, cut to [``MIXED_MIN``, ``seq_len``]. The median is
the project's own gen-data output at SmolLM2 (12,526 training samples, 4.09 M tokens: 327 tokens per
sample; answers 240-293 new tokens at max-new 320, docs/EVAL.md); the spread is a stand-in that sends
~3 % of documents to the 2,048 cut, as answers of a larger generation cap would (not measured).
"""

from __future__ import annotations

import math
import random

MIXED_MEDIAN = 300
MIXED_SIGMA = 1.0
MIXED_MIN = 16

_QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False,
)  # fmt: skip

SHAPES = {
    "smollm2": dict(
        arch="llama",
        config=dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        drafter=dict(block_size=8, gamma=4.0, batch=16),  # 16 x 2048 = 32,768 tokens/step (smollm2-x2 token_budget)
    ),  # fmt: skip
    "qwen3-8b": dict(
        arch="qwen3",
        config=_QWEN3_8B,
        drafter=dict(block_size=16, gamma=7.0, batch=8),  # 8 x 2048 = 16,384 tokens/step (bench-9b-x2 token_budget)
    ),
    # config: the arguments of dflash_ipc.target_spec.hf_config.qwen36_27b_spec (the product's own 27B spec)
    "qwen3.6-27b": dict(arch="qwen3_5", config=dict(num_layers=16), drafter=dict(block_size=16, gamma=7.0, batch=4)),
    "qwen3.6-27b-full": dict(arch="qwen3_5", config=dict(num_layers=64), drafter=dict(block_size=16, gamma=7.0, batch=4)),
    "tiny-llama": dict(
        arch="llama",
        config=dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
        drafter=dict(block_size=8, gamma=4.0, batch=2),
    ),  # fmt: skip
    "tiny-qwen3": dict(
        arch="qwen3",
        config=dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        drafter=dict(block_size=16, gamma=7.0, batch=2),
    ),  # fmt: skip
    # config: dflash_ipc.target_spec.hf_config.tiny_spec's arguments (6 layers: linear, linear, full x 2)
    "tiny-qwen3.5": dict(arch="qwen3_5", config=dict(tiny=True, vocab_size=2048), drafter=dict(block_size=16, gamma=7.0, batch=2)),
}

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}


def qwen3_5_spec(shape: str) -> dict:
    """The dflash-ipc ``target.spec`` of a ``qwen3_5`` shape (the dflash-ipc side builds it itself, random)."""
    from dflash_ipc.target_spec.hf_config import qwen36_27b_spec, tiny_spec

    c = SHAPES[shape]["config"]
    return tiny_spec(c["vocab_size"]) if c.get("tiny") else qwen36_27b_spec(c["num_layers"])


def hf_config(shape: str):
    """The target's transformers config (LlamaConfig / Qwen3Config / Qwen3_5TextConfig) for a shape name."""
    from transformers import LlamaConfig, Qwen3_5TextConfig, Qwen3Config

    s = SHAPES[shape]
    if s["arch"] == "qwen3_5":
        cfg = Qwen3_5TextConfig(**qwen3_5_spec(shape))
    else:
        cfg = (LlamaConfig if s["arch"] == "llama" else Qwen3Config)(**s["config"])
    cfg.architectures = [ARCHITECTURES[s["arch"]]]
    return cfg


def specforge_draft_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    rms_norm_eps: float,
    rope_theta: float,
    max_position_embeddings: int,
    layer_types: list[str],
    sliding_window: int,
    block_size: int,
    num_target_layers: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    attention: str,
    initializer_range: float | None = None,
):
    """SpecForge's ``DFlashDraftModel`` config (a ``Qwen3Config`` with DFlash's fields): one builder for both
    benches, the speed bench (from the target's config) and the tau bench (from dflash-ipc's drafter shape)."""
    from transformers import Qwen3Config

    sliding = "sliding_attention" in layer_types
    extra = {} if initializer_range is None else {"initializer_range": initializer_range}
    dcfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        layer_types=list(layer_types),
        use_sliding_window=sliding,
        sliding_window=sliding_window if sliding else None,
        max_window_layers=num_layers,
        **extra,
    )
    dcfg.architectures = ["DFlashDraftModel"]
    dcfg.block_size = block_size
    dcfg.num_target_layers = num_target_layers
    dcfg.dflash_config = {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id}
    dcfg._attn_implementation = attention
    return dcfg


def vocab_size(shape: str) -> int:
    s = SHAPES[shape]
    return int(qwen3_5_spec(shape)["vocab_size"]) if s["arch"] == "qwen3_5" else int(s["config"]["vocab_size"])


def default_layer_ids(num_layers: int, k: int = 5) -> list[int]:
    """DFlash's spread (SpecForge build_target_layer_ids = dflash-ipc default_layer_ids)."""
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def doc_lengths(n: int, seq_len: int, lengths: str = "fixed", seed: int = 0) -> list[int]:
    """``n`` document lengths: all ``seq_len`` (``fixed``), or the ``mixed`` log-normal (module docstring)."""
    if lengths == "fixed":
        return [seq_len] * n
    if lengths != "mixed":
        raise ValueError(f"lengths must be 'fixed' or 'mixed', got {lengths!r}")
    rng = random.Random(seed)
    mu = math.log(MIXED_MEDIAN)
    return [max(MIXED_MIN, min(seq_len, int(rng.lognormvariate(mu, MIXED_SIGMA)))) for _ in range(n)]
