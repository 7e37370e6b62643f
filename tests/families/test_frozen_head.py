"""The drafter's frozen embedding and LM head equal the target's effective ones (families.traits.FrozenHead):
what transformers' own model feeds its layer 0 and the logits its head gives for a final hidden state, on
tiny random checkpoints of Gemma 3 (embeddings x sqrt(hidden), logits soft-capped at 30), Granite
(embeddings x 12, logits / 8) and Llama (plain), in the training path (the drafter `up` builds, the chunked
CE and its gradient, with and without the KL term, the FP8 head), in eval's loader and in the export
(its config read as z-lab's dflash 0.1.0 and vLLM read it, and its own modeling class).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from family_zoo import build_checkpoint
from loop_harness import small_config

from dflash_ipc.drafter.export.layout import EXPORT_WEIGHTS_FILE, export_drafter, load_exported_drafter
from dflash_ipc.drafter.loss.chunked_ce import chunked_lm_loss
from dflash_ipc.drafter.model.build import drafter_for_target
from dflash_ipc.drafter.model.fp8_head import Fp8Head
from dflash_ipc.drafter.model.frozen_head import EMBED_TENSOR
from dflash_ipc.families import FrozenHead
from dflash_ipc.target_spec.heads import target_head_weights
from dflash_ipc.target_spec.hf_config import load_hf_config

SCALED = ("gemma3", "granite")
FAMILIES = (*SCALED, "llama")
IDS = torch.tensor([1, 7, 99, 512, 1023, 3, 3, 640])  # any ids, repeats included
RTOL = 1e-5


def target_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def drafter(path, tmp, target_dtype: str = "float32"):
    """The drafter `up` builds for this checkpoint (its frozen tables read from the safetensors files)."""
    cfg = small_config(tmp, targets=1, target={"model_path": str(path), "spec": {}, "layer_ids": [0, 1, 2], "dtype": target_dtype})
    hf = load_hf_config(cfg.target)
    return drafter_for_target(cfg, hf, [0, 1, 2], 5, "cpu"), cfg


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> (checkpoint, its transformers model in fp32, the drafter `up` builds for it, its config)."""
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for name in FAMILIES:
        path = build_checkpoint(name, root)
        draft, cfg = drafter(path, tmp_path_factory.mktemp(name))
        out[name] = (path, target_model(path), draft, cfg)
    return out


def layer0_input(model, ids: torch.Tensor) -> torch.Tensor:
    """What transformers' model feeds its first decoder layer for ``ids``."""
    with torch.no_grad():
        return model(ids[None], output_hidden_states=True).hidden_states[0][0]


def logits_for_final_hidden(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own logits (its head and whatever follows it) for ``hidden`` [n, H] as its final-normed
    hidden state: the final norm's output is replaced by ``hidden`` for one forward (differentiable)."""
    handle = model.model.norm.register_forward_hook(lambda mod, args, out: hidden[None].to(out.dtype))
    try:
        return model(torch.zeros(1, hidden.shape[0], dtype=torch.long)).logits[0]  # any ids: the norm's output is replaced
    finally:
        handle.remove()


def hidden_states(n: int, seed: int, std: float = 30.0) -> torch.Tensor:
    """Final hidden states large enough that Gemma's soft-cap bends the logits (|logit| up to ~2x the cap)."""
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)) * std


# --------------------------------------------------------------------------- the drafter `up` builds


@pytest.mark.parametrize("name", FAMILIES)
def test_the_drafter_embeds_what_transformers_feeds_layer_0(zoo, name):
    _, model, d, _ = zoo[name]
    expect = layer0_input(model, IDS)
    torch.testing.assert_close(d.embed(IDS), expect, rtol=RTOL, atol=0)
    raw = F.embedding(IDS, d.embed_weight)
    assert torch.equal(raw, expect) == (name == "llama")  # the families that scale are really scaled


