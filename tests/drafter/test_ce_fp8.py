"""``training.ce_fp8``: the frozen LM head's two GEMMs in the chunked CE in e4m3 (drafter/model/fp8_head.py, chunked_ce.py).

The CPU runs ``torch._scaled_mm`` (slowly), so these tests run the product's FP8 path for real.

Tolerances, from e4m3's precision: 3 mantissa bits round each element to within 2^-4 of itself (a row's
largest maps exactly to 448). A logit sums ``H`` products whose rounding errors are independent, so its
error is about 2^-4 * sqrt(2/3) ~ 5 % of the spread of ``x_h * w_h`` over ``h``, i.e. of the logits' own
standard deviation, with either sign: a row's CE moves by about that (its label's logit; the log-sum-exp
averages the rest), and a sum over ``R`` rows by ``1/sqrt(R)`` of it relatively. Cases keep the logits'
spread at an LM's (std ~1-2): the summed loss within 1 % (relative), each row's input gradient at cosine >
0.97 to the reference and the whole gradient > 0.99 (the softmax seen through 5 %-perturbed logits). The
plumbing itself (scales on the right dimensions, transposes, padding) is held to the GEMM's own rounding:
the FP8 products against the same products of the dequantized operands in fp32, to bf16's 2^-8.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_cpu_config, write_toml
from data.test_draft_vocab import reduced_twin
from test_dflash_loss import loss_case, packed_views, reference_loss, tiny_model

from dflash_ipc.config import ConfigError, DFlashConfig, TrainingConfig, load_config
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.model.fp8_head import Fp8Head, fp8_head_bytes
from dflash_ipc.drafter.training.trainer import DrafterTrainer
from dflash_ipc.platform.e4m3 import E4M3, E4M3_MAX, quantize_rows
from dflash_ipc.runtime.preflight import check_ce_fp8_devices, check_machine

E4M3_REL = 2.0**-4  # half an e4m3 ulp, relative
E4M3_SUB = 2.0**-10  # half the smallest e4m3 subnormal, in units of the scale


def cosine(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
    return F.cosine_similarity(a.double(), b.double(), dim=dim)


def fp8_case(seed: int, rows: int, hidden: int, vocab: int, with_kl: bool, logit_std: float = 2.0):
    """loss_case with the head scaled so that the logits spread like an LM's (std ``logit_std``)."""
    base, w_head, labels, weights, th = loss_case(seed, rows, hidden, vocab, with_kl)
    return base, w_head * (logit_std / hidden**0.5), labels, weights, th


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


# --------------------------------------------------------------------------- the copies


def test_the_head_copies_are_scaled_along_the_dimension_each_gemm_reduces_and_padded_to_16():
    """W per vocabulary row (logits reduce over hidden), W^T per hidden column (dX reduces over the
    vocabulary); every element within e4m3 rounding; unaligned widths (300 x 40) padded with zeros."""
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 40)
    head = Fp8Head.quantize(w)
    assert head.weight.dtype == head.weight_t.dtype == E4M3
    assert head.weight.shape == (304, 48) and head.weight_t.shape == (48, 304)
    assert head.nbytes == fp8_head_bytes(300, 40) == 2 * 304 * 48 + 4 * (304 + 48)
    torch.testing.assert_close(head.weight_scale[0, :300], w.abs().amax(dim=1) / E4M3_MAX)
    torch.testing.assert_close(head.weight_t_scale[0, :40], w.abs().amax(dim=0) / E4M3_MAX)
    assert not head.weight[300:].float().any() and not head.weight[:, 40:].float().any()
    assert not head.weight_t[40:].float().any() and not head.weight_t[:, 300:].float().any()
    for deq, scale in zip(head.dequantized(), (head.weight_scale[0, :300, None], head.weight_t_scale[0, None, :40])):
        err = (deq - w).abs()
        assert bool((err <= torch.maximum(E4M3_REL * w.abs(), E4M3_SUB * scale) * (1 + 1e-6)).all())
        assert deq.abs().amax() > 0 and float(err.max()) > 0  # really rounded
    assert head.made_from(w) and not head.made_from(w.clone())


