"""drafter.fp8_linears: the drafter's trainable linears trained through torchao's float8 training.

Which linears convert (at the Qwen3-8B and Qwen3.6-27B widths, on the meta device), the numerics of a real
drafter step on the CPU (torch's CPU ``_scaled_mm``: FP8 rounding, no speed) against the same step without
FP8, checkpoints and the export across the two, the refusals (config, preflight, torchao missing), the bench
variant; on a GPU, the compiled step really multiplies in FP8 and keeps the bf16 step's loss.

oneDNN is off for these tests (``cpu_scaled_mm_without_onednn``): on a CPU with AMX-INT8 and without AMX-FP8, torch
sends ``_scaled_mm`` to oneDNN's reference FP8 kernel (~0.5 s per call at these shapes, ~180 s for the module on 2
cores); without oneDNN torch multiplies the same e4m3 operands in fp32 and applies the same scales (the same losses
and gradients on this CPU, ~50 times faster), and every CPU runs the same kernel.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file
from torch import nn

from dflash_ipc.bench.drafter_step import RANDOM_TARGETS, build_bench_drafter, synthetic_batches, variant_config, variant_overrides
from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, DrafterConfig, load_config
from dflash_ipc.drafter.checkpoint.store import BatchLedger, load_latest_checkpoint, rng_state, save_checkpoint
from dflash_ipc.drafter.export.from_checkpoint import export_checkpoint
from dflash_ipc.drafter.export.layout import export_drafter
from dflash_ipc.drafter.loss.objective import compute_loss
from dflash_ipc.drafter.model.build import build_drafter
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.drafter.model.fp8_linears import convert_fp8_linears, fp8_linear_names, skip_reason
from dflash_ipc.drafter.training.trainer import DrafterTrainer
from dflash_ipc.runtime.preflight import check_environment, check_fp8_linears

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
CPU = torch.device("cpu")
LINEAR_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def cpu_scaled_mm_without_onednn(monkeypatch):
    """torch's CPU ``_scaled_mm`` without oneDNN (module docstring); the FP8 rounding is torchao's, before the call."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)


def _meta_drafter(shape: str, monkeypatch) -> DFlashDrafter:
    """A 5-layer drafter at ``shape``'s widths (whole-vocabulary head), on the meta device: shapes without memory
    (and without the seeded draw of its weights, which happens on the host)."""
    monkeypatch.setattr(DFlashDrafter, "reset_parameters", lambda self, seed: None)
    hf = RANDOM_TARGETS[shape]()
    cfg = DrafterModelConfig.from_configs(DrafterConfig(), hf, [1, 9, 17, 25, 33], 0)
    head = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    return DFlashDrafter(cfg, head, head, attention="sdpa", device="meta", init_seed=0)


