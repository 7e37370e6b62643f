"""Varlen target forward: every document of a packed row equals its standalone forward.

Real transformers models (tiny Qwen3.5: GatedDeltaNet + full attention; tiny Llama: full
attention only), real captures, compared document by document with the document run alone.
The negative controls switch the per-document reset off and show the leak the reset prevents.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dflash_ipc.config import TargetConfig
from dflash_ipc.target.model import TargetModel, build_target
from dflash_ipc.target.packing import BatchMeta, flat_batch_meta, pack_into_slot
from dflash_ipc.target.varlen import DocumentResetMixer, PackedDocs
from dflash_ipc.target_spec.hf_config import tiny_spec
from dflash_ipc.transport.slots import SlotLayout

VOCAB = 300
# lengths 1-3 are shorter than the 4-tap conv; 70 spans two 64-token chunks of the delta rule
MIXED_LENS = [1, 7, 2, 3, 70, 5, 1, 33, 4, 2]


def _docs(lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _max_diff_per_doc(model: TargetModel, docs: list[torch.Tensor], device="cpu") -> list[float]:
    """Max abs difference, over all captured planes, between each document's slice of the packed
    forward and that document's standalone forward."""
    lens = [int(d.numel()) for d in docs]
    packed = model.capture_packed(torch.cat(docs).to(device), lens)
    assert all(tuple(p.shape) == (1, sum(lens), model.hidden_size) for p in packed)
    out, start = [], 0
    for d, n in zip(docs, lens):
        alone = model.capture(d.view(1, -1).to(device))
        out.append(max((p[0, start : start + n].float() - a[0].float()).abs().max().item() for p, a in zip(packed, alone)))
        start += n
    return out


@pytest.fixture(scope="module")
def qwen_target() -> TargetModel:
    cfg = TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[0, 1, 2, 3, 4], capture_last_hidden=True, varlen=True)
    return build_target(cfg, "cpu")


@pytest.fixture(scope="module")
def llama_target() -> TargetModel:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    conf = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return TargetModel(LlamaModel(conf), conf, [0, 2, 3], "cpu", torch.float32, capture_last_hidden=True, varlen=True)


def test_qwen35_packed_equals_standalone_per_document(qwen_target):
    assert len(qwen_target._mixers) == 4 and not qwen_target.linear_attention_kernels  # CPU: padded fallback
    diffs = _max_diff_per_doc(qwen_target, _docs(MIXED_LENS))
    print(f"qwen3.5 tiny fp32 packed vs standalone: max abs diff {max(diffs):.3g} over lens {MIXED_LENS}")
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("lens", [[1, 1, 1], [2, 3, 1, 2], [3, 50]])
def test_qwen35_documents_shorter_than_the_conv(qwen_target, lens):
    assert max(_max_diff_per_doc(qwen_target, _docs(lens, seed=len(lens)))) <= 1e-5


def test_qwen35_without_reset_leaks_across_documents(qwen_target):
    """Negative control: the same packed row with the GatedDeltaNet reset off (attention still
    masked per document) carries state and conv taps from one document into the next."""
    for m in qwen_target._mixers:
        m.reset_documents = False
    try:
        diffs = _max_diff_per_doc(qwen_target, _docs(MIXED_LENS))
    finally:
        for m in qwen_target._mixers:
            m.reset_documents = True
    print(f"qwen3.5 tiny without reset: max abs diff {max(diffs):.3g}")
    assert diffs[0] <= 1e-5  # the first document has nothing before it
    assert min(diffs[1:]) > 1e-3, diffs  # every later one (including length-1 ones) is contaminated


def test_llama_packed_equals_standalone_per_document(llama_target):
    assert llama_target._mixers == []
    diffs = _max_diff_per_doc(llama_target, _docs(MIXED_LENS, seed=3))
    print(f"llama tiny fp32 packed vs standalone: max abs diff {max(diffs):.3g}")
    assert max(diffs) <= 1e-5, diffs


