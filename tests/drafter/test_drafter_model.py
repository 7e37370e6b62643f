"""DFlashDrafter: config resolution, frozen target tensors, attention backends, export layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5TextConfig

from dflash_ipc.config import DrafterConfig
from dflash_ipc.drafter.export.layout import export_drafter, load_exported_drafter
from dflash_ipc.drafter.loss import blocks as B
from dflash_ipc.drafter.loss import masks as M
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig, resolve_attention_backend

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H, V = 64, 300


def target_config(**kw):
    base = dict(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        num_hidden_layers=8,
        intermediate_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    )
    base.update(kw)
    return Qwen3_5TextConfig(**base)


def make_model(layer_types=None, *, block_size=4, window=6, attention="sdpa", seed=0, k=3):
    torch.manual_seed(seed)
    n_layers = len(layer_types) if layer_types else 2
    dc = DrafterConfig(num_layers=n_layers, layer_types=layer_types or [], block_size=block_size, sliding_window=window, num_anchors=8)
    cfg = DrafterModelConfig.from_configs(dc, target_config(), list(range(1, 1 + 2 * k, 2)), V - 1)
    g = torch.Generator().manual_seed(seed + 100)
    emb = torch.randn(V, H, generator=g) * 0.5
    head = torch.randn(V, H, generator=g) * 0.1
    return DFlashDrafter(cfg, emb, head, attention=attention), dc


def batch(seq_lens, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(seq.sum())
    planes = torch.randn(k, n, H, generator=g)
    tokens = torch.randint(0, V - 1, (n,), generator=g)
    return seq, n, planes, tokens


def run(model, seq, planes, tokens, anchors, *, backend="sdpa", block_valid=None, tile=128, block_ids=None):
    n = planes.shape[1]
    doc = B.document_index(seq, n)
    anchors = torch.as_tensor(anchors, dtype=torch.int64)
    layout = B.build_block_layout(seq, anchors, doc.doc_of_token[anchors], model.config.block_size, block_valid, n=n)
    masks = M.build_attention_masks(layout, model.config.layer_types, model.config.sliding_window, backend, tile)
    ids = block_ids if block_ids is not None else model.block_input_ids(tokens[anchors])
    return model(L.concat_context(planes), layout.context_position_ids, ids, layout.block_position_ids, masks)


# --------------------------------------------------------------------------- config


def test_from_configs_reads_the_decoder_of_a_composite_target_config():
    # A multimodal target (Qwen3.5 with a vision tower) nests its decoder under text_config; a
    # config that also names a text encoder is ambiguous to get_text_config() and must still
    # resolve to the decoder (the one the target runs and whose heads the drafter shares).
    from transformers import PretrainedConfig, Qwen3_5Config

    multimodal = Qwen3_5Config(text_config=target_config().to_dict())
    with_encoder = PretrainedConfig()
    with_encoder.text_config = target_config()
    with_encoder.text_encoder = target_config(hidden_size=32, intermediate_size=48)
    flat = DrafterModelConfig.from_configs(DrafterConfig(), target_config(), [1, 2, 3, 4, 5], 7)
    for composite in (multimodal, with_encoder):
        cfg = DrafterModelConfig.from_configs(DrafterConfig(), composite, [1, 2, 3, 4, 5], 7)
        assert cfg == flat


def test_from_configs_resolves_zeros_from_target():
    dc = DrafterConfig()  # 5 layers, zeros everywhere
    cfg = DrafterModelConfig.from_configs(dc, target_config(), [1, 2, 3, 4, 5], 7)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads) == (64, 128, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 16, V)
    assert cfg.rope_theta == 1_000_000.0  # from rope_parameters (transformers 5.x)
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"]
    assert cfg.sliding_window == 2048 and cfg.block_size == 16
    assert cfg.num_context_planes == 5 and cfg.mask_token_id == 7 and cfg.num_target_layers == 8
    over = DrafterConfig(intermediate_size=96, num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    cfg2 = DrafterModelConfig.from_configs(over, target_config(), [2], 0)
    assert (cfg2.intermediate_size, cfg2.num_attention_heads, cfg2.num_key_value_heads, cfg2.head_dim) == (96, 8, 8, 8)


def test_from_configs_rejects_hidden_mismatch_and_bad_mask_token():
    with pytest.raises(ValueError, match="hidden_size"):
        DrafterModelConfig.from_configs(DrafterConfig(hidden_size=32), target_config(), [1], 0)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterModelConfig.from_configs(DrafterConfig(), target_config(), [1], V)


def test_attention_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "blockwise"
    assert resolve_attention_backend("sdpa", "cpu") == "sdpa"
    assert resolve_attention_backend("auto", "cuda:0") == "flex"
    assert resolve_attention_backend("flex", "cpu") == "flex"
    with pytest.raises(ValueError):
        resolve_attention_backend("eager", "cpu")


# --------------------------------------------------------------------------- parameters


def test_frozen_target_tensors_and_state_dict():
    model, _ = make_model()
    assert not model.embed_weight.requires_grad and not model.lm_head_weight.requires_grad
    sd = model.state_dict()
    assert "embed_weight" not in sd and "lm_head_weight" not in sd
    trainable = {id(p) for p in model.trainable_parameters()}
    assert id(model.embed_weight) not in trainable and id(model.lm_head_weight) not in trainable
    assert model.fc.weight.shape == (H, 3 * H)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert set(sd) == expected
    other, _ = make_model(seed=5)
    assert not other.load_state_dict(sd, strict=True).missing_keys
    assert torch.equal(other.fc.weight, model.fc.weight)


def test_constructor_checks_target_tensor_shapes():
    _, dc = make_model()
    cfg = DrafterModelConfig.from_configs(dc, target_config(), [1], 0)
    with pytest.raises(ValueError, match="embed_weight"):
        DFlashDrafter(cfg, torch.zeros(V, H + 1), torch.zeros(V, H))


def _seeded(device, dtype=torch.float32, seed=7):
    _, dc = make_model()
    cfg = DrafterModelConfig.from_configs(dc, target_config(), [1, 3, 5], V - 1)
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(V, H, generator=g).to(device, dtype)
    return DFlashDrafter(cfg, emb, emb, attention="sdpa", device=device, dtype=dtype, init_seed=seed)


def test_init_is_a_function_of_the_seed_alone():
    torch.manual_seed(123)  # the global RNG plays no part
    a = _seeded("cpu")
    torch.manual_seed(456)
    b = _seeded("cpu")
    c = _seeded("cpu", seed=8)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if name.endswith("proj.weight") or name == "fc.weight":
            assert not torch.equal(pa, pc), name
            assert abs(float(pa.std()) - a.config.initializer_range) < 0.2 * a.config.initializer_range, name
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name  # norms start at one
    # tied target tensors stay one tensor; every trainable weight was allocated in the asked dtype
    assert a.lm_head_weight is a.embed_weight
    half = _seeded("cpu", torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.fc.weight, a.fc.weight.to(torch.bfloat16))


@pytest.mark.gpu
def test_a_drafter_built_on_the_gpu_equals_the_one_built_on_the_host():
    host = _seeded("cpu", torch.bfloat16)
    before = torch.cuda.memory_allocated(0)
    dev = _seeded("cuda:0", torch.bfloat16)
    assert dev.fc.weight.device.type == "cuda" and torch.cuda.memory_allocated(0) > before
    for (name, ph), pd in zip(host.state_dict().items(), dev.state_dict().values()):
        assert torch.equal(ph, pd.cpu()), name


# --------------------------------------------------------------------------- attention behaviour


def test_flex_matches_sdpa_on_cpu():
    """Same outputs through flex (eager on CPU, forward only) and dense SDPA, several tilings."""
    model, _ = make_model(["sliding_attention", "full_attention"], window=5)
    seq, n, planes, tokens = batch([13, 21, 6])
    anchors = [0, 3, 9, 13, 14, 20, 27, 30, 33, 35]
    valid = torch.ones(len(anchors), dtype=torch.bool)
    valid[4] = False  # one block with nothing visible must give the same (finite) rows
    with torch.no_grad():
        ref = run(model, seq, planes, tokens, anchors, backend="sdpa", block_valid=valid)
        assert torch.isfinite(ref).all()
        for tile in (8, (16, 8), 128):
            out = run(model, seq, planes, tokens, anchors, backend="flex", block_valid=valid, tile=tile)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("slack", [0, 1 << 40])  # a group per run of blocks over one document; one group for all
def test_blockwise_matches_sdpa_outputs_and_gradients(monkeypatch, slack):
    """Blockwise attention scores each run of blocks against its visible context range only: the same
    outputs and parameter gradients as the dense mask, with blocks out of document order, a block with
    nothing visible, blocks at a document's start (no context) and a sliding window shorter than a document."""
    import dflash_ipc.drafter.model.blockwise as BW

    monkeypatch.setattr(BW, "MERGE_SLACK", slack)
    monkeypatch.setattr(BW.merge_groups, "__defaults__", (slack,))
    seq, n, planes, tokens = batch([13, 21, 6, 9])
    anchors = [14, 20, 0, 3, 27, 30, 9, 41, 35, 40, 34]  # docs 1, 1, 0, 0, 1, 1, 0, 3, 2, 3, 1
    valid = torch.ones(len(anchors), dtype=torch.bool)
    valid[5] = False
    grads, outs = {}, {}
    for backend in ("sdpa", "blockwise"):
        model, _ = make_model(["sliding_attention", "full_attention"], window=5)
        out = run(model, seq, planes, tokens, anchors, backend=backend, block_valid=valid)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs[backend] = out.detach()
        grads[backend] = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(outs["blockwise"]).all()
    torch.testing.assert_close(outs["blockwise"], outs["sdpa"], atol=2e-5, rtol=1e-5)
    assert grads["blockwise"].keys() == grads["sdpa"].keys() and grads["sdpa"]
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["blockwise"][name], g, atol=2e-5, rtol=1e-4, msg=name)
    doc = B.document_index(seq, n)
    layout = B.build_block_layout(seq, torch.tensor(anchors), doc.doc_of_token[torch.tensor(anchors)], 4, valid, n=n)
    groups = M.build_attention_masks(layout, ["full_attention"], 5, "blockwise")["full_attention"].groups
    assert [g[0] for g in groups[1:]] == [g[1] for g in groups[:-1]] and (groups[0][0], groups[-1][1]) == (0, layout.num_queries)
    # 8 runs of one document ([1 1] [0 0] [1 1] [0] [3] [2] [3] [1]), joined only where it adds nothing
    assert len(groups) == 1 if slack else len(groups) >= 6