def _hide_torchao(monkeypatch) -> None:
    """torchao as on a machine without it: every import of it fails (None in sys.modules)."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)


# --------------------------------------------------------------------------- which linears convert


@pytest.mark.parametrize(
    ("shape", "recipe", "converted", "kept"),
    [
        # k/v (1024 x 4096 / 5120) are below torchao's rowwise size for a gain; everything else converts
        ("qwen3-8b", "rowwise", 26, {"k_proj", "v_proj"}),
        ("qwen3.6-27b", "rowwise", 26, {"k_proj", "v_proj"}),
        # tensorwise keeps only K <= 4096 and N <= 1024: 8B's k/v; 27B's 5120-wide inputs convert
        ("qwen3-8b", "tensorwise", 26, {"k_proj", "v_proj"}),
        ("qwen3.6-27b", "tensorwise", 36, set()),
        # 576-wide: nothing gains under rowwise
        ("smollm2-135m", "rowwise", 0, {"fc", *LINEAR_KINDS}),
    ],
)
def test_the_linears_that_gain_convert_and_names_and_state_stay(shape, recipe, converted, kept, monkeypatch):
    model = _meta_drafter(shape, monkeypatch)
    before = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    result = convert_fp8_linears(model, recipe)
    assert len(result.converted) == converted and len(result.converted) + len(result.kept) == 36
    assert {n.rsplit(".", 1)[-1] for n in result.kept} == kept
    assert sorted(fp8_linear_names(model)) == sorted(result.converted)
    # Float8Linear holds the very Parameters it replaced: the trainer, the checkpoint and the export see no change
    assert {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} == before
    assert all(p is params[n] for n, p in model.named_parameters())
    assert f"{converted} of 36 linear layers train in FP8" in result.describe()


def test_skip_reasons_frozen_unaligned_small_and_the_size_floor_off():
    assert skip_reason(nn.Linear(4096, 4096), "rowwise") is None
    assert "too small" in skip_reason(nn.Linear(576, 576), "rowwise")
    assert skip_reason(nn.Linear(576, 576), "rowwise", size_floor=False) is None
    assert "multiples of 16" in skip_reason(nn.Linear(4096, 4100), "rowwise", size_floor=False)
    frozen = nn.Linear(4096, 4096).requires_grad_(False)
    assert skip_reason(frozen, "rowwise") == "frozen"
    assert skip_reason(nn.Embedding(10, 16), "rowwise") == "not a linear layer"


def test_the_build_converts_as_the_config_says_and_logs_how_many(caplog):
    # 1040-wide SwiGLU: gate/up (N = 1040 > 1024) gain under tensorwise; the 64-wide rest does not
    sets = ["drafter.intermediate_size=1040", "drafter.fp8_linears='tensorwise'"]
    with caplog.at_level(logging.INFO, logger="dflash_ipc.drafter.model.build"):
        model = build_drafter(load_config(str(TINY), sets=sets), CPU, log_mask_token=False)
    assert sorted(fp8_linear_names(model)) == [f"layers.{i}.mlp.{k}" for i in (0, 1) for k in ("gate_proj", "up_proj")]
    assert "'tensorwise': 4 of 15 linear layers train in FP8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash_ipc.drafter.model.build"):
        model = build_drafter(load_config(str(TINY), sets=["drafter.fp8_linears='rowwise'"]), CPU, log_mask_token=False)
    assert fp8_linear_names(model) == []
    assert "0 of 15" in caplog.text and "no linear layer of this drafter is large enough" in caplog.text


# --------------------------------------------------------------------------- numerics of a real step


def _tiny(recipe: str):
    """The tiny config's drafter (fp32, same seed), every aligned linear in FP8 under ``recipe`` (size floor off)."""
    cfg = load_config(str(TINY))
    model = build_bench_drafter(cfg, CPU, random_target=False)
    if recipe != "none":
        assert len(convert_fp8_linears(model, recipe, size_floor=False).converted) == 15
    return cfg, model


def _loss_and_grads(cfg, model, views):
    model.zero_grad(set_to_none=True)
    out = compute_loss(model, views, cfg.drafter, cfg.training, torch.Generator().manual_seed(0))
    out.loss_sum.backward()
    return float(out.loss_sum / out.weight_sum), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fp8_first_step_gradients_point_where_the_fp32_ones_do(recipe):
    cfg, ref = _tiny("none")
    (views,) = synthetic_batches(ref, cfg, 1, 700, 90, 0.7)
    loss_ref, grads_ref = _loss_and_grads(cfg, ref, views)
    _, model = _tiny(recipe)
    loss, grads = _loss_and_grads(cfg, model, views)
    # e4m3 keeps 3 mantissa bits: each product is a few % off, the loss over ~1,000 rows far less
    assert abs(loss - loss_ref) / loss_ref < 1e-3
    converted = fp8_linear_names(model)
    for name in converted:
        g, g_ref = grads[f"{name}.weight"].flatten(), grads_ref[f"{name}.weight"].flatten()
        assert float(F.cosine_similarity(g, g_ref, dim=0)) > 0.99, name
        assert not torch.equal(g, g_ref), f"{name}: the FP8 path was not taken"


def _train(recipe: str, steps: int = 4):
    cfg, model = _tiny(recipe)
    trainer = DrafterTrainer(model, cfg.training, total_steps=cfg.training.max_steps)
    batches = synthetic_batches(model, cfg, 2, 600, 80, 0.7, seed=1)
    losses = []
    for i in range(steps):
        out = compute_loss(model, batches[i % 2], cfg.drafter, cfg.training, torch.Generator().manual_seed(i))
        losses.append(trainer.step(out.loss_sum, out.weight_sum).global_loss)
    return cfg, model, trainer, losses


def test_fp8_training_steps_follow_the_fp32_ones():
    _, _, _, plain = _train("none")
    _, _, _, fp8 = _train("rowwise")
    assert all(torch.isfinite(torch.tensor(fp8)))
    assert fp8[2] < fp8[0] and fp8[3] < fp8[1]  # each batch's loss went down (the two batches alternate)
    for a, b in zip(fp8, plain):
        assert abs(a - b) / b < 5e-3


