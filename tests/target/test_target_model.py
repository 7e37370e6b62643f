"""Target model: layer ids, specs, random/checkpoint builds, capture hooks, head weights, FLOPs."""

from __future__ import annotations

import gc
import json
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.fast_path import fast_path_report, impl_origin, resolve_impl
from dflash_ipc.target.flops import forward_flops, layer_matmul_params
from dflash_ipc.target.model import TargetModel, build_target
from dflash_ipc.target_spec.heads import target_head_weights
from dflash_ipc.target_spec.hf_config import (
    default_layer_ids,
    load_hf_config,
    make_hf_config,
    qwen36_27b_spec,
    resolve_layer_ids,
    text_config,
    tiny_spec,
)

VOCAB = 300


def _cfg(**kw) -> TargetConfig:
    kw.setdefault("spec", tiny_spec(VOCAB))
    return TargetConfig(**kw)


def _ids(b: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, L), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def full_target() -> TargetModel:
    # full stack (capture_last_hidden) so HF's own forward can serve as the reference
    return build_target(_cfg(layer_ids=[0, 1, 2, 3, 4], capture_last_hidden=True), "cpu")


# --------------------------------------------------------------------------- layer ids / specs


def test_default_layer_ids():
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64, 1) == [32]
    assert default_layer_ids(6, 3) == [1, 2, 3]
    for n, k in [(6, 5), (5, 5), (8, 4), (48, 5)]:
        ids = default_layer_ids(n, k)
        assert len(set(ids)) == k and all(0 <= i < n for i in ids), (n, k, ids)
    with pytest.raises(ValueError):
        default_layer_ids(4, 5)
    assert resolve_layer_ids(TargetConfig(), 64) == [1, 16, 31, 46, 61]
    with pytest.raises(ValueError, match="outside"):
        resolve_layer_ids(TargetConfig(layer_ids=[1, 64]), 64)


def test_27b_spec_shape():
    spec = qwen36_27b_spec()
    lt = spec["layer_types"]
    assert len(lt) == 64 and lt.count("linear_attention") == 48 and lt.count("full_attention") == 16
    assert all((t == "full_attention") == ((i + 1) % 4 == 0) for i, t in enumerate(lt))
    conf = make_hf_config(spec)  # config only, nothing allocated
    assert (conf.hidden_size, conf.num_hidden_layers, conf.vocab_size) == (5120, 64, 248320)
    assert (conf.num_attention_heads, conf.num_key_value_heads, conf.head_dim) == (24, 4, 256)
    assert (conf.linear_num_key_heads, conf.linear_num_value_heads, conf.linear_conv_kernel_dim) == (16, 48, 4)
    # the analytic count lands on a ~27B model (+ embedding and LM head)
    total = sum(layer_matmul_params(conf)) + 2 * 248320 * 5120
    assert 26e9 < total < 28.5e9, total
    assert len(qwen36_27b_spec(8)["layer_types"]) == 8


def test_tiny_spec_mixes_layer_types():
    lt = tiny_spec(VOCAB)["layer_types"]
    assert {"linear_attention", "full_attention"} == set(lt)
    assert make_hf_config(tiny_spec(VOCAB), vocab_size=123).vocab_size == 123


# --------------------------------------------------------------------------- builds


def test_truncated_build_allocates_only_needed_layers(full_target):
    t = build_target(_cfg(layer_ids=[1, 3]), "cpu")
    assert len(t.stack.layers) == 4 and t.num_layers_built == 4
    assert t.num_layers_total == 6 and t.hf_config.num_hidden_layers == 6 and t.layers_run == 4
    assert sum(p.numel() for p in t.stack.parameters()) < sum(p.numel() for p in full_target.stack.parameters())
    # per-parameter seeding: the truncated stack has exactly the full build's weights
    full = dict(full_target.stack.named_parameters())
    for name, p in t.stack.named_parameters():
        assert torch.equal(p, full[name]), name
    ids = _ids(2, 9)
    a = t.capture(ids)
    b = full_target.capture(ids)
    assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[3])
    assert not any(p.requires_grad for p in t.stack.parameters()) and not t.stack.training