def test_merged_groups_score_the_union_of_their_context_ranges():
    from dflash_ipc.drafter.model.blockwise import merge_groups

    runs = [(0, 8, 0, 10), (8, 16, 10, 20), (16, 24, 5, 5), (24, 32, 40, 60)]  # the third sees no context
    assert merge_groups(runs, slack=0) == [(0, 8, 0, 10), (8, 16, 10, 20), (16, 24, 5, 5), (24, 32, 40, 60)]
    # 16 x 20 = 80 + 80 + 160; then 24 x 20 = 320 + 0 + 160; the last would add 1,280
    assert merge_groups(runs, slack=160) == [(0, 24, 0, 20), (24, 32, 40, 60)]
    assert merge_groups(runs, slack=10**6) == [(0, 32, 0, 60)]


def _block_rows(j, bs):
    return slice(j * bs, (j + 1) * bs)


def test_context_is_strictly_before_anchor_and_same_document():
    model, _ = make_model(["full_attention", "full_attention"])
    seq, n, planes, tokens = batch([12, 10])
    bs = model.config.block_size
    anchors = [5, 15]  # block 0 in doc 0, block 1 in doc 1 (doc 1 starts at 12)
    with torch.no_grad():
        base = run(model, seq, planes, tokens, anchors)
        # Perturb the anchor position itself and everything after it in doc 0: block 0 unchanged.
        p2 = planes.clone()
        p2[:, 5:12] += 3.0
        out = run(model, seq, p2, tokens, anchors)
        torch.testing.assert_close(out[_block_rows(0, bs)], base[_block_rows(0, bs)])
        # ... but block 1 (other document) is unchanged too, and so on: doc 0 is invisible to it.
        torch.testing.assert_close(out[_block_rows(1, bs)], base[_block_rows(1, bs)])
        # A context token strictly before the anchor does matter.
        p3 = planes.clone()
        p3[:, 4] += 3.0
        out = run(model, seq, p3, tokens, anchors)
        assert (out[_block_rows(0, bs)] - base[_block_rows(0, bs)]).abs().max() > 1e-4
        torch.testing.assert_close(out[_block_rows(1, bs)], base[_block_rows(1, bs)])


