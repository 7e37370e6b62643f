"""``target.fuse_elementwise`` (target/fused.py): the norms and SwiGLU of a real tiny Qwen3.5 stack routed
through ``torch.compile``'d fused functions capture what the modules' own forwards capture, "auto"
fuses on CUDA only, and the target names what it fused."""

from __future__ import annotations

import pytest
import torch

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.fused import unfuse_elementwise, wants_fused_elementwise
from dflash_ipc.target.model import build_target
from dflash_ipc.target_spec.hf_config import tiny_spec


def test_auto_fuses_on_cuda_only_and_true_false_force_it():
    assert wants_fused_elementwise("auto", torch.device("cuda", 0))
    assert not wants_fused_elementwise("auto", torch.device("cpu"))
    assert wants_fused_elementwise(True, torch.device("cpu"))
    assert not wants_fused_elementwise(False, torch.device("cuda", 0))
    built = build_target(TargetConfig(spec=tiny_spec(300), layer_ids=[1], varlen=False), "cpu")
    assert built.fused_elementwise == {}  # "auto" on this CPU: the modules' own forwards


def test_fused_stack_captures_what_the_eager_stack_captures():
    """fp32, padded and packed: every zero-centered norm, gated norm and SwiGLU MLP of the stack is routed
    (6 layers: 2 attention with q/k norms, 4 GatedDeltaNet with a gated norm), and the captured planes equal
    the modules' own forwards' to fp32 rounding (the same formulas; inductor may order a reduction differently)."""
    cfg = TargetConfig(spec=tiny_spec(300), layer_ids=[1, 3, 5], varlen=True, fuse_elementwise=True)
    model = build_target(cfg, "cpu")
    n_layers = len(model.stack.layers)
    gdn = sum(1 for layer in model.stack.layers if hasattr(layer, "linear_attn"))
    # per layer its two norms, per attention layer its q/k norms, and the final norm
    assert model.fused_elementwise == {"norms": 2 * n_layers + 2 * (n_layers - gdn) + 1, "gated_norms": gdn, "mlps": n_layers}
    assert gdn == 4
    ids = torch.randint(0, 300, (2, 37), generator=torch.Generator().manual_seed(5))
    lens = [37, 20]
    fused_padded = model.capture(ids)
    fused_packed = model.capture_packed(torch.cat([ids[0], ids[1, :20]]), lens)
    unfuse_elementwise(model.stack)
    eager_padded = model.capture(ids)
    eager_packed = model.capture_packed(torch.cat([ids[0], ids[1, :20]]), lens)
    for got, want in [*zip(fused_padded, eager_padded), *zip(fused_packed, eager_packed)]:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the fused forwards were really in place: the stack's own modules no longer hold them
    assert all("forward" not in m.__dict__ for m in model.stack.modules())


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_the_moe_siblings_of_qwen3_5_fuse_as_it_does(name, tmp_path):
    """Qwen3.5-MoE and Qwen3-Next name their norms, gated norms and shared experts' SwiGLU MLPs after their own
    family (Qwen3_5MoeRMSNorm, Qwen3NextMLP, ...): each is routed as Qwen3.5's are, and the capture equals the
    modules' own forwards' (the routed experts stay transformers' own)."""
    from families.family_zoo import build_checkpoint

    checkpoint = build_checkpoint(name, tmp_path)
    cfg = TargetConfig(model_path=str(checkpoint), tokenizer="builtin", layer_ids=[1, 2, 3], varlen=False, fuse_elementwise=True)
    model = build_target(cfg, "cpu")
    layers = model.stack.layers
    gdn = sum(1 for layer in layers if hasattr(layer, "linear_attn"))
    shared = sum(1 for layer in layers if hasattr(layer.mlp, "shared_expert"))
    assert gdn == 2 and shared == len(layers) == 4
    assert model.fused_elementwise == {"norms": 2 * len(layers) + 2 * (len(layers) - gdn) + 1, "gated_norms": gdn, "mlps": shared}
    ids = torch.randint(0, 1000, (2, 23), generator=torch.Generator().manual_seed(3))
    fused = model.capture(ids)
    unfuse_elementwise(model.stack)
    for got, want in zip(fused, model.capture(ids)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_family_without_fused_kernels_stays_eager_and_says_so(tmp_path):
    """A Llama checkpoint (SmolLM2's family) has no module fused.py routes: with fusion forced on, the
    target reports nothing fused rather than "0 norms fused", and its modules keep their own forwards."""
    import transformers

    spec = tiny_spec(300)
    widths = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **{k: spec[k] for k in widths})).save_pretrained(tmp_path)
    model = build_target(TargetConfig(model_path=str(tmp_path), tokenizer="builtin", layer_ids=[1], fuse_elementwise=True), "cpu")
    assert model.fused_elementwise == {}
    assert all("forward" not in m.__dict__ for m in model.stack.modules())


@pytest.mark.parametrize("bad", ["yes", 2])
def test_a_bad_setting_is_refused_naming_the_key(bad, tmp_path):
    from conftest import tiny_cpu_config, write_toml

    from dflash_ipc.config import load_config

    path = write_toml(tmp_path / "bad.toml", tiny_cpu_config(target={"fuse_elementwise": bad}))
    with pytest.raises(Exception, match="fuse_elementwise") as info:
        load_config(path)
    assert "bad.toml" in str(info.value)
