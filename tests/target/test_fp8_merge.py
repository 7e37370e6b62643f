"""Sibling FP8 linears merged (target/fp8_merge.py): real tiny Qwen3.5, Llama and Qwen2 stacks,
quantized in place by ``quantize_linears`` (the real ``torch._scaled_mm`` row-wise, which runs on
this CPU), then merged: the captured planes equal the unmerged FP8 stack's bit for bit, padded and
packed, with fewer input quantizations and GEMMs per forward; and the sharing rule holds when a
forward calls its siblings on other tensors, in another order, twice, or not at all.

Why bit for bit: the merged GEMM quantizes the same input with the same function (one scale per
token: the same ``xq``, ``xs``), its weight rows and row scales are the siblings' own, concatenated,
and each output element is the same K-long fp32 dot product scaled and rounded once to bf16. A GPU
GEMM might sum a wider product in another order (then within one bf16 rounding per projection);
this CPU's does not, so equality is what is asserted here."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch import nn

import dflash_ipc.target.fp8 as fp8_mod
from dflash_ipc.config import TargetConfig
from dflash_ipc.target.fp8 import Fp8Linear, quantize_linears
from dflash_ipc.target.fp8_merge import Fp8LinearSlice, MergedFp8Linear, merge_sibling_linears, unmerge_sibling_linears
from dflash_ipc.target.model import TargetModel, build_target
from dflash_ipc.target_spec.hf_config import tiny_spec

VOCAB = 300
LENS = [37, 20, 5]


class Counter:
    """Counts calls of the input quantizer and of ``torch._scaled_mm``."""

    def __init__(self, monkeypatch):
        self.quantize = self.gemm = 0
        real_quantize, real_mm = fp8_mod.quantize_rows, torch._scaled_mm

        def quantize(x):
            self.quantize += 1
            return real_quantize(x)

        def scaled_mm(*args, **kwargs):
            self.gemm += 1
            return real_mm(*args, **kwargs)

        monkeypatch.setattr(fp8_mod, "quantize_rows", quantize)  # what quantize_linears hands each layer
        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)

    def per_call(self, fn) -> tuple[int, int, list[torch.Tensor]]:
        self.quantize = self.gemm = 0
        out = fn()
        return self.quantize, self.gemm, out


def _batches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    padded = torch.randint(0, VOCAB, (2, 29), generator=g)
    flat = torch.randint(0, VOCAB, (sum(LENS),), generator=g)
    return padded, flat


def _qwen35(value_heads: int) -> TargetModel:
    spec = {**tiny_spec(VOCAB), "linear_num_value_heads": value_heads}
    return build_target(TargetConfig(spec=spec, layer_ids=[1, 3, 5], dtype="bfloat16", varlen=True), "cpu")


def _hf_stack(family: str) -> TargetModel:
    import transformers

    torch.manual_seed(0)
    widths = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    spec = tiny_spec(VOCAB)  # the tiny Qwen3.5 target's widths, 3 full-attention layers
    conf = getattr(transformers, f"{family}Config")(num_hidden_layers=3, attn_implementation="sdpa", **{k: spec[k] for k in widths})
    stack = getattr(transformers, f"{family}Model")(conf).to(torch.bfloat16)
    return TargetModel(stack, conf, [0, 2], "cpu", torch.bfloat16, capture_last_hidden=True, varlen=True)


def _assert_merged_equals_unmerged(model: TargetModel, monkeypatch, expect_merged: dict[str, int]) -> None:
    counter = Counter(monkeypatch)
    n_fp8 = quantize_linears(model.stack, compile_quantizer=False)["fp8"]
    padded, flat = _batches(7)

    def both() -> list[torch.Tensor]:
        return [p.clone() for p in model.capture(padded)] + [p.clone() for p in model.capture_packed(flat, LENS)]

    q_before, mm_before, want = counter.per_call(both)
    counts = merge_sibling_linears(model.stack)
    assert counts == expect_merged
    assert merge_sibling_linears(model.stack)["groups"] == 0  # merging twice merges nothing more
    q_after, mm_after, got = counter.per_call(both)
    name = type(model.stack).__name__
    print(f"{name}: per padded + packed forward, quantizer calls {q_before} -> {q_after}, GEMMs {mm_before} -> {mm_after}")
    # every FP8 linear quantizes its input once per forward, unmerged; merged, each group once
    assert q_before == mm_before == 2 * n_fp8
    assert q_after == mm_after == 2 * (n_fp8 - counts["quantizations_saved"])
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    # nothing held between forwards: no merged module keeps a product or an open scope
    merged = [m for m in model.stack.modules() if isinstance(m, MergedFp8Linear)]
    assert len(merged) == counts["groups"] and all(m._shared is None and not m._scope_open for m in merged)
    assert unmerge_sibling_linears(model.stack) == counts["groups"]
    assert not any(isinstance(m, (MergedFp8Linear, Fp8LinearSlice)) for m in model.stack.modules())
    q_split, _, again = counter.per_call(both)
    assert q_split == q_before and all(torch.equal(a, b) for a, b in zip(want, again, strict=True))


@pytest.mark.parametrize("value_heads", [4, 16], ids=["gates-bf16", "gates-fp8"])
def test_qwen35_merged_captures_what_unmerged_fp8_captures(value_heads, monkeypatch):
    """6 layers (4 GatedDeltaNet, 2 attention). With 4 value heads the GatedDeltaNet's a/b gates are
    4 wide (kept bf16: its group is in_proj_qkv + in_proj_z); with 16 they are FP8 and join it."""
    model = _qwen35(value_heads)
    gdn_members = 2 if value_heads == 4 else 4
    # per layer an MLP group (2), per attention layer q/k/v (3), per GatedDeltaNet its input projections
    linears = 6 * 2 + 2 * 3 + 4 * gdn_members
    _assert_merged_equals_unmerged(model, monkeypatch, {"groups": 6 + 2 + 4, "linears": linears, "quantizations_saved": linears - 12})


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_llama_and_qwen2_merged_capture_what_unmerged_fp8_captures(family, monkeypatch):
    """3 layers: q/k/v and gate/up per layer (Qwen2's q/k/v carry biases: they concatenate too)."""
    model = _hf_stack(family)
    if family == "Qwen2":
        assert model.stack.layers[0].self_attn.q_proj.bias is not None
    _assert_merged_equals_unmerged(model, monkeypatch, {"groups": 6, "linears": 15, "quantizations_saved": 9})


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_qwen35_moe_and_qwen3_next_merge_as_qwen35_does(name, monkeypatch, tmp_path):
    """4 layers (2 GatedDeltaNet, 2 attention), each with a shared expert: its gate/up merge (the routed experts are
    not linears), q/k/v merge; Qwen3.5-MoE's GatedDeltaNet merges in_proj_qkv and in_proj_z (its 4-wide a/b gates
    stay bf16), Qwen3-Next's in_proj_qkvz stands alone (its in_proj_ba, 8 wide, stays bf16)."""
    from families.family_zoo import build_checkpoint

    cfg = TargetConfig(
        model_path=str(build_checkpoint(name, tmp_path)), tokenizer="builtin", layer_ids=[1, 3], dtype="bfloat16", varlen=True
    )
    gdn_groups = 2 if name == "qwen3_5_moe" else 0
    linears = 4 * 2 + 2 * 3 + gdn_groups * 2
    expect = {"groups": 4 + 2 + gdn_groups, "linears": linears, "quantizations_saved": linears - (6 + gdn_groups)}
    _assert_merged_equals_unmerged(build_target(cfg, "cpu"), monkeypatch, expect)


@pytest.fixture
def mlp_pair(monkeypatch):
    """A real Qwen3.5 MLP in FP8 merged, an unmerged FP8 copy as the reference, and the counter."""
    model = _qwen35(4)
    counter = Counter(monkeypatch)
    quantize_linears(model.stack, compile_quantizer=False)
    mlp = model.stack.layers[0].mlp
    ref = copy.deepcopy(mlp)
    merge_sibling_linears(model.stack)
    assert isinstance(mlp.gate_proj, Fp8LinearSlice) and type(ref.gate_proj) is Fp8Linear
    return mlp, ref, counter


def _x(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randn(1, n, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _run(mlp: nn.Module, body) -> list[torch.Tensor]:
    """Call ``mlp`` (hooks and all: its scope opens and closes) with ``body`` as its forward."""
    out: list[torch.Tensor] = []
    mlp.forward = lambda x: body(x, out)
    try:
        mlp(_x(0))
    finally:
        del mlp.forward
    return out


def test_a_sibling_on_another_tensor_gets_its_own_product(mlp_pair):
    mlp, ref, counter = mlp_pair
    y = _x(1)
    got = _run(mlp, lambda x, out: out.extend([mlp.gate_proj(x), mlp.up_proj(y), mlp.up_proj(x)]))
    assert torch.equal(got[0], ref.gate_proj(_x(0)))
    assert torch.equal(got[1], ref.up_proj(y)) and not torch.equal(got[1], ref.up_proj(_x(0)))
    assert torch.equal(got[2], ref.up_proj(_x(0)))  # x's shared product still there for up_proj
    # same values in another tensor object: not shared (identity, not equality, is the key)
    counter.quantize = counter.gemm = 0
    clone = _run(mlp, lambda x, out: out.extend([mlp.gate_proj(x), mlp.up_proj(x.clone())]))
    assert counter.quantize == counter.gemm == 2 and torch.equal(clone[1], ref.up_proj(_x(0)))


def test_siblings_in_any_order_share_one_product(mlp_pair):
    mlp, ref, counter = mlp_pair
    counter.quantize = counter.gemm = 0
    held: list[bool] = []

    def body(x, out):
        out.append(mlp.up_proj(x))
        held.append(mlp.gate_up_proj._shared is not None)
        out.append(mlp.gate_proj(x))
        held.append(mlp.gate_up_proj._shared is not None)

    got = _run(mlp, body)
    assert counter.quantize == 1 and counter.gemm == 1
    assert held == [True, False]  # released inside the forward once every sibling has its slice
    assert torch.equal(got[0], ref.up_proj(_x(0))) and torch.equal(got[1], ref.gate_proj(_x(0)))


def test_an_input_changed_in_place_is_not_served_the_old_product(mlp_pair):
    """Outside inference mode a tensor carries a version counter: an in-place write between two
    sibling calls makes the second compute its own product of the new values."""
    mlp, ref, _ = mlp_pair

    def body(x, out):
        out.append(mlp.gate_proj(x))
        x.mul_(2)
        out.append(mlp.up_proj(x))

    with torch.no_grad():
        got = _run(mlp, body)
    assert torch.equal(got[0], ref.gate_proj(_x(0)))
    assert torch.equal(got[1], ref.up_proj(_x(0) * 2))


def test_a_sibling_called_twice_gets_a_fresh_tensor(mlp_pair):
    """Each sibling takes its slice once: a second call computes again, so no two results share
    memory (an in-place write to one cannot change the other)."""
    mlp, ref, _ = mlp_pair
    got = _run(mlp, lambda x, out: out.extend([mlp.gate_proj(x), mlp.gate_proj(x)]))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], ref.gate_proj(_x(0)))
    got[0].zero_()
    assert torch.equal(got[1], ref.gate_proj(_x(0)))


def test_nothing_is_held_after_the_forward(mlp_pair):
    """Only gate_proj called: the product waits for up_proj until the parent's forward ends, then
    is dropped (the caller's slice is the last reference); outside any forward nothing is shared."""
    mlp, ref, _ = mlp_pair
    got = _run(mlp, lambda x, out: out.append(mlp.gate_proj(x)))
    merged = mlp.gate_up_proj
    assert merged._shared is None and not merged._scope_open
    product = weakref.ref(got[0]._base)
    del got
    assert product() is None
    x = _x(3)
    alone = [mlp.up_proj(x), mlp.gate_proj(x)]  # no parent call: each its own rows
    assert merged._shared is None
    assert torch.equal(alone[0], ref.up_proj(x)) and torch.equal(alone[1], ref.gate_proj(x))


def test_a_forward_that_raises_closes_the_scope(mlp_pair):
    mlp, _, _ = mlp_pair

    def body(x, out):
        out.append(mlp.gate_proj(x))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _run(mlp, body)
    assert mlp.gate_up_proj._shared is None and not mlp.gate_up_proj._scope_open


def test_fused_elementwise_runs_on_merged_siblings(monkeypatch):
    """target/fused.py's MLP (SwiGLU product and the FP8 down projection's quantizer in one compiled
    kernel) takes the merged gate/up columns as it took the separate outputs: the same planes, with
    the merged path's fewer quantizations (the fused one of the down projection is not counted)."""
    from dflash_ipc.target.fused import fuse_elementwise

    model = _qwen35(16)
    counter = Counter(monkeypatch)
    quantize_linears(model.stack, compile_quantizer=False)
    fuse_elementwise(model.stack)
    padded, flat = _batches(11)

    def both() -> list[torch.Tensor]:
        return [p.clone() for p in model.capture(padded)] + [p.clone() for p in model.capture_packed(flat, LENS)]

    q_before, _, want = counter.per_call(both)
    saved = merge_sibling_linears(model.stack)["quantizations_saved"]
    q_after, _, got = counter.per_call(both)
    assert q_after == q_before - 2 * saved
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_the_product_builds_the_merged_stack(monkeypatch):
    """``target.quantization = "fp8"`` through build_target (apply_fp8) merges the siblings; the FP8
    device check is lifted here only so the CPU's ``_scaled_mm`` can stand in for the GPU's."""
    import dflash_ipc.target.model as model_mod

    monkeypatch.setattr(model_mod, "fp8_device_problem", lambda device, dtype: None)
    spec = {**tiny_spec(VOCAB), "linear_num_value_heads": 16}
    built = build_target(TargetConfig(spec=spec, layer_ids=[1, 3, 5], dtype="bfloat16", quantization="fp8"), "cpu")
    assert sum(isinstance(m, MergedFp8Linear) for m in built.stack.modules()) == 6 + 2 + 4  # every MLP, attention, GatedDeltaNet
    attn = built.stack.layers[2].self_attn
    assert attn.qkv_proj.names == ("q_proj", "k_proj", "v_proj") and isinstance(attn.q_proj, Fp8LinearSlice)
    gdn = built.stack.layers[0].linear_attn  # padded ("auto" on this CPU): no document-reset wrapper
    assert gdn.in_proj_merged.names == ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    assert built.stack.layers[0].mlp.gate_up_proj.names == ("gate_proj", "up_proj")
    padded, _ = _batches(3)
    merged = [p.clone() for p in built.capture(padded)]
    unmerge_sibling_linears(built.stack)
    assert all(torch.equal(a, b) for a, b in zip(merged, built.capture(padded), strict=True))


@pytest.mark.gpu
def test_cuda_merged_gemm_is_the_siblings_gemms():
    """On the GPU, at a 27B GatedDeltaNet's widths (5120 -> in_proj_qkv 10240, z 6144, b 48, a 48),
    compiled quantizer: each sibling's columns of the merged GEMM against its own GEMM. cuBLAS may
    sum a wider product in another order, so within one bf16 rounding of the output (rtol 2^-7,
    bf16's relative spacing at worst; atol for results near zero); a sibling's own-rows product
    (the fallback) is its GEMM exactly."""
    from dflash_ipc.target.fp8 import _compiled_quantizer, fp8_device_problem

    if not torch.cuda.is_available() or fp8_device_problem("cuda:0", torch.bfloat16):
        pytest.skip("needs a CUDA GPU of capability >= 8.9")
    g = torch.Generator(device="cuda").manual_seed(0)
    quantize = _compiled_quantizer()
    members = []
    for n in (10240, 6144, 48, 48):
        lin = nn.Linear(5120, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=g)
        members.append(Fp8Linear(lin, quantize))
    merged = MergedFp8Linear(["qkv", "z", "b", "a"], members)
    x = torch.randn(1, 3000, 5120, device="cuda", generator=g).to(torch.bfloat16)
    out = merged(x)
    exact = 0
    for i, member in enumerate(members):
        want = member(x)
        got = out[..., merged.rows[i]]
        exact += int(torch.equal(got, want))
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-3 * want.abs().max().item())
        assert torch.equal(merged.member_output(i, x), want)  # outside a parent's forward: its own rows
    print(f"merged columns bit-equal to the sibling's own GEMM: {exact} of {len(members)}")