def test_in_block_bidirectional_in_full_causal_in_sliding():
    seq, n, planes, tokens = batch([20])
    anchors = [8]
    for layer_types, causal in ((["full_attention"] * 2, False), (["sliding_attention"] * 2, True)):
        model, _ = make_model(layer_types, window=64)
        ids = model.block_input_ids(tokens[torch.tensor(anchors)])
        ids2 = ids.clone()
        ids2[0, 3] = 7  # change the last slot's input token
        with torch.no_grad():
            a = run(model, seq, planes, tokens, anchors, block_ids=ids)
            b = run(model, seq, planes, tokens, anchors, block_ids=ids2)
        earlier = (a[:3] - b[:3]).abs().max()
        if causal:
            assert earlier < 1e-6
        else:
            assert earlier > 1e-4


def test_sliding_window_limits_context():
    # One layer, so nothing reaches a slot indirectly through an earlier slot's output.
    model, _ = make_model(["sliding_attention"], window=4)
    seq, n, planes, tokens = batch([24])
    anchors = [12]  # slot 0 at position 12 sees context 9..11; slot 3 (pos 15) sees none
    with torch.no_grad():
        base = run(model, seq, planes, tokens, anchors)
        p2 = planes.clone()
        p2[:, :9] += 3.0  # outside every slot's window
        torch.testing.assert_close(run(model, seq, p2, tokens, anchors), base)
        p3 = planes.clone()
        p3[:, 9] += 3.0  # inside slot 0's window only (slot 1 at pos 13 sees 10..12)
        out = run(model, seq, p3, tokens, anchors)
        assert (out[0] - base[0]).abs().max() > 1e-4
        torch.testing.assert_close(out[1:], base[1:])


