"""The target's capture forward per family at real shapes, random weights: padded against packed.

``dflash-ipc bench family-forward --shapes gpt-oss-20b,qwen3.6-35b-a3b,gemma-3-27b,llama-3.1-8b``

Each shape is a published model's transformers config (:data:`SHAPES`) built on the device with random
weights (``AutoModelForCausalLM.from_config``; no checkpoint is read), its decoder stack wrapped as the
training target wraps it (:class:`~dflash_ipc.target.model.TargetModel`, ``target.varlen = true`` so both
forwards run on one model), capturing the DFlash default spread of 5 layers. On the same batches of
documents of mixed lengths (a fixed seed; lengths drawn from ``--lengths``), both variants get one untimed
pass over every batch, then one timed pass:

* ``padded``: the documents right-padded into one [B, L] batch (what the target runs where it cannot pack);
* ``packed``: the real tokens in one row (:mod:`~dflash_ipc.target.varlen`, the family's packed attention).

Reported per shape: real tokens/s of each, the ratio, MFU (:meth:`TargetModel.forward_flops` of the real
lengths, MoE counted by active experts, over ``--peak-tflops``), peak memory, and the agreement of the
packed capture with the padded one (relative error per captured layer, over real tokens). A family whose
packed kernel cannot be exact is refused by the target builder: the row says why and times padded only.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from dflash_ipc.bench.target_forward import agreement, run_one
from dflash_ipc.config import TargetConfig
from dflash_ipc.families import family_of
from dflash_ipc.target.model import TargetModel, find_decoder_stack, target_from_stack
from dflash_ipc.target_spec.hf_config import default_layer_ids

__all__ = ["SHAPES", "measure_shape", "shape_config"]


def _gpt_oss_20b() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072,
    )


def _qwen36_35b_a3b() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
    )


def _gemma3_27b() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=262208,
        hidden_size=5376,
        intermediate_size=21504,
        num_hidden_layers=62,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168,
        sliding_window=1024,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(62)],
        max_position_embeddings=131072,
    )


def _llama31_8b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )


#: Published models' shapes, by name: what the families' GPU figures are measured at.
SHAPES: dict[str, Callable[[], Any]] = {
    "gpt-oss-20b": _gpt_oss_20b,
    "qwen3.6-35b-a3b": _qwen36_35b_a3b,
    "gemma-3-27b": _gemma3_27b,
    "llama-3.1-8b": _llama31_8b,
}


def shape_config(name: str) -> Any:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    return SHAPES[name]()


def _batches(vocab: int, lengths: tuple[int, int], batch_tokens: int, n_batches: int, seed: int) -> list[tuple[torch.Tensor, list[int]]]:
    """``n_batches`` batches of documents of lengths uniform in ``lengths`` summing to about ``batch_tokens``, right-padded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_batches):
        lens: list[int] = []
        while sum(lens) < batch_tokens:
            lens.append(rng.randint(*lengths))
        ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
        for i, n in enumerate(lens):
            ids[i, :n] = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed + i))
        out.append((ids, lens))
    return out


def _real_planes(planes: list[torch.Tensor], variant: str, lens: list[int]) -> list[torch.Tensor]:
    """The real tokens of each captured plane as [1, n, H] (padded planes are [B, L, H])."""
    if variant == "packed":
        return [p.float() for p in planes]
    return [torch.cat([p[i, :n] for i, n in enumerate(lens)]).unsqueeze(0).float() for p in planes]


def _time(model: TargetModel, variant: str, batches, peak_tflops: float) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
    planes = [_real_planes(run_one(model, variant, ids, lens), variant, lens) for ids, lens in batches[:1]]  # untimed, kept for agreement
    for ids, lens in batches[1:]:
        run_one(model, variant, ids, lens)
    torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    for ids, lens in batches:
        run_one(model, variant, ids, lens)
    torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - t0
    real = sum(sum(lens) for _, lens in batches)
    flops = sum(model.forward_flops(lens) for _, lens in batches)
    row = {
        "variant": variant,
        "seconds": round(seconds, 4),
        "real_tokens": real,
        "tokens_per_s": round(real / seconds, 1),
        "mfu_real": round(flops / seconds / 1e12 / peak_tflops, 4),
    }
    return row, planes


def measure_shape(
    name: str,
    device: str = "cuda:0",
    *,
    lengths: tuple[int, int] = (256, 4096),
    batch_tokens: int = 16384,
    batches: int = 4,
    peak_tflops: float = 790.0,
) -> dict[str, Any]:
    """One shape: build it (random bf16 weights on ``device``), padded and packed, as the module docstring says."""
    from transformers import AutoModelForCausalLM

    hf_config = shape_config(name)
    attention = family_of(hf_config).attention_implementation("auto")
    torch.zeros(1, device=device)  # the caching allocator exists once the process touched the device
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation=attention)
    stack = find_decoder_stack(lm)
    del lm
    n_layers = len(stack.layers)
    cfg = TargetConfig(model_path="", dtype="bfloat16", layer_ids=default_layer_ids(n_layers), varlen=True, attn_implementation="auto")
    row: dict[str, Any] = {"shape": name, "model_type": hf_config.model_type, "layers": n_layers}
    try:
        model = target_from_stack(cfg, stack, hf_config, device)
    except ValueError as e:  # the family's packed kernel cannot be exact: padded only
        row["packed_refused"] = str(e)
        model = target_from_stack(dataclasses.replace(cfg, varlen=False), stack, hf_config, device)
    row["build_s"] = round(time.perf_counter() - t0, 1)
    row["forward"] = model.varlen_reason
    data = _batches(int(hf_config.vocab_size), lengths, batch_tokens, batches, seed=7)
    padded, padded_planes = _time(model, "padded", data, peak_tflops)
    row["padded"] = padded
    if model.varlen:
        packed, packed_planes = _time(model, "packed", data, peak_tflops)
        row["packed"] = packed
        row["packed_over_padded"] = round(packed["tokens_per_s"] / padded["tokens_per_s"], 3)
        row["packed_vs_padded"] = agreement(padded_planes, packed_planes, model.layer_ids)
    row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    del model, stack
    gc.collect()
    torch.cuda.empty_cache()
    return row