def test_the_fp8_gemms_are_the_products_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 40, generator=g)
    head = Fp8Head.quantize(w)
    wd, wtd = head.dequantized()
    x = torch.randn(23, 40, generator=g)
    xq, xs = quantize_rows(F.pad(x, (0, head.padded_hidden - 40)))
    logits = head.logits(xq, xs)
    assert logits.shape == (23, 300) and logits.dtype == torch.bfloat16
    expect = (xq.float() * xs)[:, :40] @ wd.t()
    torch.testing.assert_close(logits.float(), expect, rtol=2**-8, atol=1e-4 * float(expect.abs().max()))
    grad = torch.randn(23, 300, generator=g)
    gq, gs = quantize_rows(F.pad(grad, (0, head.padded_rows - 300)))
    dx = head.input_grad(gq, gs)
    assert dx.shape == (23, 40)
    expect = (gq.float() * gs)[:, :300] @ wtd
    torch.testing.assert_close(dx.float(), expect, rtol=2**-8, atol=1e-4 * float(expect.abs().max()))


# --------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("dpace", [False, True])
def test_fp8_loss_and_input_gradient_match_the_reference(with_kl, dpace):
    """The frozen head's path in FP8 against plain autograd (fp32) through the whole logits: the weighted loss,
    the input gradient, D-PACE's weights (from the FP8 CE) and the argmax; 75 rows (chunks of 16: a short
    last one), a vocabulary (300) and hidden width (40) that need padding."""
    base, w_head, labels, weights, th = fp8_case(3, 75, 40, 300, with_kl)
    kl_w = 0.4 if with_kl else 0.0

    def reweight(ce):
        return torch.exp(-ce) + 0.5

    ref_h = base.clone().requires_grad_(True)
    ref_weights = reweight(F.cross_entropy(base @ w_head.T, labels, reduction="none")) if dpace else weights
    ref = reference_loss(ref_h, w_head, labels, ref_weights, th, kl_w)
    (ref * 3.0).backward()
    head = Fp8Head.quantize(w_head)
    hh = base.clone().requires_grad_(True)
    res = L.chunked_lm_loss(
        hh, w_head, labels, weights, 16, target_hidden=th, kl_weight=kl_w, reweight=reweight if dpace else None, fp8_head=head
    )
    (res.loss_sum * 3.0).backward()
    assert abs(res.loss_sum.item() / ref.item() - 1) < 1e-2
    assert abs((res.ce_sum + kl_w * res.kl_sum).item() / ref.item() - 1) < 1e-2
    assert cosine(hh.grad, ref_h.grad) > 0.99
    assert float(cosine(hh.grad, ref_h.grad, dim=1).min()) > 0.97
    if dpace:
        torch.testing.assert_close(res.row_weights, ref_weights.float(), rtol=0.1, atol=0.0)
    # the argmax of 5 %-perturbed logits: the same token wherever the top two are not within that of each other
    top2 = (base @ w_head.T).topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert bool((res.pred == (base @ w_head.T).argmax(-1))[clear].all()) and int(clear.sum()) > 30