def test_invalid_block_gradients_are_finite():
    model, _ = make_model(["sliding_attention", "full_attention"])
    seq, n, planes, tokens = batch([10, 10])
    valid = torch.tensor([True, False, True])
    out = run(model, seq, planes, tokens, [2, 5, 12], block_valid=valid)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.trainable_parameters())


# --------------------------------------------------------------------------- export


def test_export_layout_and_round_trip(tmp_path):
    model, _ = make_model(["sliding_attention", "full_attention"], window=5)
    with torch.no_grad():
        for p in model.trainable_parameters():  # make norms non-trivial too
            p.add_(0.01 * torch.randn_like(p))
    seq, n, planes, tokens = batch([13, 21])
    anchors = [1, 4, 14, 20, 25]
    out_dir = export_drafter(model, tmp_path / "export")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 5
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert cfg["dflash_config"]["mask_token_id"] == V - 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert cfg["num_target_layers"] == 8 and cfg["tie_word_embeddings"] is False
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000.0 and cfg["head_dim"] == 16
    weights = load_file(str(out_dir / "model.safetensors"))
    assert set(weights) == set(model.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in weights)
    assert weights["fc.weight"].shape == (H, 3 * H)

    loaded = load_exported_drafter(out_dir, model.embed_weight.data, model.lm_head_weight.data, attention="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(run(loaded, seq, planes, tokens, anchors), run(model, seq, planes, tokens, anchors), atol=0, rtol=0)

    bf = export_drafter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(str(bf / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_export_without_sliding_layers_has_no_window(tmp_path):
    model, _ = make_model(["full_attention"])
    cfg = json.loads((export_drafter(model, tmp_path) / "config.json").read_text())
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] is None