# --------------------------------------------------------------------------- checkpoints and export


def _save(trainer: DrafterTrainer, root: Path, cfg) -> Path:
    """The drafter process's checkpoint layout (DrafterCore): master weights and moments streamed, the config in extra."""
    return save_checkpoint(
        root,
        trainer.step_count,
        model_state=dict(trainer.trainable_tensors()),
        trainer_state=trainer.state_dict(include_master=False, include_moments=False),
        optimizer_tensors=trainer.moment_tensors(),
        rng_state=rng_state(),
        ledger=BatchLedger(),
        extra={"config": cfg.to_dict()},
    )


def _resume(recipe: str, root: Path) -> tuple[DFlashDrafter, DrafterTrainer]:
    cfg, model = _tiny(recipe)
    trainer = DrafterTrainer(model, cfg.training, total_steps=cfg.training.max_steps)
    ckpt = load_latest_checkpoint(root)
    trainer.load_state_dict(ckpt.trainer_state, master=ckpt.model_state, moments=ckpt.optimizer_tensors)
    return model, trainer


@pytest.mark.parametrize(("trained", "resumed"), [("rowwise", "none"), ("none", "rowwise")])
def test_a_checkpoint_resumes_with_or_without_fp8(tmp_path, trained, resumed):
    cfg, model, trainer, _ = _train(trained, steps=2)
    _save(trainer, tmp_path, cfg)
    other, other_trainer = _resume(resumed, tmp_path)
    assert bool(fp8_linear_names(other)) == (resumed != "none")
    assert other_trainer.step_count == 2
    mine, theirs = model.state_dict(), other.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # and it trains on from there: a step of either kind lands close to the other
    batch = synthetic_batches(model, cfg, 1, 600, 80, 0.7, seed=5)[0]
    for m, t in ((model, trainer), (other, other_trainer)):
        out = compute_loss(m, batch, cfg.drafter, cfg.training, torch.Generator().manual_seed(9))
        t.step(out.loss_sum, out.weight_sum)
    for k in mine:
        torch.testing.assert_close(model.state_dict()[k], other.state_dict()[k], rtol=0, atol=2 * cfg.training.lr)


def test_the_export_of_an_fp8_run_is_a_plain_drafter_and_needs_no_torchao(tmp_path, monkeypatch):
    cfg, model, trainer, _ = _train("rowwise", steps=2)
    cfg = load_config(str(TINY), sets=["drafter.fp8_linears='rowwise'"])  # the run's config says FP8
    run = tmp_path / "run"  # an export goes outside the run directory it reads
    _save(trainer, run / "checkpoints", cfg)
    direct = export_drafter(model, tmp_path / "direct")
    _hide_torchao(monkeypatch)
    result = export_checkpoint(run / "checkpoints", tmp_path / "export")
    exported, live = load_file(str(result.out / "model.safetensors")), load_file(str(direct / "model.safetensors"))
    assert exported.keys() == live.keys() and {f"{n}.weight" for n in fp8_linear_names(model)} <= exported.keys()
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert all(torch.equal(exported[k], live[k]) for k in live)


# --------------------------------------------------------------------------- refusals


def test_the_config_names_the_key_and_the_recipes():
    with pytest.raises(ValueError, match=r"must be one of 'none', 'rowwise', 'tensorwise' \(got 'fast'\)"):
        DrafterConfig(fp8_linears="fast")
    with pytest.raises(ConfigError, match=r"--set drafter\.fp8_linears: must be one of 'none', 'rowwise', 'tensorwise'"):
        load_config(str(TINY), sets=["drafter.fp8_linears='fast'"])
    assert DrafterConfig().fp8_linears == "none"


def test_preflight_refuses_without_torchao_and_where_fp8_cannot_run(monkeypatch):
    cfg = load_config(str(TINY), sets=["drafter.fp8_linears='rowwise'"])
    check_environment(cfg)  # the CPU runs it: accepted
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"drafter\.fp8_linears: \"rowwise\" on topology\.drafters\[0\] = 'cuda:0': .*no CUDA device"):
            check_fp8_linears("run.toml", "rowwise", ["cuda:0"])
    check_fp8_linears("run.toml", "none", ["cuda:7"])  # off: nothing to check
    _hide_torchao(monkeypatch)
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    assert "drafter.fp8_linears" in str(err.value) and str(TINY) in str(err.value)
    assert "pip install 'dflash-ipc[fp8]' (or pip install torchao)" in str(err.value)
    with pytest.raises(ValueError, match=r"pip install 'dflash-ipc\[fp8\]'"):
        build_drafter(cfg, CPU, log_mask_token=False)


