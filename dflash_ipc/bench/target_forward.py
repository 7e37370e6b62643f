"""The target's forward alone, in this process: padded vs packed, bf16 vs FP8, on the same batches.

``dflash-ipc bench target-forward --config C --out F.json [--layers N] [--batches K]``

* **Batches**: the first ``K`` batches of the config's own epoch plan (``data.*``: bucketing,
  token budget), collated as the target role does: the same batches ``bench pipeline`` forwards.
* **Model**: the config's target (``target.spec`` random weights, or ``target.model_path``),
  built once with ``target.varlen = true``; with ``--layers N`` a spec target keeps its first N
  decoder layers (the real per-layer shapes; ratios, not whole-model times), capturing
  ``target.num_capture_layers`` layers spread from layer 1 to layer N-1 (so all N run). Without
  it the config's own capture layers, as the pipeline runs them (up to the last captured one).
* **Variants** (each: ``--warmup-passes`` untimed passes over all K batches, then all K timed,
  each CUDA-synchronized; see :func:`time_variant` for why every batch is warmed):
  ``padded`` (``capture`` of the right-padded [B, L] batch) and ``packed`` (``capture_packed``:
  the real tokens in one row); then the same model's linear layers are quantized in place
  (:func:`~dflash_ipc.target.fp8.quantize_linears`), the siblings sharing an input merged as the
  product builds them (:mod:`~dflash_ipc.target.fp8_merge`), and ``padded-fp8`` / ``packed-fp8`` run;
  with ``--fp8-unmerged`` (default) also ``packed-fp8-unmerged`` (each projection quantizing its
  own input, the merge's baseline in the same run; ``-fused`` too with ``--fuse``).
  Those four come first; the profiles and the fused variants after (FP8 first, then the bf16
  linears are put back for theirs), so a run cut short loses the extras, not the headline.
  Throughput counts real tokens; MFU is :func:`~dflash_ipc.target.flops.forward_flops` of the
  real lengths over the time, against ``--peak-tflops`` (bf16 dense: FP8 MFU reads on the same
  scale, so FP8 can pass 100 % of it).
* **Agreement**: the captured planes of the first ``--agree-batches`` batches, packed, bf16 vs
  FP8: per captured layer, relative error ``||fp8 - bf16|| / ||bf16||`` and the cosine of each
  token's hidden state (mean and min), over real tokens only.
* **Profile** (``--profile``): one packed and one padded forward of the first batch in bf16
  and one packed in FP8 under ``torch.profiler``, by op class (:mod:`~dflash_ipc.bench.op_profile`).
* **Fused** (``--fuse``): ``packed-bf16-fused`` and ``packed-fp8-fused``, the same packed forward
  with the norms and SwiGLU (and the FP8 down projection's quantizer) fused by
  :mod:`~dflash_ipc.target.fused` (profiled too), and its FP8-vs-bf16 agreement.

Everything lands in one JSON (``--out``, rewritten after each step so a run cut short keeps what
it measured) and a progress line per step on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_ipc.bench.op_profile import format_table, profile_classes
from dflash_ipc.config import DFlashConfig, load_config
from dflash_ipc.target.model import TargetModel, build_target

VARIANTS = ("padded", "packed")


def _echo(msg: str) -> None:
    print(f"[target-forward {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spec_with_layers(spec: dict[str, Any], n: int) -> dict[str, Any]:
    """``spec`` cut to its first ``n`` decoder layers (same widths, same layer-type pattern)."""
    out = dict(spec)
    total = int(out.get("num_hidden_layers", n))
    if n > total:
        raise ValueError(f"--layers {n} but the target has {total}")
    out["num_hidden_layers"] = n
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = list(out["layer_types"])[:n]
    return out


def target_config(cfg: DFlashConfig, layers: int) -> Any:
    """The config's target, packed-capable, optionally cut to ``layers`` layers."""
    t = dataclasses.replace(cfg.target, varlen=True, quantization="none", capture_last_hidden=False, fuse_elementwise=False)
    if layers and not t.model_path:
        # spread from layer 1 to the last kept one, so every kept layer runs
        k = min(max(2, t.num_capture_layers), layers)
        ids = sorted({round(1 + i * (layers - 2) / (k - 1)) for i in range(k)}) if layers > 2 else list(range(layers))
        t = dataclasses.replace(t, spec=spec_with_layers(t.spec, layers), layer_ids=ids)
    return t