@pytest.mark.parametrize("name", SCALED)
def test_a_bf16_targets_scaled_embeddings_reach_an_fp32_drafter_bit_for_bit(zoo, name, tmp_path):
    """The scale and the product rounded as the bf16 target rounds them (Gemma: sqrt(64) is exact in bf16 but
    the products round), then widened to the drafter's fp32: equal, not close."""
    path = zoo[name][0]
    d, _ = drafter(path, tmp_path, target_dtype="bfloat16")
    assert d.dtype == torch.float32 and d.target_dtype == torch.bfloat16
    expect = layer0_input(target_model(path, torch.bfloat16), IDS).float()
    assert torch.equal(d.embed(IDS), expect)
    assert not torch.equal(zoo[name][2].embed(IDS), expect)  # the fp32 target's differ: the rounding is the bf16 target's


@pytest.mark.parametrize("name", FAMILIES)
def test_the_drafters_logits_are_the_targets_for_the_same_final_hidden_state(zoo, name):
    _, model, d, _ = zoo[name]
    h = hidden_states(len(IDS), 1)
    with torch.no_grad():
        expect = logits_for_final_hidden(model, h)
        got = d.compute_logits(h)
    torch.testing.assert_close(got, expect, rtol=RTOL, atol=RTOL * float(expect.abs().max()))
    raw = F.linear(h, d.lm_head_weight)
    if name == "gemma3":
        assert float(raw.abs().max()) > 40 and float(expect.abs().max()) < 30  # the cap bites
    assert torch.equal(raw, got) == (name == "llama")


# --------------------------------------------------------------------------- the training loss


def reference_loss(model, h, labels, weights, target_hidden=None, kl_weight=0.0):
    """sum_w CE (+ kl_weight * sum_w KL(target || draft)) through transformers' own head, by autograd."""
    logits = logits_for_final_hidden(model, h).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    total = (ce * weights).sum()
    if target_hidden is not None:
        t_logp = F.log_softmax(logits_for_final_hidden(model, target_hidden).detach().float(), -1)
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, -1))).sum(-1)
        total = total + kl_weight * (kl * weights).sum()
    return total


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("head_trains", [False, True], ids=["frozen-head", "head-gradient-in-backward"])
def test_the_chunked_loss_and_its_gradients_are_the_targets_cross_entropy(zoo, name, with_kl, head_trains):
    """The chunked CE (chunks of 3 rows over 8) against autograd through transformers' head: the loss, the
    gradient of the hidden states (the frozen head's, taken in forward) and, with a head that trains, the
    recomputing backward's gradients of both."""
    _, model, d, _ = zoo[name]
    labels = torch.tensor([5, 900, 17, 17, 300, 1023, 0, 64])
    weights = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.25, 1.0, 3.0, 0.7])
    th = hidden_states(8, 3, std=20.0) if with_kl else None
    kl_w = 0.7 if with_kl else 0.0
    h = hidden_states(8, 2).requires_grad_()
    head = model.lm_head.weight.detach().clone().requires_grad_(head_trains)
    res = chunked_lm_loss(h, head, labels, weights, 3, target_hidden=th, kl_weight=kl_w, frozen_head=d.config.frozen_head)
    res.loss_sum.backward()
    h_ref = h.detach().clone().requires_grad_()
    model.lm_head.weight.requires_grad_(head_trains)
    model.zero_grad()
    expect = reference_loss(model, h_ref, labels, weights, th, kl_w)
    expect.backward()
    torch.testing.assert_close(res.loss_sum, expect, rtol=RTOL, atol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-5 * float(h_ref.grad.abs().max()))
    if head_trains:
        g_ref = model.lm_head.weight.grad
        torch.testing.assert_close(head.grad, g_ref, rtol=1e-4, atol=1e-5 * float(g_ref.abs().max()))
    model.lm_head.weight.requires_grad_(False)
    plain = chunked_lm_loss(h.detach(), head.detach(), labels, weights, 3, target_hidden=th, kl_weight=kl_w)
    assert abs(float(plain.loss_sum) - expect.item()) > 1e-3 * abs(expect.item())  # the head's transform matters