# --------------------------------------------------------------------------- the bench


def test_the_bench_reaches_fp8_by_a_variant(tmp_path):
    assert variant_overrides("compile+fp8-rowwise")["drafter"] == {"compile": True, "fp8_linears": "rowwise"}
    with pytest.raises(ValueError, match=r"variant 'fp8-fast': drafter\.fp8_linears: must be one of"):
        variant_config(load_config(str(TINY)), "fp8-fast")
    out = tmp_path / "step.json"
    sets = ["--set", "drafter.intermediate_size=1040"]
    args = ["bench", "drafter-step", "--config", str(TINY), "--variants", "base,fp8-tensorwise", "--steps", "1", "--batches", "1"]
    r = CliRunner().invoke(main, [*args, "--tokens", "400", "--doc-len", "80", "--out", str(out), *sets])
    assert r.exit_code == 0, r.output
    variants = json.loads(out.read_text())["variants"]
    assert variants["base"]["fp8_linear_layers"] == 0 and variants["fp8-tensorwise"]["fp8_linear_layers"] == 4
    assert variants["fp8-tensorwise"]["overrides"]["drafter"] == {"fp8_linears": "tensorwise"}
    base, fp8 = variants["base"]["loss_step0"], variants["fp8-tensorwise"]["loss_step0"]
    assert base != fp8 and abs(fp8 - base) / base < 1e-2


# --------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_step_multiplies_in_fp8_and_keeps_the_bf16_loss():
    """Qwen3-8B widths, one layer, bf16, compiled: the converted layers run ``_scaled_mm`` (seen by the profiler),
    the loss stays within FP8 rounding of the bf16 step's and the converted layers' gradients point the same way."""
    from dflash_ipc.drafter.model.fp8_linears import fp8_linears_problem

    if not torch.cuda.is_available() or fp8_linears_problem("cuda:0"):
        pytest.skip("needs a CUDA GPU of capability >= 8.9 and torchao")
    torch._dynamo.reset()
    dev = torch.device("cuda:0")
    base = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "smollm2-1gpu-synth.toml"))
    sets = {"num_layers": 1, "layer_types": ["full_attention"], "dtype": "bfloat16", "compile": True, "draft_vocab_size": 0}

    def run(recipe: str):
        cfg = variant_config(base, f"fp8-{recipe}")
        cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, **sets))
        model = build_bench_drafter(cfg, dev, random_target=True, shape="qwen3-8b")
        # 4,090 tokens: context rows (fc, k/v) and a weight gradient's inner dimension no multiple of 16
        views = synthetic_batches(model, cfg, 2, 4090, 1024, 0.8, seed=0)
        grads = []
        for v in views:  # two shapes: the second must not fail on a row count that is no multiple of 16
            model.zero_grad(set_to_none=True)
            out = compute_loss(model, v, cfg.drafter, cfg.training, torch.Generator(device=dev).manual_seed(0))
            out.loss_sum.backward()
            grads.append(
                (float(out.loss_sum / out.weight_sum), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
            )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = compute_loss(model, views[0], cfg.drafter, cfg.training, torch.Generator(device=dev).manual_seed(0))
            out.loss_sum.backward()
            torch.cuda.synchronize()
        scaled = sum(e.count for e in prof.key_averages() if "scaled_mm" in e.key)
        return model, grads, scaled

    plain, grads_plain, scaled_plain = run("none")
    fp8, grads_fp8, scaled_fp8 = run("rowwise")
    names = fp8_linear_names(fp8)
    assert len(names) == 6 and not fp8_linear_names(plain)  # fc, q, o, gate, up, down (k/v too small)
    assert scaled_plain == 0 and scaled_fp8 >= 3 * len(names)  # forward, input and weight gradients
    for (loss_p, g_p), (loss_f, g_f) in zip(grads_plain, grads_fp8):
        assert abs(loss_f - loss_p) / loss_p < 2e-2
        for name in names:
            assert float(F.cosine_similarity(g_f[f"{name}.weight"].flatten(), g_p[f"{name}.weight"].flatten(), dim=0)) > 0.99, name