@pytest.mark.parametrize("family", ["Llama", "Qwen3_5"])
def test_cached_decoding_on_the_merged_stack_is_the_unmerged_one(family, monkeypatch):
    """What eval runs against an FP8 target: a causal LM decoding on its KV cache (and, for Qwen3.5,
    its recurrent GatedDeltaNet state), one token per forward after the prompt. Merged siblings give
    the unmerged FP8 model's tokens and logits, bit for bit, at every step."""
    import transformers

    torch.manual_seed(0)
    spec = tiny_spec(VOCAB)
    if family == "Llama":
        widths = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        conf = transformers.LlamaConfig(num_hidden_layers=3, **{k: spec[k] for k in widths})
        lm = transformers.LlamaForCausalLM(conf)
    else:
        conf = transformers.Qwen3_5TextConfig(**{**spec, "linear_num_value_heads": 16})
        lm = transformers.Qwen3_5ForCausalLM(conf)
    lm = lm.to(torch.bfloat16).eval()
    quantize_linears(lm.model, compile_quantizer=False)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(4))

    def decode() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            out = lm.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack(out.logits)

    want_ids, want_logits = decode()
    assert merge_sibling_linears(lm.model)["groups"] > 0
    got_ids, got_logits = decode()
    assert torch.equal(got_ids, want_ids) and want_ids.shape[1] == 11 + 12
    assert torch.equal(got_logits, want_logits)