def test_random_build_deterministic():
    a = build_target(_cfg(layer_ids=[1, 2], random_init_seed=7), "cpu")
    b = build_target(_cfg(layer_ids=[1, 2], random_init_seed=7), "cpu")
    c = build_target(_cfg(layer_ids=[1, 2], random_init_seed=8), "cpu")
    sa, sb, sc = a.stack.state_dict(), b.stack.state_dict(), c.stack.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.mlp.up_proj.weight"], sc["layers.0.mlp.up_proj.weight"])


def test_bfloat16_build():
    t = build_target(_cfg(layer_ids=[1], dtype="bfloat16"), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in t.stack.parameters())
    out = t.capture(_ids(1, 5))
    assert out[0].dtype == torch.bfloat16 and torch.isfinite(out[0].float()).all()


# --------------------------------------------------------------------------- capture


def test_capture_equals_decoder_layer_outputs(full_target):
    ids = _ids(2, 11, seed=1)
    out = full_target.capture(ids)
    assert len(out) == 6  # 5 layers + final normed hidden state
    with torch.inference_mode():
        ref = full_target.stack(input_ids=ids, output_hidden_states=True, use_cache=False)
    hs = ref.hidden_states  # [embeddings, out of layer 0, ..., (normed) out of the last layer]
    for j, li in enumerate(full_target.layer_ids):
        assert li < 5  # hidden_states[-1] is replaced by the normed state in HF
        torch.testing.assert_close(out[j], hs[li + 1], rtol=0, atol=0)
    torch.testing.assert_close(out[-1], ref.last_hidden_state, rtol=0, atol=0)
    without_last = full_target.capture(ids, capture_last_hidden=False)
    assert len(without_last) == 5


def test_right_padding_needs_no_mask(full_target):
    lens = [13, 5, 9, 1]
    L = max(lens)
    ids = _ids(len(lens), L, seed=2)
    ids[1, 5:] = 0  # arbitrary pad ids after the real tokens
    ids[2, 9:] = VOCAB - 1
    padded = full_target.capture(ids)
    for b, n in enumerate(lens):
        alone = full_target.capture(ids[b : b + 1, :n])
        for j in range(len(padded)):
            torch.testing.assert_close(padded[j][b, :n], alone[j][0], rtol=1e-5, atol=1e-5)


def test_forward_stops_after_last_captured_layer(full_target):
    calls = []
    handles = [
        full_target.stack.layers[5].register_forward_pre_hook(lambda m, a: calls.append("layer5")),
        full_target.stack.norm.register_forward_pre_hook(lambda m, a: calls.append("norm")),
    ]
    try:
        full_target.capture(_ids(1, 4), capture_last_hidden=False)  # last captured layer: 4
        assert calls == []
        full_target.capture(_ids(1, 4))
        assert calls == ["layer5", "norm"]
    finally:
        for h in handles:
            h.remove()


def test_hooks_hold_no_references(full_target):
    # (HF's own output-capturing hooks may be installed by an output_hidden_states call; ours must be gone)
    before = [dict(layer._forward_hooks) for layer in full_target.stack.layers]
    out = full_target.capture(_ids(1, 6))
    assert [dict(layer._forward_hooks) for layer in full_target.stack.layers] == before
    refs = [weakref.ref(t) for t in out]
    del out
    gc.collect()
    assert all(r() is None for r in refs)


# --------------------------------------------------------------------------- head weights


