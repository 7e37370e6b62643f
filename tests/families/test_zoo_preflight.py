"""Every family of the zoo passes the preflight and builds a drafter: the drafter's default widths are what the
family reads from the target (its attention shape where layers differ, an MoE's active experts' width where the
config has no dense one), the memory estimate holds the loaded model's every weight (every expert), and the
target's FLOP count reads its layers."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_cpu_config
from families.family_zoo import FAMILIES, build_checkpoint, unknown_hybrid_config

from dflash_ipc.config import config_from_dict
from dflash_ipc.drafter.model.build import build_drafter
from dflash_ipc.families import family_of
from dflash_ipc.runtime import resources
from dflash_ipc.runtime.preflight import check_machine
from dflash_ipc.target.flops import ForwardFlops
from dflash_ipc.target_spec.hf_config import load_hf_config


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _config(checkpoint):
    raw = tiny_cpu_config(
        target={"model_path": str(checkpoint), "tokenizer": str(checkpoint), "num_capture_layers": 2},
        drafter={"num_layers": 1, "layer_types": [], "block_size": 4},
    )
    del raw["target"]["spec"]
    return config_from_dict(raw, "zoo.toml")


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_passes_the_preflight_and_builds_a_drafter_of_its_widths(zoo, name):
    from transformers import AutoModelForCausalLM

    checkpoint = build_checkpoint(name, zoo)
    cfg = _config(checkpoint)
    check_machine(cfg)  # shapes, heads, memory: raises a ConfigError naming the key otherwise
    hf_config = load_hf_config(cfg.target)
    family = family_of(hf_config)
    drafter = build_drafter(cfg, "cpu", log_mask_token=False)
    heads, kv_heads, head_dim = family.attention_shape()
    shape = drafter.config
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (heads, kv_heads, head_dim)
    assert shape.intermediate_size == family.mlp_width() > 0
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    every_tensor = sum(t.numel() for t in loaded.state_dict().values())  # persistent buffers too (DeepSeek's score bias)
    assert resources.target_weight_bytes(cfg.target, hf_config, int(hf_config.num_hidden_layers)) == 4 * every_tensor
    count = ForwardFlops(hf_config)
    assert len(count.weights) == len(loaded.model.layers) and min(count.weights) > 0
    if family.experts() is not None:  # a token runs its active experts only; preflight sized every expert
        assert sum(count.weights) < sum(p.numel() for p in loaded.model.layers.parameters() if p.dim() >= 2)


def test_a_hybrid_no_family_knows_passes_on_its_attention_layers(tmp_path):
    """LFM2 (no family entry, conv layers between attention ones): the preflight and the drafter's widths read its
    attention layers and pass over the conv ones, which no family describes."""
    from transformers import AutoModelForCausalLM

    from dflash_ipc.data.tokenizer import build_builtin_tokenizer

    config = unknown_hybrid_config()
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_builtin_tokenizer().save_pretrained(tmp_path)
    cfg = _config(tmp_path)
    check_machine(cfg)
    family = family_of(config)
    assert [i for i, _ in family.known_attention_layers()] == [1, 3]
    assert family.attention_shape() == (4, 2, 16)
    assert build_drafter(cfg, "cpu", log_mask_token=False).config.num_key_value_heads == 2