def test_llama_one_document_mask_leaks(llama_target):
    """Negative control: declared as one document, the row attends across the boundaries."""
    docs = _docs([5, 9, 6], seed=4)
    packed = llama_target.capture_packed(torch.cat(docs), [20])
    second_alone = llama_target.capture(docs[1].view(1, -1))
    assert (packed[0][0, 5:14] - second_alone[0][0]).abs().max().item() > 1e-3


def test_packed_docs_positions_and_boundaries():
    d = PackedDocs.build([3, 1, 2], torch.device("cpu"))
    assert d.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert d.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2]]
    assert d.cu_seqlens.tolist() == [0, 3, 4, 6] and d.max_len == 3
    assert d.padded_index().tolist() == [0, 1, 2, 3, 6, 7]
    assert d.attention_kwargs("flex_attention") == {}
    assert set(d.attention_kwargs("sdpa")) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert set(d.attention_kwargs("flash_attention_2")) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    with pytest.raises(ValueError, match=">= 1"):
        PackedDocs.build([2, 0], torch.device("cpu"))


def test_capture_packed_rejects_bad_input(qwen_target):
    with pytest.raises(ValueError, match="sum to"):
        qwen_target.capture_packed(torch.zeros(5, dtype=torch.long), [2, 2])
    with pytest.raises(ValueError, match=r"\[n\] or \[1, n\]"):
        qwen_target.capture_packed(torch.zeros(2, 3, dtype=torch.long), [3, 3])
    assert all(m.docs is None for m in qwen_target._mixers)  # disarmed after a failed call too
    padded = build_target(TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[1], varlen=False), "cpu")
    with pytest.raises(ValueError, match="varlen=True"):
        padded.capture_packed(torch.zeros(3, dtype=torch.long), [3])
    assert not any(isinstance(m, DocumentResetMixer) for m in padded.stack.modules())


def test_varlen_and_padded_builds_share_weights_and_fill_the_same_slot(qwen_target):
    """target.varlen only changes how the batch is run: same weights, same slot contents."""
    cfg = TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[0, 1, 2, 3, 4], capture_last_hidden=True, varlen=False)
    padded_model = build_target(cfg, "cpu")
    lens = [4, 1, 9, 2]
    docs = _docs(lens, seed=7)
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros(len(lens), max(lens), dtype=torch.uint8)
    for i, d in enumerate(docs):
        ids[i, : d.numel()] = d
        mask[i, : d.numel()] = 1
    layout = SlotLayout(num_planes=6, hidden_size=qwen_target.hidden_size, max_tokens=64, max_seqs=8, plane_dtype="float32")
    slot_padded = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    slot_packed = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    pack_into_slot(layout, slot_padded, padded_model.capture(ids), BatchMeta(lens, ids, mask))
    meta = flat_batch_meta(ids, mask, torch.tensor(lens), pin=False)
    pack_into_slot(layout, slot_packed, qwen_target.capture_packed(meta.token_ids, lens), meta)
    a, b = layout.views(slot_padded, sum(lens), len(lens)), layout.views(slot_packed, sum(lens), len(lens))
    assert (a.planes - b.planes).abs().max().item() <= 1e-5
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.seq_lens, b.seq_lens)