@pytest.mark.parametrize("name", SCALED)
def test_a_training_steps_loss_is_the_cross_entropy_of_the_drafters_finished_logits(zoo, name):
    """compute_loss on a packed batch (3 documents, KL on, chunks of 16 rows) equals the loss recomputed from
    the drafter's compute_logits, which the tests above hold to transformers' own logits; the final norm and
    the target's last hidden states scaled up so that Gemma's cap bends both distributions."""
    from drafter.test_dflash_loss import manual_loss, packed_views

    from dflash_ipc.config import DrafterConfig, TrainingConfig
    from dflash_ipc.drafter.loss import blocks as B
    from dflash_ipc.drafter.loss import objective as L

    d = copy.deepcopy(zoo[name][2])
    with torch.no_grad():
        d.norm.weight.fill_(20.0)
    m = d.config
    dc = DrafterConfig(
        num_layers=m.num_layers,
        layer_types=list(m.layer_types),
        block_size=m.block_size,
        sliding_window=m.sliding_window,
        num_anchors=3,
        noise_std=0.0,
        attention="sdpa",
    )
    tc = TrainingConfig(loss_gamma=7.0, ce_chunk_tokens=16, kl_weight=0.5)
    views = packed_views([12, 8, 6], planes=4)
    views.planes[3] *= 30.0
    out = L.compute_loss(d, views, dc, tc, torch.Generator().manual_seed(5))
    anchors, _ = B.sample_anchors(views.loss_mask, views.seq_lens, 3, m.block_size, torch.Generator().manual_seed(5))
    total, *_ = manual_loss(d, views, anchors, 7.0, kl_weight=0.5)
    torch.testing.assert_close(out.loss_sum, total, rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", SCALED)
def test_the_fp8_heads_loss_is_the_targets_within_e4m3_rounding(zoo, name):
    """``training.ce_fp8``: the head's GEMMs in e4m3 (the CPU's _scaled_mm), the logits finished as the
    target's: the loss within 1 % and the gradient at cosine > 0.99 of transformers' own (tests/drafter/test_ce_fp8.py
    derives these bounds); without the transform the loss is far outside."""
    _, model, d, _ = zoo[name]
    labels = torch.tensor([5, 900, 17, 17, 300, 1023, 0, 64] * 4)
    weights = torch.ones(32)
    # raw logits that spread like an LM's (std ~2.4: tests/drafter/test_ce_fp8.py's cases), Gemma's ten times wider: capped
    std = 30.0 if name == "gemma3" else 3.0
    h = hidden_states(32, 4, std=std).requires_grad_()
    head = model.lm_head.weight.detach()
    fp8 = Fp8Head.quantize(head)
    res = chunked_lm_loss(h, head, labels, weights, 5, fp8_head=fp8, frozen_head=d.config.frozen_head)
    res.loss_sum.backward()
    h_ref = h.detach().clone().requires_grad_()
    expect = reference_loss(model, h_ref, labels, weights)
    expect.backward()
    assert abs(res.loss_sum.item() / expect.item() - 1) < 0.01
    assert F.cosine_similarity(h.grad.flatten().double(), h_ref.grad.flatten().double(), dim=0) > 0.99
    plain = chunked_lm_loss(h.detach(), head, labels, weights, 5, fp8_head=fp8)
    assert abs(plain.loss_sum.item() / expect.item() - 1) > 0.05


# --------------------------------------------------------------------------- a plain family


def test_a_plain_family_embeds_and_projects_bit_for_bit_as_before(zoo):
    """Llama: the raw table rows and the plain matmul, equal to the bit; the loss with its (plain) frozen head
    equals the loss without one; its export carries no key or tensor of the frozen head."""
    _, _, d, _ = zoo["llama"]
    head = d.config.frozen_head
    assert head == FrozenHead() and head.is_plain
    assert torch.equal(d.embed(IDS), F.embedding(IDS, d.embed_weight).to(d.dtype))
    h = hidden_states(8, 5, std=1.0).requires_grad_()
    assert torch.equal(d.compute_logits(h), F.linear(h, d.lm_head_weight))
    labels, weights = torch.tensor([5, 900, 17, 17, 300, 1023, 0, 64]), torch.rand(8)
    a = chunked_lm_loss(h, d.lm_head_weight, labels, weights, 3, frozen_head=head)
    (ga,) = torch.autograd.grad(a.loss_sum, h)
    b = chunked_lm_loss(h, d.lm_head_weight, labels, weights, 3)
    (gb,) = torch.autograd.grad(b.loss_sum, h)
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(ga, gb)


def test_a_plain_familys_export_has_no_frozen_head_keys(zoo, tmp_path):
    from safetensors import safe_open

    out = export_drafter(zoo["llama"][2], tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    new_keys = {"frozen_head", "input_embedding_scale", "output_multiplier", "final_logit_softcapping"}
    assert not new_keys & set(cfg["dflash_config"]) and "logit_scale" not in cfg
    with safe_open(str(out / EXPORT_WEIGHTS_FILE), framework="pt") as f:
        assert EMBED_TENSOR not in f.keys()


# --------------------------------------------------------------------------- the export


@pytest.fixture(scope="module")
def exports(zoo, tmp_path_factory):
    """name -> the `all`-layout export of its drafter."""
    return {name: export_drafter(zoo[name][2], tmp_path_factory.mktemp(f"export-{name}")) for name in SCALED}


@pytest.mark.parametrize("name", SCALED)
def test_evals_loader_embeds_and_projects_as_the_target(zoo, exports, name):
    path, model, d, cfg = zoo[name]
    embed, head = target_head_weights(cfg.target, load_hf_config(cfg.target), "cpu", torch.float32)
    back = load_exported_drafter(exports[name], embed, head, attention="sdpa")
    assert back.config.frozen_head == d.config.frozen_head
    torch.testing.assert_close(back.embed(IDS), layer0_input(model, IDS), rtol=RTOL, atol=0)
    h = hidden_states(8, 6)
    with torch.no_grad():
        expect = logits_for_final_hidden(model, h)
        torch.testing.assert_close(back.compute_logits(h), expect, rtol=RTOL, atol=RTOL * float(expect.abs().max()))


@pytest.mark.parametrize("name", SCALED)
def test_the_exports_modeling_class_embeds_and_projects_as_the_target(zoo, exports, name):
    from transformers import AutoModel

    _, model, _, _ = zoo[name]
    draft = AutoModel.from_pretrained(exports[name], trust_remote_code=True, dtype=torch.float32).eval()
    torch.testing.assert_close(draft.noise_embedding(model, IDS[None])[0], layer0_input(model, IDS), rtol=RTOL, atol=0)
    h = hidden_states(8, 7)
    with torch.no_grad():
        expect = logits_for_final_hidden(model, h)
        got = draft.compute_logits(h[None], model.get_output_embeddings())[0]
    torch.testing.assert_close(got, expect, rtol=RTOL, atol=RTOL * float(expect.abs().max()))


@pytest.mark.parametrize("name", SCALED)
def test_zlab_dflash_reads_the_exports_keys_into_the_targets_embedding_and_logits(zoo, exports, name):
    """z-lab dflash 0.1.0's own code on the export: its loop's block embedding (the target's raw table times
    dflash_config.input_embedding_scale) and its DFlashDraftModel.compute_logits (times output_multiplier,
    soft-capped at final_logit_softcapping)."""
    zl = pytest.importorskip("dflash.model", reason="z-lab's dflash (the test extra) is not installed")
    _, model, _, _ = zoo[name]
    draft = zl.DFlashDraftModel.from_pretrained(exports[name], dtype=torch.float32).eval()
    scale = float(zl._draft_value(draft.config, "input_embedding_scale", 1.0))
    torch.testing.assert_close(zl._raw_input_embeddings(model, IDS[None], scale)[0], layer0_input(model, IDS), rtol=RTOL, atol=0)
    h = hidden_states(8, 8)
    with torch.no_grad():
        expect = logits_for_final_hidden(model, h)
        got = draft.compute_logits(h[None], zl._output_head(model))[0]
    torch.testing.assert_close(got, expect, rtol=RTOL, atol=RTOL * float(expect.abs().max()))


@pytest.mark.parametrize("name", SCALED)
def test_the_export_carries_what_vllm_reads_the_scaled_table_and_the_logit_scale(zoo, exports, name):
    """vLLM's DFlashQwen3ForCausalLM embeds with the export's own embed_tokens.weight (kept: it differs from the
    target's table) and multiplies its head's logits by config.json's logit_scale (its LogitsProcessor's
    scale; no soft-cap): the table's rows are what the target feeds layer 0; Granite's logits are the
    target's; Gemma's are the uncapped ones (docs/EVAL.md)."""
    from safetensors import safe_open

    _, model, d, _ = zoo[name]
    cfg = json.loads((exports[name] / "config.json").read_text())
    with safe_open(str(exports[name] / EXPORT_WEIGHTS_FILE), framework="pt") as f:
        table = f.get_tensor(EMBED_TENSOR)
    assert not torch.equal(table, model.get_input_embeddings().weight)  # vLLM keeps a table that differs
    torch.testing.assert_close(F.embedding(IDS, table), layer0_input(model, IDS), rtol=RTOL, atol=0)
    h = hidden_states(8, 9)
    with torch.no_grad():
        vllm_logits = F.linear(h, model.lm_head.weight) * cfg.get("logit_scale", 1.0)
        expect = logits_for_final_hidden(model, h)
    if name == "granite":
        torch.testing.assert_close(vllm_logits, expect, rtol=RTOL, atol=RTOL * float(expect.abs().max()))
    else:
        assert "logit_scale" not in cfg and not torch.allclose(vllm_logits, expect)
        assert torch.equal(vllm_logits.argmax(-1), expect.argmax(-1))  # greedy drafts unchanged by the cap


def test_the_export_notes_say_which_engine_cannot_compute_the_targets_embeddings_or_logits(zoo):
    """vLLM reads no soft-cap (Gemma); SGLang reads no embedding scale (both families; its Gemma module scales);
    a layout for one engine notes only its own; a plain family none."""
    from dflash_ipc.drafter.export.from_checkpoint import client_notes

    def engines(name, client):
        return sorted(n.split()[0] for n in client_notes(zoo[name][2].config, client))

    assert engines("gemma3", "all") == ["SGLang", "vLLM"]
    assert engines("granite", "all") == ["SGLang"]
    assert engines("gemma3", "vllm") == ["vLLM"] and engines("granite", "vllm") == [] and engines("gemma3", "zlab") == []
    assert engines("llama", "all") == []


def test_the_memory_plan_counts_the_soft_caps_slope(zoo):
    """The chunked CE keeps the capped logits' slope per chunk (fp32): planned for Gemma, not for the others."""
    from dflash_ipc.drafter.training.memory_plan import drafter_widths, shared_step_bytes

    widths = {name: drafter_widths(zoo[name][2], zoo[name][3]) for name in FAMILIES}
    assert [widths[name].ce_softcap for name in FAMILIES] == [True, False, False]
    gemma = widths["gemma3"]
    assert shared_step_bytes(gemma) > shared_step_bytes(dataclasses.replace(gemma, ce_softcap=False))


def test_eval_decodes_granite_losslessly_and_warns_for_an_export_without_its_frozen_head(zoo, exports, tmp_path):
    """`dflash-ipc eval` on the Granite target with its drafter's export: lossless, no warning; the same weights
    exported as if trained on plain embeddings and logits: eval says the drafter trained on other ones."""
    from click.testing import CliRunner

    from dflash_ipc.cli import main

    _, _, d, cfg = zoo["granite"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    plain = copy.deepcopy(d)
    plain.config = dataclasses.replace(d.config, frozen_head=FrozenHead())
    warning = "(the target's embedding and head: embeddings x 12, logits / 8; the export's: plain)"
    for export, warned in ((exports["granite"], False), (export_drafter(plain, tmp_path / "plain"), True)):
        args = ["eval", "--config", cfg.source, "--drafter", str(export), "--prompts", str(prompts), "--max-new", "6", "--json"]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        assert json.loads(r.output.strip().splitlines()[-1])["lossless"] is True
        assert (warning in r.output) == warned, r.output