def test_without_a_gradient_or_with_a_trainable_head_the_logits_stay_bf16():
    """FP8 serves the frozen head's training step only: a pass without a gradient (held-out) and a trainable
    head get exactly the numbers they get without the copies."""
    base, w_head, labels, weights, _ = fp8_case(4, 30, 32, 200, False)
    head = Fp8Head.quantize(w_head)
    with torch.no_grad():
        plain = L.chunked_lm_loss(base, w_head, labels, weights, 8)
        with_copies = L.chunked_lm_loss(base, w_head, labels, weights, 8, fp8_head=head)
    assert torch.equal(plain.loss_sum, with_copies.loss_sum) and torch.equal(plain.pred, with_copies.pred)
    grads = []
    for copies in (None, head):
        hh, ww = base.clone().requires_grad_(True), w_head.clone().requires_grad_(True)
        L.chunked_lm_loss(hh, ww, labels, weights, 8, fp8_head=copies).loss_sum.backward()
        grads.append((hh.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    with pytest.raises(ValueError, match="fp8_head is of a"):
        L.chunked_lm_loss(base, w_head[:100], labels.clamp(max=99), weights, 8, fp8_head=head)


def test_the_label_entry_outside_the_quantization_keeps_the_softmax_tail():
    """Near-uniform softmax over 65,536 rows that share a direction (as an LM head's do): the tail's sum is
    nearly all of dX. With the label entry (~-1) inside the row's scale, every tail entry falls to e4m3's
    subnormals (about 10 % off in total); taken out, the tail sets its own scale."""
    g = torch.Generator().manual_seed(0)
    r, h, v = 16, 64, 65536
    w = torch.randn(h, generator=g) + 0.3 * torch.randn(v, h, generator=g)
    x = torch.randn(r, h, generator=g) * 0.02
    labels = torch.randint(0, v, (r,), generator=g)
    ref_h = x.clone().requires_grad_(True)
    F.cross_entropy(ref_h @ w.T, labels, reduction="sum").backward()
    head = Fp8Head.quantize(w)
    hh = x.clone().requires_grad_(True)
    L.chunked_lm_loss(hh, w, labels, torch.ones(r), 8, fp8_head=head).loss_sum.backward()
    assert float((hh.grad - ref_h.grad).norm() / ref_h.grad.norm()) < 0.02
    # the label entry left in: what the split avoids
    grad = torch.softmax(x @ w.T, -1).scatter_add(1, labels[:, None], -torch.ones(r, 1))
    gq, gs = quantize_rows(grad)
    unsplit = (gq.float() * gs) @ head.dequantized()[1]
    assert float((unsplit - ref_h.grad).norm() / ref_h.grad.norm()) > 0.05


def test_compiled_chunks_give_the_eager_fp8_numbers(fresh_dynamo):
    """``training.ce_compile`` with ``ce_fp8``: the fused stats, gradient and quantizations (one graph for
    every row count) against the eager in-place path."""
    base, w_head, labels, weights, _ = fp8_case(5, 75, 40, 300, False)
    head = Fp8Head.quantize(w_head)
    out = {}
    for compiled in (False, True):
        hh = base.clone().requires_grad_(True)
        res = L.chunked_lm_loss(hh, w_head, labels, weights, 16, compiled=compiled, fp8_head=head)
        res.loss_sum.backward()
        out[compiled] = (res, hh.grad)
    (eager, g_eager), (comp, g_comp) = out[False], out[True]
    torch.testing.assert_close(comp.loss_sum, eager.loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(comp.pred, eager.pred)
    # an element may round to the neighbouring e4m3 value (the fused scale multiplies where eager divides)
    torch.testing.assert_close(g_comp, g_eager, rtol=0, atol=2 * E4M3_REL * float(g_eager.abs().max()) / 16)
    assert cosine(g_comp, g_eager) > 0.9999


# --------------------------------------------------------------------------- compute_loss, state, bench


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_compute_loss_with_ce_fp8_trains_the_drafter_like_bf16(draft_vocab):
    model, dc = tiny_model(["sliding_attention", "full_attention"], block_size=4, num_anchors=6)
    views = packed_views([24, 19])
    if draft_vocab:
        present = sorted(set(views.token_ids.tolist()))
        model = reduced_twin(model, sorted(set(present[: len(present) * 3 // 4]) | set(range(290, 299))))
    outs = {}
    for fp8 in (False, True):
        model.zero_grad()
        tc = TrainingConfig(ce_chunk_tokens=16, ce_fp8=fp8)
        out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(7))
        out.loss_sum.backward()
        outs[fp8] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    (plain, g_plain), (fp8, g_fp8) = outs[False], outs[True]
    assert model._fp8_head is not None and model._fp8_head.rows == model.lm_head_weight.shape[0]
    assert abs(fp8.loss_sum.item() / plain.loss_sum.item() - 1) < 1e-2 and fp8.weight_sum == plain.weight_sum
    for name, g in g_plain.items():
        assert cosine(g_fp8[name], g) > 0.99, name
    first = model.fp8_head()
    assert model.fp8_head() is first  # quantized once, kept


def test_the_copies_are_neither_state_nor_checkpoint_nor_export(tmp_path):
    from safetensors import safe_open

    from dflash_ipc.drafter.export.layout import export_drafter

    model, dc = tiny_model(["full_attention"], block_size=4)
    keys = set(model.state_dict())
    trainer = DrafterTrainer(model, TrainingConfig(ce_fp8=True), total_steps=10)
    out = L.compute_loss(
        model, packed_views([20, 13]), dc, TrainingConfig(ce_fp8=True, ce_chunk_tokens=16), torch.Generator().manual_seed(0)
    )
    trainer.step(out.loss_sum, out.weight_sum)
    assert model._fp8_head is not None
    state = model.state_dict()
    assert set(state) == keys and all(t.dtype != E4M3 for t in state.values())
    trainer_tensors = [t for _, t in trainer.trainable_tensors()] + list(trainer.moment_tensors().values())
    assert all(t.dtype != E4M3 for t in trainer_tensors)
    assert all(t.dtype != E4M3 for t in tensors_in(trainer.state_dict()))
    export_drafter(model, tmp_path / "export")
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() != "F8_E4M3" for k in f.keys())
        exported = set(f.keys())
    fresh, _ = tiny_model(["full_attention"], block_size=4)
    export_drafter(fresh, tmp_path / "fresh")
    with safe_open(str(tmp_path / "fresh" / "model.safetensors"), "pt") as f:
        assert exported == set(f.keys())
    trainer.close()


def test_a_moved_head_gets_new_copies():
    model, _ = tiny_model(["full_attention"])
    first = model.fp8_head()
    model.to(torch.float64)  # a new head tensor: the copies of the old one no longer serve
    second = model.fp8_head()
    assert second is not first and second.made_from(model.lm_head_weight)


def test_the_bench_times_ce_fp8_as_a_variant():
    from dflash_ipc.bench.drafter_step import variant_config, variant_overrides

    assert variant_overrides("ce-fp8+ce-compile") == {"drafter": {}, "training": {"ce_fp8": True, "ce_compile": True}}
    assert variant_config(DFlashConfig(), "ce-fp8").training.ce_fp8


# --------------------------------------------------------------------------- the device check


def test_ce_fp8_is_refused_on_a_gpu_older_than_8_9_naming_the_key(monkeypatch, tmp_path):
    """The preflight's machine check (the probe runs it before any process starts) on an A100 stand-in: torch's
    CUDA queries answer as one would."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    path = write_toml(
        tmp_path / "run.toml",
        tiny_cpu_config(topology={"targets": ["cuda:0"], "drafters": ["cuda:0"]}, transport={"backend": "auto"}, training={"ce_fp8": True}),
    )
    with pytest.raises(ConfigError) as ei:
        check_machine(load_config(path))
    msg = str(ei.value)
    assert ei.value.key == "training.ce_fp8" and msg.startswith(f"{path}: training.ce_fp8:")
    assert "topology.drafters[0] = 'cuda:0'" in msg and "8.0" in msg and "A100" in msg and "training.ce_fp8 = false" in msg
    check_ce_fp8_devices("run.toml", False, ["cuda:0"])  # off: nothing to check
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_ce_fp8_devices("run.toml", True, ["cuda:0", "cpu"])  # Hopper, and the CPU (slow, for tests)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_on_the_gpu_the_loss_runs_scaled_mm_compiled_and_matches_bf16(fresh_dynamo):
    """bf16 hidden states and head at a head's real alignment, ``ce_compile`` on: the profile shows the FP8
    GEMM (two per chunk), and the numbers match the bf16 path within e4m3's tolerance."""
    from dflash_ipc.platform.e4m3 import fp8_device_problem

    if problem := fp8_device_problem("cuda:0"):
        pytest.skip(problem)
    dev = torch.device("cuda:0")
    g = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 3000, 1024, 32768
    base = torch.randn(rows, hidden, generator=g).to(dev, torch.bfloat16)
    w_head = (torch.randn(vocab, hidden, generator=g) * (2.0 / hidden**0.5)).to(dev, torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(dev)
    weights = torch.rand(rows, generator=g).to(dev)
    head = Fp8Head.quantize(w_head)
    results = {}
    for copies in (None, head):
        for _ in range(2):  # the second call runs the compiled graphs
            hh = base.clone().requires_grad_(True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                res = L.chunked_lm_loss(hh, w_head, labels, weights, 1024, compiled=True, fp8_head=copies)
                res.loss_sum.backward()
                torch.cuda.synchronize()
        ops = {e.key: e for e in prof.key_averages()}
        results[copies is not None] = (res.loss_sum.item(), hh.grad.float(), ops)
    (ref_loss, ref_grad, ref_ops), (loss, grad, ops) = results[False], results[True]
    assert "aten::_scaled_mm" not in ref_ops
    scaled = ops["aten::_scaled_mm"]
    assert scaled.count == 2 * 3  # two GEMMs per chunk, three chunks
    assert getattr(scaled, "device_time_total", getattr(scaled, "cuda_time_total", 0)) > 0
    assert abs(loss / ref_loss - 1) < 1e-2
    assert cosine(grad, ref_grad) > 0.99 and float(cosine(grad, ref_grad, dim=1).min()) > 0.97
