"""drafter.init_from_target: the drafter starts from the target checkpoint's own layers (a real Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.drafter.model.build import build_drafter
from dflash_ipc.drafter.model.init_from_target import drafter_layer_shapes, nearest_plane, plan_init
from dflash_ipc.runtime.preflight import check_environment
from dflash_ipc.target_spec.heads import decoder_stack_shapes
from dflash_ipc.target_spec.hf_config import default_layer_ids

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
COPIED_PER_LAYER = (
    *(f"self_attn.{p}_proj" for p in "qkvo"),
    *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
    "input_layernorm",
    "post_attention_layernorm",
)


def _config(tiny_llama, **drafter):
    overrides = {"target.model_path": str(tiny_llama), "target.tokenizer": "builtin", "target.spec": {}}
    overrides.update({f"drafter.{k}": v for k, v in drafter.items()})
    return load_config(TINY, overrides)


def _target_state(tiny_llama) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    return {k.removeprefix("model."): v for k, v in LlamaForCausalLM.from_pretrained(tiny_llama).state_dict().items()}


def test_the_drafter_starts_as_copies_of_the_named_target_layers(tiny_llama):
    cfg = _config(tiny_llama, num_layers=2, init_from_target=[0, -1])
    model = build_drafter(cfg, "cpu")
    target = _target_state(tiny_llama)
    copied = dict(model.named_parameters())
    for d, t in ((0, 0), (1, 3)):
        for name in COPIED_PER_LAYER:
            assert torch.equal(copied[f"layers.{d}.{name}.weight"], target[f"layers.{t}.{name}.weight"]), (d, name)
        # Llama has no q/k norms: they keep the random start's ones
        assert torch.equal(copied[f"layers.{d}.self_attn.q_norm.weight"], torch.ones(16))
    assert torch.equal(model.norm.weight, target["norm.weight"])
    # fc: the identity on the plane nearest layer 0's input (the shallowest), zeros on the others
    planes = model.config.num_context_planes
    context = torch.randn(5, planes * 64)
    j = nearest_plane(model.config.target_layer_ids, 0)
    assert j == 0
    assert torch.equal(model.fc(context), context[:, j * 64 : (j + 1) * 64])
    random = build_drafter(_config(tiny_llama, num_layers=2), "cpu")
    assert not torch.equal(random.layers[0].self_attn.q_proj.weight, copied["layers.0.self_attn.q_proj.weight"])


def test_the_context_plane_is_the_one_nearest_the_first_copied_layers_input():
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2's 30 layers
    ids = [1, 8, 14, 20, 27]
    assert nearest_plane(ids, 0) == 0
    assert nearest_plane(ids, 25) == 4  # layer 24's output: 27 is 3 away, 20 is 4
    assert nearest_plane(ids, 9) == 1
    assert nearest_plane([1, 8, 14, 21, 27], 25) == 3  # 21 and 27 tie at 3: the shallower wins


def test_plans_that_cannot_copy_are_refused_with_what_to_change(tiny_llama):
    cfg = _config(tiny_llama, num_layers=2)
    shape = build_drafter(cfg, "cpu").config
    shapes = decoder_stack_shapes(tiny_llama)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64, 64) and shapes["norm.weight"] == (64,)
    plan = plan_init(shape, [1, 2], shapes)
    assert ("layers.1.mlp.down_proj.weight", "layers.2.mlp.down_proj.weight") in plan.copies
    assert len(plan.copies) == 2 * (len(drafter_layer_shapes(shape)) - 2) + 1
    with pytest.raises(ValueError, match=r"outside the target's 4 decoder layers"):
        plan_init(shape, [0, 4], shapes)
    with pytest.raises(ValueError, match="one per drafter layer"):
        plan_init(shape, [0], shapes)
    linear = {k: v for k, v in shapes.items() if not k.startswith("layers.2.self_attn")}
    with pytest.raises(ValueError, match=r"target layer 2 has no self_attn.q_proj.*\[0, 1, 3\]"):
        plan_init(shape, [0, 2], linear)
    gated = dict(shapes, **{"layers.1.self_attn.q_proj.weight": (128, 64)})
    with pytest.raises(ValueError, match=r"q_proj.weight is \[128, 64\].*gated q_proj"):
        plan_init(shape, [1, 3], gated)


def test_bad_plans_are_refused_before_any_process_starts(tiny_llama):
    with pytest.raises(ConfigError, match=r"drafter.init_from_target: must name one target layer per drafter layer"):
        _config(tiny_llama, num_layers=2, init_from_target=[0])
    with pytest.raises(ConfigError, match=r"drafter.init_from_target: .*outside the target's 4 decoder layers"):
        check_environment(_config(tiny_llama, num_layers=2, init_from_target=[0, 9]))
    with pytest.raises(ConfigError, match=r"drafter.init_from_target: .*heads, head size and MLP width"):
        check_environment(_config(tiny_llama, num_layers=2, init_from_target=[0, 1], intermediate_size=96))
    spec = load_config(TINY, {"drafter.num_layers": 2, "drafter.init_from_target": [0, 1]})
    with pytest.raises(ConfigError, match=r"drafter.init_from_target: copies the target's weights from target.model_path"):
        check_environment(spec)
    check_environment(_config(tiny_llama, num_layers=2, init_from_target=[2, 3]))


def test_a_qwen3_5_checkpoint_is_read_through_its_prefix_and_its_layers_are_refused(tmp_path):
    """The product's own target family (sharded, multimodal layout: model.language_model.*): its
    GatedDeltaNet layers have no softmax attention, and its full-attention q_proj is gated (twice as wide)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash_ipc.config import DrafterConfig
    from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig
    from dflash_ipc.target_spec.heads import read_decoder_stack
    from dflash_ipc.target_spec.hf_config import tiny_spec

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16)
    conf = Qwen3_5Config(text_config=tiny_spec(512), vision_config=vision)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(conf)
    model.save_pretrained(str(tmp_path), max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    shapes = decoder_stack_shapes(tmp_path)
    assert shapes["norm.weight"] == (64,) and not any(k.startswith(("visual", "model.")) for k in shapes)
    read = read_decoder_stack(tmp_path, ["norm.weight", "layers.2.self_attn.k_proj.weight"], "cpu", torch.float32)
    assert torch.equal(read["norm.weight"], model.model.language_model.norm.weight.detach())
    assert torch.equal(read["layers.2.self_attn.k_proj.weight"], model.model.language_model.layers[2].self_attn.k_proj.weight.detach())
    with pytest.raises(KeyError, match="no tensor 'layers.0.self_attn.q_proj.weight'"):
        read_decoder_stack(tmp_path, ["layers.0.self_attn.q_proj.weight"], "cpu", torch.float32)
    shape = DrafterModelConfig.from_configs(DrafterConfig(num_layers=2), conf, [1, 4], mask_token_id=5)
    with pytest.raises(ValueError, match=r"target layer 0 has no self_attn.q_proj .* can start from \[2, 5\]"):
        plan_init(shape, [0, 2], shapes)
    with pytest.raises(ValueError, match=r"q_proj.weight is \[128, 64\] but the drafter's self_attn.q_proj.weight is \[64, 64\]"):
        plan_init(shape, [2, 5], shapes)
