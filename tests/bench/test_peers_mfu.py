"""benchmarks/peers/summarize.py's MFU: its target and drafter FLOP counts are the matmuls torch counts in a
real transformers forward and a real dflash-ipc drafter step, and both trainers at one shape and anchor
budget count the same FLOPs, so their MFU ratio is their tokens/s ratio."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from dflash_ipc.bench.drafter_step import gemm_flops, synthetic_batches
from dflash_ipc.config import load_config
from dflash_ipc.config.drafter import DrafterConfig
from dflash_ipc.drafter.loss.objective import compute_loss
from dflash_ipc.drafter.model.build import drafter_for_target
from dflash_ipc.target_spec.hf_config import resolve_layer_ids

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
RESULTS = PEERS / "results-h200-2026-12-03.jsonl"
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm")


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("peers_summarize", PEERS / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _matmul_flops(counter: FlopCounterMode, ops=MATMULS) -> int:
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) in ops)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3", "tiny-qwen3.5"])
def test_target_count_is_what_a_real_forward_multiplies(summarize, shape):
    cfg = summarize.hf_config(shape)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    batch, seq = 2, 48
    tokens = batch * seq
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 100, (batch, seq)), output_hidden_states=True, use_cache=False)
    layers = model.model.layers
    # the GatedDeltaNet's depthwise conv kernels: counted at 2 FLOPs per weight per token, a convolution in torch
    conv = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Conv1d))
    assert (conv > 0) == (shape == "tiny-qwen3.5")
    # the whole CausalLM with its head: SpecForge's causal-lm forward, as run (its recurrence's bmm left out)
    assert _matmul_flops(counter, ("aten.mm", "aten.addmm")) + 2 * conv * tokens == summarize.target_flops(
        shape, tokens, len(layers), head=True
    )
    for n in (1, 3, len(layers)):  # through the last captured layer: every matmul weight of layers 0..n-1
        weights = sum(p.numel() for p in layers[:n].parameters() if p.dim() >= 2)
        assert summarize.target_flops(shape, tokens, n) == 2 * weights * tokens
    assert summarize.target_flops(shape, tokens, 3) < summarize.target_flops(shape, tokens, 4)


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen3"])
def test_drafter_count_is_gemm_flops_of_the_real_drafter_and_what_its_step_multiplies(summarize, shape):
    block = summarize.SHAPES[shape]["drafter"]["block_size"]
    tiny = load_config(str(ROOT / "configs" / "tiny-cpu.toml"))
    cfg = dataclasses.replace(
        tiny,
        target=dataclasses.replace(tiny.target, model_path="", tokenizer="builtin", spec={}, num_capture_layers=5),
        drafter=DrafterConfig(block_size=block, num_anchors=16, dtype="float32", attention="sdpa", warm_up=False),
    )
    hf = summarize.hf_config(shape)
    layer_ids = resolve_layer_ids(cfg.target, int(hf.num_hidden_layers))
    assert layer_ids == summarize.default_layer_ids(int(hf.num_hidden_layers), summarize.DRAFT_LAYERS)
    model = drafter_for_target(cfg, hf, layer_ids, int(hf.vocab_size) - 1, "cpu")
    assert model.config == summarize.drafter_model_config(shape, block)
    tokens = 512
    (views,) = synthetic_batches(model, cfg, 1, tokens, 128, 1.0)
    with FlopCounterMode(display=False) as counter:
        out = compute_loss(model, views, cfg.drafter, cfg.training, torch.Generator().manual_seed(0))
        out.loss_sum.backward()
    anchors, rows = out.num_query_tokens // block, int(out.count_per_pos.sum())
    assert out.num_query_tokens == anchors * block and 0 < rows <= anchors * (block - 1)
    counted = summarize.drafter_flops(shape, anchors, tokens, block)
    assert counted == sum(gemm_flops(model, tokens, anchors * block, anchors * (block - 1)))
    # every block row counted: the rows a block loses past its document's end are the only difference
    h, vocab = model.config.hidden_size, model.config.vocab_size
    assert _matmul_flops(counter) == counted - 4 * (anchors * (block - 1) - rows) * h * vocab


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rows_get_combined_and_drafter_mfu_and_the_same_flops_for_both_trainers(summarize, tmp_path, capsys):
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.startswith("{")]
    sf = next(r for r in rows if r["trainer"].startswith("specforge") and r["shape"] == "qwen3-8b" and r["anchors_per_step"] == 4096)
    ipc = next(r for r in rows if r["trainer"] == "dflash-ipc" and r["shape"] == "qwen3-8b" and r["variant"] == "parity")
    f_sf, f_ipc = summarize.row_figures(sf), summarize.row_figures(ipc)
    assert f_sf["target_flops"] == f_ipc["target_flops"] > 0 and f_sf["drafter_flops"] == f_ipc["drafter_flops"] > 0
    ran = ipc["variants"]["cuda-ipc"]["targets"][0]["layers_run"]  # the layers dflash-ipc's target ran
    assert f_ipc["target_flops"] == summarize.target_flops("qwen3-8b", sf["tokens_per_step"], ran)
    rate_ipc = ipc["variants"]["cuda-ipc"]["tokens_per_s"]
    assert f_ipc["mfu"] / f_sf["mfu"] == pytest.approx(rate_ipc / sf["tokens_per_s"], rel=1e-3)
    peak = summarize.PEAK_TFLOPS * 1e12
    assert f_sf["drafter_mfu"] == f_sf["drafter_flops"] / sf["steady_drafter_s_mean"] / peak
    assert f_ipc["drafter_mfu"] == f_ipc["drafter_flops"] / ipc["variants"]["cuda-ipc"]["drafter_step_split_s"]["step_s"] / peak
    assert f_sf["mfu_as_run"] > f_sf["mfu"] and "mfu_as_run" not in f_ipc  # the 2 layers past layer 33 and the head
    mixed = [r | {"lengths": "mixed"} for r in (sf, ipc)]
    _write_rows(tmp_path / "r.jsonl", rows + mixed)
    summarize.main([str(tmp_path / "r.jsonl")])
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-3:] == ["drafter", "MFU", "notes"]
    assert f"combined MFU dflash-ipc {f_ipc['mfu']:.2f} vs SpecForge {f_sf['mfu']:.2f}" in out
    assert f"combined MFU dflash-ipc ≤{f_ipc['mfu']:.2f} vs SpecForge ≤{f_sf['mfu']:.2f}" in out  # anchors a cap
    assert out.count("combined MFU dflash-ipc") == sum(r["trainer"] == "dflash-ipc" for r in rows) + 1