def plan_batches(cfg: DFlashConfig, n: int, cache_dir: Path) -> tuple[list[tuple[torch.Tensor, list[int]]], int, float]:
    """The first ``n`` batches of epoch 0 (one shard), as (right-padded ids [B, L], lengths);
    the tokenizer's vocabulary size; the padding share of the whole epoch's plan (%)."""
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.plan import plan_epoch, plan_stats
    from dflash_ipc.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.target.tokenizer)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    corpus = load_corpus(cfg.data, tok, cache_dir)
    out = []
    for b in plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, 0, 1, 0)[:n]:
        ids, _, lens = corpus.collate(b.sample_indices, pad)
        out.append((ids, [int(x) for x in lens]))
    return out, len(tok), float(plan_stats(corpus.lengths, cfg.data, cfg.run.seed)["padding_waste_pct"])


def _flat(ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    return torch.cat([ids[i, :n] for i, n in enumerate(lens)])


def _sync(model: TargetModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def run_one(model: TargetModel, variant: str, ids: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    if variant == "packed":
        return model.capture_packed(_flat(ids, lens).to(model.device, non_blocking=True), lens)
    return model.capture(ids.to(model.device, non_blocking=True))


def time_variant(model: TargetModel, variant: str, batches, peak_tflops: float, warmup_passes: int = 1) -> dict[str, Any]:
    """``warmup_passes`` untimed passes over **every** batch, then one timed pass over all of them,
    each batch CUDA-synchronized.

    Every batch of a plan has its own shape, and the first call of a shape pays for fla's Triton
    autotuning, ``torch.compile``'s recompiles and cuBLAS's heuristics, often many times the
    forward itself: a warm-up over a few batches leaves those costs in the timed pass, and in
    the first variant's most of all (later variants reuse what it tuned). So each variant visits every batch before its
    timed pass; the warm-up's own time is kept (``warmup_s``) to show what it absorbed."""
    if warmup_passes < 1:
        raise ValueError(f"warmup_passes must be >= 1 (a timed first call of a shape is not a throughput); got {warmup_passes}")
    t0 = time.perf_counter()
    for _ in range(warmup_passes):
        for ids, lens in batches:
            run_one(model, variant, ids, lens)
    _sync(model)
    warmup_s = time.perf_counter() - t0
    times = []
    for ids, lens in batches:
        t0 = time.perf_counter()
        run_one(model, variant, ids, lens)
        _sync(model)
        times.append(time.perf_counter() - t0)
    real = sum(sum(lens) for _, lens in batches)
    computed = sum(ids.numel() for ids, _ in batches) if variant == "padded" else real
    flops_real = sum(model.forward_flops(lens) for _, lens in batches)
    total = sum(times)
    return {
        "variant": variant,
        "batches": len(batches),
        "warmup_passes": warmup_passes,
        "warmup_s": round(warmup_s, 2),
        "seconds": round(total, 4),
        "real_tokens": real,
        "computed_tokens": computed,
        "padding_pct": round(100.0 * (computed - real) / computed, 2),
        "tokens_per_s": round(real / total, 1),
        "tflops_real": round(flops_real / total / 1e12, 2),
        "mfu_real": round(flops_real / total / 1e12 / peak_tflops, 4),
        "per_batch_ms": [round(1e3 * t, 1) for t in times],
    }


def agreement(ref: list[list[torch.Tensor]], test: list[list[torch.Tensor]], layer_ids: list[int]) -> list[dict[str, Any]]:
    """Per captured layer over the given batches' planes ([1, n, H], real tokens only)."""
    rows = []
    for j, layer in enumerate(layer_ids):
        a = torch.cat([r[j].reshape(-1, r[j].shape[-1]) for r in ref]).float()
        b = torch.cat([t[j].reshape(-1, t[j].shape[-1]) for t in test]).float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        rows.append(
            {
                "layer": layer,
                "rel_error": round(((b - a).norm() / a.norm().clamp_min(1e-30)).item(), 5),
                "cos_mean": round(cos.mean().item(), 6),
                "cos_min": round(cos.min().item(), 6),
                "tokens": int(a.shape[0]),
            }
        )
    return rows


def format_agreement(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [title, f"  {'layer':>6}{'rel err':>10}{'cos mean':>11}{'cos min':>10}{'tokens':>9}"]
    for r in rows:
        lines.append(f"  {r['layer']:>6}{r['rel_error']:>10.4f}{r['cos_mean']:>11.6f}{r['cos_min']:>10.6f}{r['tokens']:>9}")
    return "\n".join(lines)


def _planes(model: TargetModel, batches) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in run_one(model, "packed", ids, lens)] for ids, lens in batches]


@dataclasses.dataclass
class ForwardBench:
    """One built target, its batches and the JSON being written: what every step of :func:`run` measures with."""

    model: TargetModel
    batches: list[tuple[torch.Tensor, list[int]]]
    out: dict[str, Any]
    out_file: Path
    peak_tflops: float
    warmup_passes: int
    agree_batches: int
    profile: bool

    @property
    def results(self) -> dict[str, Any]:
        return self.out["results"]

    def save(self) -> None:
        self.out_file.write_text(json.dumps(self.out, indent=1))

    def save_ratios(self) -> None:
        self.out["ratios"] = _ratios(self.results)
        self.save()

    def planes(self) -> list[list[torch.Tensor]]:
        """The packed captured planes of the first ``agree_batches`` batches: one side of an agreement table."""
        return _planes(self.model, self.batches[: self.agree_batches])

    def measure(self, tag: str, timed: tuple[str, ...], profiled: tuple[str, ...]) -> None:
        """Time the ``timed`` variants of the model as it is now; profile the ``profiled`` ones
        (with ``--profile``)."""
        model = self.model
        for v in timed:
            self.results[f"{v}-{tag}"] = r = time_variant(model, v, self.batches, self.peak_tflops, self.warmup_passes)
            _echo(f"{v}-{tag}: {r['tokens_per_s']} tok/s real, MFU {r['mfu_real']} (bf16 peak), padding {r['padding_pct']}%")
            self.save()
        ids, lens = self.batches[0]
        for v in profiled if self.profile else ():
            run_one(model, v, ids, lens)  # compiled / autotuned before the profiled call
            self.out["profile"][f"{v}-{tag}"] = prof = profile_classes(
                lambda v=v: run_one(model, v, ids, lens), model.device.type == "cuda"
            )
            _echo(format_table(f"profile {v} {tag}, batch {tuple(ids.shape)}", prof))
            self.save()

    def fused(self, tag: str, ref: list[list[torch.Tensor]] | None = None) -> None:
        """``packed`` with the elementwise work fused, timed and profiled; its agreement with ``ref`` when given."""
        from dflash_ipc.target.fused import fuse_elementwise, unfuse_elementwise

        self.out[f"fused_{tag}"] = fuse_elementwise(self.model.stack)
        try:
            self.measure(f"{tag}-fused", ("packed",), ("packed",))
            if ref is not None:
                self.out[f"agreement_{tag}_fused_vs_bf16"] = rows = agreement(ref, self.planes(), self.model.layer_ids)
                _echo(format_agreement(f"captured hidden states, {tag} + fused elementwise vs bf16", rows))
        finally:
            unfuse_elementwise(self.model.stack)


def build_bench(
    cfg: DFlashConfig, config_path: str, out_path: str, dev: torch.device, layers: int, n_batches: int, cache_dir: str, **knobs
) -> ForwardBench:
    """Plan the batches, build the target and write what the run measures on (shapes, layers, packed path)."""
    out: dict[str, Any] = {"config": config_path, "device": str(dev), "peak_tflops": knobs["peak_tflops"]}
    out["timing"] = {"warmup_passes_per_variant": knobs["warmup_passes"], "timed_passes_per_variant": 1, "each_warmup_pass": "every batch"}
    t0 = time.perf_counter()
    cache = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "dflash-target-forward-data"
    batches, vocab, out["epoch_padding_pct"] = plan_batches(cfg, n_batches, cache)
    _echo(f"{len(batches)} batches in {time.perf_counter() - t0:.1f}s: shapes {[tuple(i.shape) for i, _ in batches]}")
    t0 = time.perf_counter()
    model = build_target(target_config(cfg, layers), dev, vocab_size=vocab)
    _sync(model)
    out["build_s"] = round(time.perf_counter() - t0, 1)
    out["layers_run"] = model.layers_run
    out["layers_total_in_config"] = int(cfg.target.spec.get("num_hidden_layers", 0)) if cfg.target.spec else None
    out["layer_ids"] = model.layer_ids
    out["packed_path"] = model.varlen_reason
    out["gated_delta_net"] = {"varlen_kernels": model.linear_attention_kernels, "conv": sorted({m.conv or "padded" for m in model._mixers})}
    out["batches"] = [{"shape": list(i.shape), "docs": len(lens), "real_tokens": sum(lens)} for i, lens in batches]
    _echo(f"target built in {out['build_s']}s: {model.layers_run} layers, capture {model.layer_ids}; {model.varlen_reason}")
    bench = ForwardBench(model, batches, out, Path(out_path), **knobs)
    bench.save()
    out["results"] = {}
    out["profile"] = {}
    return bench


def run_fp8(bench: ForwardBench, ref: list[list[torch.Tensor]], fuse: bool, fp8_unmerged: bool) -> None:
    """The same weights quantized and merged as the product builds them: FP8 timings and agreement
    first, then its profiles, fusion and the unmerged baseline; the bf16 linears are put back last
    for their own profiles and fusion."""
    from dflash_ipc.target.fp8 import quantize_linears
    from dflash_ipc.target.fp8_merge import merge_sibling_linears, unmerge_sibling_linears

    model, out = bench.model, bench.out
    bf16_linears = {name: mod for name, mod in model.stack.named_modules() if type(mod) is nn.Linear}
    t0 = time.perf_counter()
    out["fp8_layers"] = quantize_linears(model.stack)
    out["fp8_merged"] = merge_sibling_linears(model.stack)  # as the product builds it (target/model.py apply_fp8)
    out["fp8_quantize_s"] = round(time.perf_counter() - t0, 1)
    bench.measure("fp8", VARIANTS, ())
    merged_planes = bench.planes()
    out["agreement_fp8_vs_bf16"] = agreement(ref, merged_planes, model.layer_ids)
    _echo(format_agreement("captured hidden states, FP8 vs bf16 (packed, real tokens)", out["agreement_fp8_vs_bf16"]))
    bench.save_ratios()
    bench.measure("fp8", (), ("packed",))
    if fuse:
        bench.fused("fp8", ref)
    unmerge_sibling_linears(model.stack)
    if fp8_unmerged:
        run_fp8_unmerged(bench, merged_planes, fuse)
    for name, mod in bf16_linears.items():  # the bf16 weights back, for their profiles and fusion
        parent, _, child = name.rpartition(".")
        setattr(model.stack.get_submodule(parent) if parent else model.stack, child, mod)


def run_fp8_unmerged(bench: ForwardBench, merged_planes: list[list[torch.Tensor]], fuse: bool) -> None:
    """Each projection quantizing its own input and running its own GEMM: the merge's baseline, and
    how far its planes are from the merged ones."""
    bench.measure("fp8-unmerged", ("packed",), ("packed",))
    unmerged_planes = bench.planes()
    bench.out["merged_vs_unmerged_max_abs"] = max(
        ((a.float() - b.float()).abs().max().item() for m, u in zip(merged_planes, unmerged_planes) for a, b in zip(m, u)), default=0.0
    )
    _echo(f"captured planes, FP8 merged vs unmerged: max abs difference {bench.out['merged_vs_unmerged_max_abs']:.3g}")
    if fuse:
        bench.fused("fp8-unmerged")
    bench.save_ratios()


def run(
    config_path: str,
    out_path: str,
    *,
    layers: int = 0,
    n_batches: int = 8,
    warmup_passes: int = 1,
    agree_batches: int = 2,
    profile: bool = False,
    fp8: bool = True,
    fuse: bool = False,
    peak_tflops: float = 790.0,
    device: str = "",
    cache_dir: str = "",
    fp8_off_gpu: bool = False,
    fp8_unmerged: bool = True,
    set_values: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The whole measurement (see the module docstring); returns the JSON it wrote."""
    cfg = load_config(config_path, sets=set_values)
    dev = torch.device(device or cfg.topology.targets[0])
    knobs = {"peak_tflops": peak_tflops, "warmup_passes": warmup_passes, "agree_batches": agree_batches, "profile": profile}
    bench = build_bench(cfg, config_path, out_path, dev, layers, n_batches, cache_dir, **knobs)
    # headline figures first (bf16, then FP8 on the same weights), profiles and fusion after
    bench.measure("bf16", VARIANTS, ())
    ref = bench.planes()
    from dflash_ipc.target.fp8 import fp8_device_problem

    problem = None if fp8_off_gpu else fp8_device_problem(dev, bench.model.dtype)
    if problem:
        bench.out["fp8_skipped"] = problem
        _echo(f"fp8 skipped: {problem}")
    elif fp8:
        run_fp8(bench, ref, fuse, fp8_unmerged)
    bench.measure("bf16", (), VARIANTS)
    if fuse:
        bench.fused("bf16", ref)
    bench.save_ratios()
    if fp8 and not problem:
        _echo(f"ratios: {json.dumps(bench.out['ratios'])}")
    return bench.out


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    def rate(k: str) -> float | None:
        return results[k]["tokens_per_s"] if k in results else None

    pairs = {
        "packed_over_padded_bf16": ("packed-bf16", "padded-bf16"),
        "packed_over_padded_fp8": ("packed-fp8", "padded-fp8"),
        "fp8_over_bf16_packed": ("packed-fp8", "packed-bf16"),
        "fp8_over_bf16_padded": ("padded-fp8", "padded-bf16"),
        "packed_fp8_over_padded_bf16": ("packed-fp8", "padded-bf16"),
        "fused_over_eager_packed_bf16": ("packed-bf16-fused", "packed-bf16"),
        "fused_over_eager_packed_fp8": ("packed-fp8-fused", "packed-fp8"),
        "packed_fp8_fused_over_padded_bf16": ("packed-fp8-fused", "padded-bf16"),
        "fp8_merged_over_unmerged_packed": ("packed-fp8", "packed-fp8-unmerged"),
        "fp8_merged_over_unmerged_packed_fused": ("packed-fp8-fused", "packed-fp8-unmerged-fused"),
    }
    out = {}
    for name, (a, b) in pairs.items():
        ra, rb = rate(a), rate(b)
        if ra and rb:
            out[name] = round(ra / rb, 4)
    return out


def checkpoint_agreement(model_path: str, out_path: str, device: str = "cuda:0", n_tokens: int = 4096) -> dict[str, Any]:
    """FP8 vs bf16 captured hidden states of a real checkpoint (e.g. SmolLM2) on the builtin
    corpus's text, tokenized by the checkpoint's own tokenizer."""
    from dflash_ipc.config import TargetConfig
    from dflash_ipc.data.builtin_corpus import builtin_conversations
    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.target.fp8 import quantize_linears
    from dflash_ipc.target.fp8_merge import merge_sibling_linears

    tok = load_tokenizer(model_path)
    docs: list[list[int]] = []
    for record in builtin_conversations(64):
        text = "\n".join(str(m.get("content", "")) for m in record.get("conversations") or record.get("messages") or [])
        ids = tok(text, add_special_tokens=False)["input_ids"][:1024]
        if len(ids) >= 8:
            docs.append(ids)
        if sum(map(len, docs)) >= n_tokens:
            break
    if not docs:
        raise ValueError(f"{model_path}'s tokenizer gave no document of 8 tokens or more from the builtin corpus")
    lens = [len(d) for d in docs]
    flat = torch.tensor([t for d in docs for t in d], dtype=torch.int64)
    model = build_target(TargetConfig(model_path=model_path, dtype="bfloat16", varlen=True, fuse_elementwise=False), device)
    ref = [p.detach().clone() for p in model.capture_packed(flat.to(model.device), lens)]
    counts = quantize_linears(model.stack)
    merge_sibling_linears(model.stack)  # as the product builds it
    test = [p.detach().clone() for p in model.capture_packed(flat.to(model.device), lens)]
    rows = agreement([ref], [test], model.layer_ids)
    out = {"model_path": model_path, "documents": len(lens), "tokens": sum(lens), "fp8_layers": counts, "agreement_fp8_vs_bf16": rows}
    _echo(format_agreement(f"{model_path}: captured hidden states, FP8 vs bf16 ({sum(lens)} real tokens)", rows))
    Path(out_path).write_text(json.dumps(out, indent=1))
    return out