@pytest.mark.gpu
def test_cuda_bf16_packed_equals_standalone():
    """bf16 on the GPU through the varlen kernels when fla is installed: fla's chunk over
    cu_seqlens, its Triton conv over cu_seqlens (or causal-conv1d's seq_idx when that extension is
    present), torch's varlen attention; documents of 1-3 tokens (shorter than the 4-tap conv)
    included. Tolerance: 2% of the plane's largest magnitude per document (a few bf16 ulps at the
    top of the residual stream); kernels chunk a packed row differently from a lone document, so
    bit equality is not expected."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import importlib.util

    cfg = TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[0, 1, 2, 3, 4], capture_last_hidden=True, varlen="auto", dtype="bfloat16")
    model = build_target(cfg, "cuda")
    print(f"auto: {model.varlen_reason}; GatedDeltaNet conv {sorted({m.conv or 'padded' for m in model._mixers})}")
    if importlib.util.find_spec("fla") is not None:  # packed by default, on the varlen kernels
        assert model.varlen and model.linear_attention_kernels and "fla chunk_gated_delta_rule(cu_seqlens)" in model.varlen_reason
    else:
        model = build_target(dataclasses.replace(cfg, varlen=True), "cuda")
    docs = _docs(MIXED_LENS + [300, 129, 1])
    lens = [int(d.numel()) for d in docs]
    packed = model.capture_packed(torch.cat(docs).cuda(), lens)
    worst_rel, worst_abs, start = 0.0, 0.0, 0
    for d, n in zip(docs, lens):
        alone = model.capture(d.view(1, -1).cuda())
        for p, a in zip(packed, alone):
            diff = (p[0, start : start + n].float() - a[0].float()).abs().max().item()
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(1e-3, a.float().abs().max().item()))
        start += n
    print(f"cuda bf16 packed vs standalone: kernels={model.linear_attention_kernels} max abs {worst_abs:.4g}, max rel {worst_rel:.4g}")
    assert worst_rel <= 2e-2


@pytest.mark.gpu
def test_cuda_fla_packed_conv_equals_each_document_alone():
    """fla's Triton conv over cu_seqlens (the adapter the packed GatedDeltaNet swaps in) against
    the layer's own conv (transformers' torch one, or causal-conv1d) run on each document alone, fp32, SiLU, documents shorter than the
    4-tap window included: no tap reads another document (tolerance 1e-4: fp32 sums of 4 taps)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("fla")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    from dflash_ipc.target.varlen import fla_packed_conv

    lens = [1, 2, 3, 4, 5, 64, 65, 200, 1]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 96, sum(lens), device="cuda", generator=g)  # [1, D, n] as the layer hands it
    w = torch.randn(96, 4, device="cuda", generator=g)
    docs = PackedDocs.build(lens, torch.device("cuda"))
    packed = fla_packed_conv(docs)(x, w, None, activation="silu")
    start, worst = 0, 0.0
    for n in lens:
        alone = q35.causal_conv1d_fn(x[:, :, start : start + n].contiguous(), w, None, activation="silu")
        worst = max(worst, (packed[:, :, start : start + n] - alone).abs().max().item())
        start += n
    print(f"fla packed conv vs torch per document: max abs {worst:.3g}")
    assert worst <= 1e-4


def test_auto_packs_only_where_packing_is_the_faster_forward():
    """target.varlen = "auto": sdpa attention or GatedDeltaNet without fla + causal-conv1d -> padded
    (with the reason); forced true/false are kept as set."""
    from transformers import LlamaConfig, LlamaModel

    from dflash_ipc.families import family_of
    from dflash_ipc.target.varlen import resolve_varlen

    qwen = build_target(TargetConfig(spec=tiny_spec(VOCAB), layer_ids=[0, 2], varlen="auto"), "cpu")
    assert qwen.varlen is False and not qwen._mixers
    assert "sdpa attention has no varlen kernel here" in qwen.varlen_reason and "GatedDeltaNet chunk=" in qwen.varlen_reason
    on, why = resolve_varlen("auto", qwen.stack, "flex_attention", qwen.family)
    assert on is False and "sdpa" not in why and "GatedDeltaNet" in why  # CPU: no fla / causal-conv1d
    conf = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    llama, family = LlamaModel(conf), family_of(conf)
    assert resolve_varlen("auto", llama, "sdpa", family)[0] is False
    assert resolve_varlen("auto", llama, "flex_attention", family) == (True, "auto: packed (attention: flex_attention)")
    # forced: the reason names what a packed row runs on (CPU: attention per document, padded)
    assert resolve_varlen(True, llama, "sdpa", family) == (True, "target.varlen = true (attention: sdpa per document, padded)")
    assert "GatedDeltaNet: each document padded inside the layer" in resolve_varlen(True, qwen.stack, "sdpa", qwen.family)[1]
    assert resolve_varlen(False, llama, "flex_attention", family) == (False, "target.varlen = false")
    with pytest.raises(ValueError, match="true, false or 'auto'"):
        resolve_varlen("yes", llama, "sdpa", family)


