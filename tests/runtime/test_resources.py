"""The memory estimate of the preflight (runtime/resources.py) against the real models it estimates."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CPU

from dflash_ipc.config import ConfigError, config_from_dict, load_config
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.runtime import resources
from dflash_ipc.runtime.preflight import check_memory
from dflash_ipc.target.model import build_target
from dflash_ipc.target_spec.hf_config import default_layer_ids, make_hf_config, truncated_spec_config


def shapes(cfg):
    hf = make_hf_config(cfg.target.spec, 1024)
    ids = default_layer_ids(int(hf.num_hidden_layers), cfg.target.num_capture_layers)
    return hf, ids, DrafterModelConfig.from_configs(cfg.drafter, hf, ids, 5)


@pytest.mark.parametrize("patch", [{}, {"num_layers": 3, "layer_types": [], "intermediate_size": 96, "num_key_value_heads": 4}])
def test_drafter_parameter_count_is_the_models(patch):
    raw = load_config(TINY_CPU).to_dict()
    raw["drafter"].update(patch)
    cfg = config_from_dict(raw)
    _, _, shape = shapes(cfg)
    heads = torch.zeros(shape.vocab_size, shape.hidden_size)
    model = DFlashDrafter(shape, heads, heads.clone(), attention="sdpa")
    assert resources.drafter_trainable_params(shape) == sum(p.numel() for p in model.trainable_parameters())


def test_target_weights_are_the_built_models():
    cfg = load_config(TINY_CPU)
    hf, ids, _ = shapes(cfg)
    target = build_target(cfg.target, "cpu", vocab_size=1024)
    built = sum(p.numel() for p in target.stack.parameters())
    assert resources.target_weight_params(cfg.target, hf, target.num_layers_built) == built


@pytest.mark.parametrize("config", ["tiny-cpu", "bench-9b-x2", "h200-x8-5t3d"])
@pytest.mark.parametrize("patch", [{}, {"attention_bias": True, "head_dim": 48}])
def test_stack_parameter_count_is_the_models_on_meta(config, patch):
    """The count the probe makes without transformers' modeling module, against the stack built on
    the meta device: every layer, and the first layers only (a target built up to its last capture layer)."""
    from transformers import Qwen3_5TextModel

    cfg = load_config(TINY_CPU.parent / f"{config}.toml")
    hf = make_hf_config({**cfg.target.spec, **patch}, 1024)
    n = int(hf.num_hidden_layers)
    for n_build in sorted({n, max(1, n // 2) + 1}):
        conf = hf if n_build == n else truncated_spec_config(hf, n_build)
        with torch.device("meta"):
            stack = Qwen3_5TextModel._from_config(conf)
        assert resources.target_weight_params(cfg.target, hf, n_build) == sum(p.numel() for p in stack.parameters()), n_build


def test_checkpoint_params_from_safetensors_headers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    model.save_pretrained(tmp_path)
    assert resources.checkpoint_params(tmp_path) == sum(p.numel() for p in model.state_dict().values())


def test_a_quantized_checkpoint_is_sized_by_what_it_stores_and_float_tensors_by_the_target_dtype(tmp_path):
    """Float tensors load in ``target.dtype`` (transformers casts them); FP8 weights and MXFP4's packed bytes
    (two 4-bit values per byte) with their scales stay as stored or dequantize into more: their stored bytes
    are the least the target holds. A sharded checkpoint is read through its index."""
    import json

    from safetensors.torch import save_file

    norm, experts, packed, scales = torch.ones(64), torch.zeros(4, 32, 64), torch.zeros(4, 32, 2, 16), torch.zeros(4, 32, 2)
    save_file({"norm.weight": norm.to(torch.float32), "experts.gate_up_proj": experts.to(torch.float8_e4m3fn)}, tmp_path / "a.safetensors")
    save_file(
        {"experts.down_proj_blocks": packed.to(torch.uint8), "experts.down_proj_scales": scales.to(torch.uint8)}, tmp_path / "b.safetensors"
    )
    names = {"norm.weight": "a", "experts.gate_up_proj": "a", "experts.down_proj_blocks": "b", "experts.down_proj_scales": "b"}
    index = {"weight_map": {key: f"{shard}.safetensors" for key, shard in names.items()}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    stored = experts.numel() + packed.numel() + scales.numel()
    assert resources.checkpoint_weight_bytes(tmp_path, 2) == 2 * norm.numel() + stored
    assert resources.checkpoint_weight_bytes(tmp_path, 4) == 4 * norm.numel() + stored
    assert resources.checkpoint_params(tmp_path) == norm.numel() + stored


@pytest.mark.gpu
def test_gpu_memory_measured_on_cuda_0():
    """On a GPU: the tiny stack on cuda:0 fits the measured free memory; a drafter of 10^6 layers does not."""
    raw = load_config(TINY_CPU).to_dict()
    raw["topology"] = {"targets": ["cuda:0"], "drafters": ["cuda:0"], "dist_backend": "auto"}
    raw["transport"]["backend"] = "cuda-ipc"
    cfg = config_from_dict(raw, "gpu.toml")
    hf, ids, shape = shapes(cfg)
    free = resources.measure_available(cfg).cuda[0]
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    check_memory(cfg, hf, ids, shape)
    raw["drafter"].update(num_layers=1_000_000, layer_types=[])
    big = config_from_dict(raw, "gpu.toml")
    hf, ids, shape = shapes(big)
    with pytest.raises(ConfigError, match=r"^gpu\.toml: drafter\.num_layers: cuda:0 would hold at least .* but has .* free"):
        check_memory(big, hf, ids, shape)


def test_the_fp8_head_copies_count_in_the_drafters_memory():
    """``training.ce_fp8``: the drafter's estimate grows by the head's two e4m3 copies (one byte per element each)."""
    plain = load_config(TINY_CPU)
    raw = plain.to_dict()
    raw["training"]["ce_fp8"] = True
    hf, ids, shape = shapes(plain)

    def drafter_bytes(cfg) -> dict[str, int]:
        return {n.what: n.nbytes for n in resources.estimate(cfg, hf, ids, shape, "cpu-shm") if n.what.startswith("drafter-")}

    before, after = drafter_bytes(plain), drafter_bytes(config_from_dict(raw))
    assert before and before.keys() == after.keys()
    assert all(after[k] - before[k] == 2 * shape.vocab_size * shape.hidden_size for k in before)