def test_target_head_weights_random_deterministic():
    cfg = _cfg(layer_ids=[1, 2], random_init_seed=11)
    t = build_target(cfg, "cpu")
    hf = load_hf_config(cfg, vocab_size=None)  # what a drafter process builds on its own
    e1, h1 = target_head_weights(cfg, hf, "cpu", torch.float32)
    e2, h2 = target_head_weights(cfg, hf, "cpu", torch.float32)
    assert e1.shape == (VOCAB, 64) and h1.shape == (VOCAB, 64)
    assert torch.equal(e1, e2) and torch.equal(h1, h2)
    assert torch.equal(t.stack.embed_tokens.weight, e1)  # the target's embedding == the drafter's
    assert not torch.equal(e1, h1)
    e3, _ = target_head_weights(_cfg(random_init_seed=12), hf, "cpu", torch.float32)
    assert not torch.equal(e1, e3)
    eb, _ = target_head_weights(cfg, hf, "cpu", torch.bfloat16)
    assert torch.equal(eb, e1.to(torch.bfloat16))
    tied = make_hf_config(dict(tiny_spec(VOCAB), tie_word_embeddings=True))
    et, ht = target_head_weights(cfg, tied, "cpu", torch.float32)
    assert ht is et


def _save_vlm_checkpoint(path, tie: bool):
    """A tiny checkpoint in the real Qwen3.5 layout (model.language_model.*, model.visual.*, lm_head)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vis = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16)
    conf = Qwen3_5Config(text_config=dict(tiny_spec(VOCAB), tie_word_embeddings=tie), vision_config=vis, tie_word_embeddings=tie)
    torch.manual_seed(3)
    m = Qwen3_5ForConditionalGeneration(conf).eval()
    m.save_pretrained(str(path), max_shard_size="200KB")  # sharded: exercises the index json
    return m


def test_checkpoint_build_and_head_weights(tmp_path):
    m = _save_vlm_checkpoint(tmp_path, tie=False)
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = TargetConfig(model_path=str(tmp_path), layer_ids=[1, 3])
    t = build_target(cfg, "cpu")
    assert len(t.stack.layers) == 4 and t.num_layers_total == 6  # unused layers dropped
    ids = _ids(2, 10, seed=4)
    out = t.capture(ids)
    with torch.inference_mode():
        ref = m.model.language_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    torch.testing.assert_close(out[0], ref[2], rtol=0, atol=0)
    torch.testing.assert_close(out[1], ref[4], rtol=0, atol=0)
    e, h = target_head_weights(cfg, load_hf_config(cfg), "cpu", torch.float32)
    assert torch.equal(e, m.model.language_model.embed_tokens.weight.detach())
    assert torch.equal(h, m.lm_head.weight.detach())
    assert torch.equal(t.stack.embed_tokens.weight, e)


def test_checkpoint_tied_head(tmp_path):
    _save_vlm_checkpoint(tmp_path, tie=True)
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in names
    cfg = TargetConfig(model_path=str(tmp_path))
    e, h = target_head_weights(cfg, load_hf_config(cfg), "cpu", torch.float32)
    assert h is e and e.shape == (VOCAB, 64)


# --------------------------------------------------------------------------- fast path / flops


def test_fast_path_report_cpu(full_target):
    rep = fast_path_report(full_target)
    assert rep["gated_delta_net_layers"] == full_target.hf_config.layer_types.count("linear_attention") == 4
    assert rep["fast_path"] is False and rep["fla"] is False and rep["causal_conv1d"] is False
    assert set(rep["origins"].values()) == {"torch"}


def test_fast_path_resolves_through_fallback_wrapper(monkeypatch):
    """transformers 5.x wraps the torch function; the report must see the package function."""
    hub = pytest.importorskip("transformers.integrations.hub_kernels")
    deco = getattr(hub, "use_kernel_func_from_hub_with_fallback", None)
    if deco is None:
        pytest.skip("this transformers has no use_kernel_func_from_hub_with_fallback")
    pkg = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    gdr = types.ModuleType("fla.ops.gated_delta_rule")

    def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
        return "fla"

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule"
    gdr.chunk_gated_delta_rule = chunk_gated_delta_rule
    pkg.ops, ops.gated_delta_rule = ops, gdr
    for name, mod in (("fla", pkg), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr)):
        monkeypatch.setitem(sys.modules, name, mod)

    def torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw):
        return "torch"

    wrapped = deco("chunk_gated_delta_rule", "fla")(torch_chunk_gated_delta_rule)
    impl = resolve_impl(wrapped)
    assert impl is chunk_gated_delta_rule and impl_origin(impl) == "fla"
    assert impl_origin(resolve_impl(deco("causal_conv1d_fn", "no_such_pkg_xyz")(torch_chunk_gated_delta_rule))) != "fla"


def test_layer_param_count_matches_modules(full_target):
    conf = full_target.hf_config
    counts = layer_matmul_params(conf)
    assert len(counts) == len(full_target.stack.layers)
    for i, layer in enumerate(full_target.stack.layers):
        n = sum(m.weight.numel() for m in layer.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
        assert n == counts[i], i


def test_forward_flops():
    conf = make_hf_config(tiny_spec(VOCAB))
    counts = layer_matmul_params(conf)
    assert conf.layer_types[0] == "linear_attention" and conf.layer_types[2] == "full_attention"
    lin, full = counts[0], counts[2]
    # layer 0 linear, layer 2 full; sequences of 10 and 3 tokens
    gdn = 6 * 4 * 16 * 16 * 13
    attn = 4 * 4 * 16 * (55 + 6)
    assert forward_flops(conf, [0], [10, 3]) == 2 * lin * 13 + gdn
    assert forward_flops(conf, [2], [10, 3]) == 2 * full * 13 + attn
    assert forward_flops(conf, 3, [10, 3]) == 2 * (2 * lin + full) * 13 + 2 * gdn + attn
    assert forward_flops(conf, 0, [10]) == 0


@pytest.mark.gpu
def test_cuda_bf16_build_capture_and_report():
    cfg = _cfg(layer_ids=[1, 3], dtype="bfloat16")
    t = build_target(cfg, "cuda")
    assert t.stack.embed_tokens.weight.device.type == "cuda" and len(t.stack.layers) == 4
    rep = fast_path_report(t)
    print("fast_path_report:", rep)
    assert rep["gated_delta_net_layers"] == 3 and isinstance(rep["fast_path"], bool)
    lens = [70, 9, 33]
    ids = _ids(3, 70, seed=5).cuda()
    padded = t.capture(ids)
    for b, n in enumerate(lens):
        alone = t.capture(ids[b : b + 1, :n])
        for j in range(2):
            torch.testing.assert_close(padded[j][b, :n].float(), alone[j][0].float(), rtol=2e-2, atol=2e-2)
    e_gpu, h_gpu = target_head_weights(cfg, t.hf_config, "cuda", torch.bfloat16)
    e_gpu2, h_gpu2 = target_head_weights(cfg, t.hf_config, "cuda", torch.bfloat16)
    # Drawn on the GPU: deterministic across calls/processes of one GPU model, and what the target holds.
    assert torch.equal(e_gpu, e_gpu2) and torch.equal(h_gpu, h_gpu2)
    assert torch.equal(t.stack.embed_tokens.weight, e_gpu)


def test_text_config_is_the_decoder_of_composite_configs():
    from transformers import PretrainedConfig, Qwen3_5Config

    flat = make_hf_config(tiny_spec(VOCAB))
    assert text_config(flat) is flat
    multimodal = Qwen3_5Config(text_config=flat.to_dict())
    assert text_config(multimodal) is multimodal.text_config and text_config(multimodal).hidden_size == 64
    both = PretrainedConfig()
    both.text_config = flat
    both.text_encoder = make_hf_config({**tiny_spec(VOCAB), "hidden_size": 32})
    with pytest.raises(ValueError, match="ambiguous"):
        both.get_text_config()  # what a caller without decoder=True would hit
    assert text_config(both) is flat
    # the head weights and FLOPs read the same decoder through it
    embed, head = target_head_weights(_cfg(), both, "cpu", torch.float32)
    assert embed.shape == head.shape == (VOCAB, 64)
    assert forward_flops(both, 3, [16]) == forward_flops(flat, 3, [16])