def _reference_per_document(q, k, v, lens):
    """Each document alone through sdpa (causal), GQA by repeating kv heads: [n, Hq, D]."""
    outs, start = [], 0
    groups = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_row(lens: list[int], layer: torch.nn.Module, device: str = "cpu", use_kernel: bool = False):
    """A PackedRow over documents of ``lens`` whose one attention layer is ``layer`` (plain causal attention)."""
    from dflash_ipc.families import AttentionLayer
    from dflash_ipc.target.packed_attention import PackedRow
    from dflash_ipc.target.varlen import PackedDocs

    return PackedRow({layer: AttentionLayer("full")}, PackedDocs.build(lens, torch.device(device)), use_kernel)


def test_packed_attention_equals_each_document_alone():
    """sdpa's packed forward runs per document (here: padded per document, CPU), GQA included,
    and refuses to run outside a packed forward or for a module it was not set up with."""
    from dflash_ipc.target.packed_attention import packed_attention, packed_attention_forward

    lens = [1, 7, 2, 33, 4]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (6, 2, 2))
    as_layer = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, n, D] as transformers passes them
    layer, config = torch.nn.Identity(), SimpleNamespace(_attn_implementation="sdpa")
    with packed_attention(config, packed_row(lens, layer)):
        out, weights = packed_attention_forward(layer, *as_layer, None, scaling=16**-0.5)
        with pytest.raises(ValueError, match="not an attention layer of the stack"):
            packed_attention_forward(torch.nn.Identity(), *as_layer, None)
        with pytest.raises(ValueError, match="does not know how to honour dropout_p"):
            packed_attention_forward(layer, *as_layer, None, dropout_p=0.1)
        with pytest.raises(ValueError, match="sliding_window 4"):
            packed_attention_forward(layer, *as_layer, None, sliding_window=4)
    assert weights is None and out.shape == (1, sum(lens), 6, 16)
    assert (out[0] - _reference_per_document(q, k, v, lens)).abs().max().item() <= 1e-5
    assert config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="packed forward"):
        packed_attention_forward(layer, *as_layer, None)


def test_sdpa_target_switches_attention_only_inside_the_packed_forward(llama_target):
    """The packed forward dispatches to the per-document attention; padded capture (and so eval's
    cached decoding) keeps sdpa, before and after."""
    from dflash_ipc.target.packed_attention import PACKED_ATTENTION

    cfg = llama_target.stack.config
    assert llama_target.packed_attention and cfg._attn_implementation == "sdpa"
    seen = []
    hook = llama_target.stack.layers[0].self_attn.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
    try:
        docs = _docs([4, 6], seed=9)
        llama_target.capture_packed(torch.cat(docs), [4, 6])
        llama_target.capture(docs[1].view(1, -1))
    finally:
        hook.remove()
    assert seen == [PACKED_ATTENTION, "sdpa"] and cfg._attn_implementation == "sdpa"


@pytest.mark.gpu
def test_cuda_varlen_kernel_equals_padded_per_document():
    """torch's varlen flash kernel (bf16, head_dim 256 as Qwen3.6, GQA 24/4) against each document
    alone through sdpa in fp32; tolerance: bf16 rounding of the inputs and output (2e-2 abs)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dflash_ipc.target.packed_attention import packed_attention, packed_attention_forward, varlen_kernel_usable

    if not varlen_kernel_usable("cuda", torch.bfloat16):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    lens = [1, 3, 700, 129, 64, 2000]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lens), h, 256, generator=g) for h in (24, 4, 4))
    as_layer = [t.cuda().to(torch.bfloat16).transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    layer = torch.nn.Identity()
    with packed_attention(SimpleNamespace(_attn_implementation="sdpa"), packed_row(lens, layer, "cuda", use_kernel=True)):
        out, _ = packed_attention_forward(layer, *as_layer, None, scaling=256**-0.5)
    ref = _reference_per_document(*(t.cuda() for t in (q, k, v)), lens)
    diff = (out[0].float() - ref).abs().max().item()
    print(f"varlen_attn bf16 vs per-document fp32 sdpa: max abs {diff:.4g}")
    assert diff <= 2e-2
