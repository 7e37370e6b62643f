"""One drafter training step alone, in this process: where its time goes, and what the speed options buy.

``dflash-ipc bench drafter-step --config C [--random-target] [--variants base,ce-chunk-8192,compile] [--profile]``

* **Model**: the config's drafter (random weights, ``run.seed``) on its target's shapes: the target
  model folder's config and LM head (``target.model_path``) or ``target.spec``, as training builds it
  (:func:`~dflash_ipc.drafter.model.build.build_drafter`); ``--random-target``: SmolLM2-135M's shapes
  (:func:`~dflash_ipc.target_spec.hf_config.smollm2_135m_config`) with random heads, for a machine
  without the checkpoint; ``--target-shape`` picks Qwen3-8B's or Qwen3.6-27B's widths instead
  (:data:`RANDOM_TARGETS`).
* **Batches**: ``--batches`` synthetic packed batches like the targets send: ``--tokens`` tokens
  (default ``data.token_budget``) of documents whose lengths are drawn uniformly around
  ``--doc-len``, each document's last ``--supervised`` share under the loss mask (a chat answer
  after its prompt), random planes in the target's dtype. Every batch has its own shape, as in
  training.
* **Step**: the real path: :func:`~dflash_ipc.drafter.loss.objective.compute_loss` (anchors, masks, drafter
  forward, chunked CE) and :meth:`~dflash_ipc.drafter.training.trainer.DrafterTrainer.step` (backward,
  clip, AdamW). Phases: ``prep`` (anchors, labels, masks), ``forward`` (the drafter's layers),
  ``loss`` (the chunked CE and metrics), ``backward``, ``optimizer``; CUDA events on GPU,
  ``perf_counter`` on CPU, and one synchronize before the trainer's step, whose own phases are
  synchronized wall times.
* **Variants** (``--variants``, comma-separated, the first is the baseline of every ratio): ``base``
  (the config as it is), ``eager`` (both compile options off), ``compile`` (``drafter.compile``),
  ``ce-compile`` (``training.ce_compile``), ``ce-fp8`` (``training.ce_fp8``), ``ce-chunk-N`` (``training.ce_chunk_tokens = N``),
  ``anchor-chunk-N`` (``drafter.anchor_chunk = N``), ``anchor-chunk-auto`` (the chunk
  :mod:`~dflash_ipc.drafter.training.memory_plan` picks for this GPU, the drafter alone on it), ``fp8-R``
  (``drafter.fp8_linears = R``: ``fp8-rowwise``, ``fp8-tensorwise``, ``fp8-none``), ``attn-K``
  (``drafter.attention = K``: ``attn-sdpa``, ``attn-blockwise``, ``attn-flex``); ``+`` joins
  several (``compile+ce-chunk-8192``, ``compile+fp8-rowwise``).
  Each builds a fresh drafter (same seed, same weights), warms up on every batch (compiles, autotuning),
  then times ``--steps`` steps over the batches in turn. ``loss_step0`` (the loss of the first step,
  before any update: the same weights, batch and anchors in every variant) shows each option keeps
  the numbers; ``graphs_compiled_timed`` counts TorchDynamo graphs compiled during the timed steps
  (0: no recompile per batch).
* **Profile** (``--profile``): one more step of each variant under ``torch.profiler``, by op class
  (:mod:`~dflash_ipc.bench.op_profile`, with the CE chunks and the optimizer scoped by their ranges).

Progress lines go to stderr; the result is one JSON (``--out``, ``--json``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dflash_ipc.bench.mps import mps_status
from dflash_ipc.bench.op_profile import format_table, profile_classes
from dflash_ipc.config import DFlashConfig, load_config
from dflash_ipc.config.fields import FieldError
from dflash_ipc.data.draft_vocab import DraftVocab
from dflash_ipc.data.tokenizer import load_tokenizer
from dflash_ipc.drafter.loss.objective import compute_loss
from dflash_ipc.drafter.model.build import build_drafter, drafter_for_target
from dflash_ipc.drafter.model.dflash_drafter import ATTENTION_KERNELS, DFlashDrafter
from dflash_ipc.drafter.model.fp8_linears import fp8_linear_names
from dflash_ipc.drafter.training.memory_plan import resolve_anchor_chunk
from dflash_ipc.drafter.training.trainer import DrafterTrainer
from dflash_ipc.platform.devices import dtype_from_name
from dflash_ipc.target_spec.hf_config import make_hf_config, qwen36_27b_spec, resolve_layer_ids, smollm2_135m_config, target_vocab_size
from dflash_ipc.transport.slots import SlotViews

__all__ = ["PHASES", "SCOPES", "variant_overrides", "synthetic_batches", "run_drafter_step_bench"]

PHASES = ("prep", "forward", "loss", "backward", "optimizer", "step")
#: profile classes by enclosing range: the chunked CE's forward and backward, the optimizer step
SCOPES = (("ce_loss", r"chunkedlmloss"), ("optimizer", r"optimizer\.step"))


def _echo(msg: str) -> None:
    print(f"[drafter-step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- variants


def _number(part: str, prefix: str) -> int:
    tail = part[len(prefix) :]
    if not tail.isdigit() or int(tail) < 1:
        raise ValueError(f"variant {part!r}: {prefix}N needs a positive whole number N")
    return int(tail)


def variant_overrides(name: str) -> dict[str, dict[str, Any]]:
    """``{"drafter": {...}, "training": {...}}``: the config fields a variant name sets."""
    out: dict[str, dict[str, Any]] = {"drafter": {}, "training": {}}
    for part in name.split("+"):
        if part == "base":
            continue
        if part == "eager":
            out["drafter"]["compile"] = False
            out["training"]["ce_compile"] = False
        elif part == "compile":
            out["drafter"]["compile"] = True
        elif part == "ce-compile":
            out["training"]["ce_compile"] = True
        elif part == "ce-fp8":
            out["training"]["ce_fp8"] = True
        elif part.startswith("ce-chunk-"):
            out["training"]["ce_chunk_tokens"] = _number(part, "ce-chunk-")
        elif part == "anchor-chunk-auto":
            out["drafter"]["anchor_chunk"] = "auto"
        elif part.startswith("anchor-chunk-"):
            out["drafter"]["anchor_chunk"] = _number(part, "anchor-chunk-")
        elif part.startswith("draft-vocab-"):
            out["drafter"]["draft_vocab_size"] = _number(part, "draft-vocab-")
        elif part.startswith("fp8-"):
            out["drafter"]["fp8_linears"] = part.removeprefix("fp8-")  # the config's check names the recipes
        elif part.startswith("attn-"):
            kernel = part.removeprefix("attn-")
            if kernel not in ATTENTION_KERNELS:
                raise ValueError(f"variant {part!r}: drafter.attention must be one of {', '.join(ATTENTION_KERNELS)}")
            out["drafter"]["attention"] = kernel
        else:
            raise ValueError(
                f"unknown variant {part!r}; use base, eager, compile, ce-compile, ce-fp8, ce-chunk-N, anchor-chunk-N, "
                "anchor-chunk-auto, draft-vocab-N, fp8-rowwise, fp8-tensorwise, fp8-none, attn-sdpa, attn-blockwise, "
                "attn-flex, joined by '+'"
            )
    return out


def variant_config(cfg: DFlashConfig, name: str) -> DFlashConfig:
    """``cfg`` with a variant's fields set (validated as a config file's would be)."""
    o = variant_overrides(name)
    sections = {}
    for section, fields in o.items():
        try:
            sections[section] = dataclasses.replace(getattr(cfg, section), **fields)
        except FieldError as e:
            raise ValueError(f"variant {name!r}: {section}.{e.key}: {e.message}") from None
    return dataclasses.replace(cfg, **sections)


# --------------------------------------------------------------------------- model and batches


def _qwen3_8b_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False,
    )  # fmt: skip


#: ``--target-shape``: the transformers config of a random target at a model's widths
RANDOM_TARGETS: dict[str, Callable[[], Any]] = {
    "smollm2-135m": smollm2_135m_config,
    "qwen3-8b": _qwen3_8b_config,
    "qwen3.6-27b": lambda: make_hf_config(qwen36_27b_spec()),
}


def build_bench_drafter(cfg: DFlashConfig, device: torch.device, random_target: bool, shape: str = "smollm2-135m") -> DFlashDrafter:
    """The config's drafter as training builds it; ``random_target``: over ``shape``'s widths (:data:`RANDOM_TARGETS`), random heads.
    With ``drafter.draft_vocab_size`` the head keeps the lowest ids as a stand-in for the run's choice:
    a step's cost depends on the head's size, not on which rows it holds."""
    if not random_target:
        return build_drafter(cfg, device, log_mask_token=False, draft_vocab=_stand_in_vocab(cfg, None))
    if shape not in RANDOM_TARGETS:
        raise ValueError(f"unknown target shape {shape!r}; use one of {', '.join(RANDOM_TARGETS)}")
    hf = RANDOM_TARGETS[shape]()
    layer_ids = resolve_layer_ids(cfg.target, int(hf.num_hidden_layers))
    # Any id does for timing; a real run picks an unused one (data.tokenizer.choose_mask_token).
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else int(hf.vocab_size) - 1
    headless = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, model_path="", tokenizer="builtin"))
    return drafter_for_target(headless, hf, layer_ids, mask_id, device, _stand_in_vocab(cfg, int(hf.vocab_size)))


def _stand_in_vocab(cfg: DFlashConfig, vocab_size: int | None) -> DraftVocab | None:
    n = cfg.drafter.draft_vocab_size
    if not n:
        return None
    if vocab_size is None:
        vocab_size = target_vocab_size(cfg.target, len(load_tokenizer(cfg.target.tokenizer)))
    return DraftVocab(tuple(range(n)), vocab_size, 0.0, 0)


def document_lengths(tokens: int, doc_len: int, max_len: int, generator: torch.Generator) -> list[int]:
    """Lengths uniform in ``[doc_len / 2, 3 doc_len / 2]`` (at most ``max_len``) summing to ``tokens``."""
    lo, hi = max(2, doc_len // 2), max(2, min(max_len, (3 * doc_len) // 2))
    lens: list[int] = []
    left = tokens
    while left > 0:
        n = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        n = left if left - n < 2 else n  # no trailing stub of one token
        lens.append(n)
        left -= n
    return lens


def synthetic_batches(
    model: DFlashDrafter, cfg: DFlashConfig, count: int, tokens: int, doc_len: int, supervised: float, seed: int = 0
) -> list[SlotViews]:
    """``count`` packed batches of ``tokens`` tokens on the model's device (module docstring)."""
    dev = model.device
    gen = torch.Generator().manual_seed(seed)
    planes = model.config.num_context_planes + int(cfg.target.capture_last_hidden)
    dtype = dtype_from_name(cfg.target.dtype)
    out = []
    for _ in range(count):
        lens = document_lengths(tokens, doc_len, cfg.data.max_seq_len, gen)
        mask = torch.cat([(torch.arange(n) >= n - max(2, round(supervised * n))).to(torch.uint8) for n in lens])
        out.append(
            SlotViews(
                planes=torch.randn(planes, tokens, model.config.hidden_size, generator=gen).to(dev, dtype),
                token_ids=torch.randint(0, model.config.vocab_size, (tokens,), generator=gen).to(dev),
                loss_mask=mask.to(dev),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            )
        )
    return out


# --------------------------------------------------------------------------- one step, timed


class _Clock:
    """Named marks: CUDA events on a GPU (no synchronize between them), ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            evt = torch.cuda.Event(enable_timing=True)
            evt.record()
            self.marks.append((name, evt))
        else:
            self.marks.append((name, time.perf_counter()))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def spans(self) -> list[tuple[str, str, float]]:
        """``(from, to, seconds)`` between consecutive marks (after :meth:`sync`)."""
        out = []
        for (a, ta), (b, tb) in zip(self.marks, self.marks[1:]):
            out.append((a, b, ta.elapsed_time(tb) / 1e3 if self.cuda else tb - ta))
        return out


class StepRunner:
    """One variant's drafter, trainer and generator; :meth:`step` runs and times one training step."""

    def __init__(self, cfg: DFlashConfig, device: torch.device, random_target: bool, shape: str = "smollm2-135m"):
        self.model = build_bench_drafter(cfg, device, random_target, shape)
        self.trainer = DrafterTrainer(self.model, cfg.training, total_steps=max(1, cfg.training.max_steps or 10_000))
        self.trainer.allocate_optimizer_state()
        # "auto": the chunk for this GPU with the drafter alone on it (the bench runs no target)
        self.cfg, self.anchor_chunk_why = resolve_anchor_chunk(cfg, self.model, device, target_need=0)
        self.generator = torch.Generator(device=device)
        self.reseed()
        self._clock: _Clock | None = None
        self._hooks = [
            self.model.register_forward_pre_hook(lambda *_: self._mark("forward")),
            self.model.register_forward_hook(lambda *_: self._mark("loss")),
        ]

    def _mark(self, name: str) -> None:
        if self._clock is not None:
            self._clock.mark(name)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.trainer.close()

    def reseed(self) -> None:
        self.generator.manual_seed(self.cfg.run.seed)

    def step(self, views: SlotViews) -> dict[str, Any]:
        clock = self._clock = _Clock(self.model.device)
        t0 = time.perf_counter()
        clock.mark("prep")
        out = compute_loss(self.model, views, self.cfg.drafter, self.cfg.training, self.generator, self.trainer.accumulate)
        clock.mark("end")
        clock.sync()
        self._clock = None
        stats = self.trainer.step(out.loss_sum, out.weight_sum)
        rec = {p: 0.0 for p in PHASES}
        for name, _, s in clock.spans():  # anchor chunks: several forward/loss spans, summed
            rec[name] += s
        rec["backward"] = stats.backward_s
        rec["optimizer"] = stats.allreduce_s + stats.optimizer_s
        rec["step"] = time.perf_counter() - t0
        rec["global_loss"] = stats.global_loss
        rec["blocks"] = out.num_blocks
        rec["query_tokens"] = out.num_query_tokens
        rec["loss_rows"] = int(out.count_per_pos.sum())
        layers, head = gemm_flops(self.model, int(views.token_ids.numel()), out.num_query_tokens, rec["loss_rows"])
        rec["gemm_flops"], rec["head_flops"] = layers + head, head
        return rec


def gemm_flops(model: DFlashDrafter, context_tokens: int, queries: int, loss_rows: int) -> tuple[float, float]:
    """The step's matmul FLOPs (trained weights, LM head), attention left out: each layer weight's forward
    (2 per multiply-add) and backward (twice that: input and weight gradients); the context projection
    ``fc``'s forward and weight gradient (its input, the target's planes, takes none); the frozen LM head
    over the supervised rows: forward and the hidden-state gradient (taken in the loss's forward, no recompute)."""
    c = model.config
    h, q_width, kv_width = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = queries * h * (2 * q_width + 3 * c.intermediate_size) + (context_tokens + queries) * h * 2 * kv_width
    fc = context_tokens * c.num_context_planes * h * h
    return 6.0 * c.num_layers * per_layer + 4.0 * fc, 4.0 * loss_rows * h * (c.draft_vocab_size or c.vocab_size)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_variant(runner: StepRunner, batches: list[SlotViews], steps: int, echo: Callable[[str], None]) -> dict[str, Any]:
    """Warm-up on every batch (the first from fresh weights: ``loss_step0``), then ``steps`` timed steps."""
    t0 = time.perf_counter()
    runner.reseed()
    warm = [runner.step(views) for views in batches]
    warmup_s = time.perf_counter() - t0
    graphs = _graphs_compiled()
    runner.reseed()
    recs = []
    for i in range(steps):
        recs.append(runner.step(batches[i % len(batches)]))
        echo(f"  step {i + 1}/{steps}: {recs[-1]['step'] * 1e3:.1f} ms")
    med = {p: statistics.median(r[p] for r in recs) for p in PHASES}
    tokens = statistics.mean(int(b.token_ids.numel()) for b in batches)
    return {
        "warmup_s": round(warmup_s, 2),
        "steps": steps,
        "median_s": {p: round(v, 5) for p, v in med.items()},
        "mean_s": {p: round(statistics.mean(r[p] for r in recs), 5) for p in PHASES},
        "per_step_s": [round(r["step"], 5) for r in recs],
        "tokens_per_batch": round(tokens, 1),
        "blocks_per_batch": round(statistics.mean(r["blocks"] for r in recs), 1),
        "query_tokens_per_batch": round(statistics.mean(r["query_tokens"] for r in recs), 1),
        "target_tokens_per_s": round(tokens / med["step"], 1),
        "loss_rows_per_batch": round(statistics.mean(r["loss_rows"] for r in recs), 1),
        # matmul FLOPs of the median step over its time: how far the step is from the GEMMs alone
        "gemm_tflops_per_s": float(f"{statistics.median(r['gemm_flops'] / r['step'] for r in recs) / 1e12:.4g}"),
        "lm_head_share_of_gemm_flops": round(statistics.mean(r["head_flops"] / r["gemm_flops"] for r in recs), 3),
        "loss_step0": warm[0]["global_loss"],
        "graphs_compiled_timed": _graphs_compiled() - graphs,
    }


# --------------------------------------------------------------------------- the whole bench


def run_drafter_step_bench(
    config_path: str,
    variants: list[str],
    *,
    steps: int = 10,
    n_batches: int = 3,
    tokens: int = 0,
    doc_len: int = 0,
    supervised: float = 0.7,
    random_target: bool = False,
    target_shape: str = "smollm2-135m",
    profile: bool = False,
    device: str = "",
    echo: Callable[[str], None] = _echo,
    save: Callable[[dict[str, Any]], None] | None = None,
    sets: Sequence[str] = (),
) -> dict[str, Any]:
    """The measurement of the module docstring; ``save`` gets the result after each variant; ``sets``: the
    ``--set`` items over the config file."""
    if not variants:
        raise ValueError("give at least one variant")
    cfg = load_config(config_path, sets=sets)
    for name in variants:
        variant_config(cfg, name)  # every name checked before the first is timed
    dev = torch.device(device or cfg.topology.drafters[0])
    tokens = tokens or cfg.data.token_budget
    doc_len = doc_len or max(2, cfg.data.max_seq_len // 4)
    out: dict[str, Any] = {
        "config": config_path,
        "device": str(dev),
        "target": f"{target_shape} shapes, random" if random_target else (cfg.target.model_path or "target.spec"),
        "mps": mps_status(),
        "batch": {"batches": n_batches, "tokens": tokens, "doc_len": doc_len, "supervised": supervised},
        "variants": {},
        "profile": {},
    }
    batches: list[SlotViews] = []
    for name in variants:
        vcfg = variant_config(cfg, name)
        t0 = time.perf_counter()
        runner = StepRunner(vcfg, dev, random_target, target_shape)
        if runner.anchor_chunk_why:
            echo(runner.anchor_chunk_why)
        if not batches:
            batches = synthetic_batches(runner.model, cfg, n_batches, tokens, doc_len, supervised, seed=cfg.run.seed)
            out["batch"]["documents"] = [int(b.seq_lens.numel()) for b in batches]
        echo(f"{name}: drafter built in {time.perf_counter() - t0:.1f}s; warm-up on {len(batches)} batches, then {steps} timed steps")
        res = time_variant(runner, batches, steps, echo)
        res["overrides"] = variant_overrides(name)
        res["anchor_chunk"] = runner.cfg.drafter.anchor_chunk
        res["fp8_linear_layers"] = len(fp8_linear_names(runner.model))
        out["variants"][name] = res
        m = res["median_s"]
        echo(
            f"{name}: step {m['step'] * 1e3:.1f} ms (prep {m['prep'] * 1e3:.1f}, forward {m['forward'] * 1e3:.1f}, "
            f"loss {m['loss'] * 1e3:.1f}, backward {m['backward'] * 1e3:.1f}, optimizer {m['optimizer'] * 1e3:.1f}); "
            f"{res['gemm_tflops_per_s']} TFLOP/s of matmuls; FP8 linears {res['fp8_linear_layers']}; loss_step0 {res['loss_step0']:.6f}; "
            f"graphs compiled while timed: {res['graphs_compiled_timed']}"
        )
        if profile:
            views = batches[0]
            out["profile"][name] = prof = profile_classes(functools.partial(runner.step, views), dev.type == "cuda", scopes=SCOPES)
            echo(format_table(f"profile {name}, one step, {int(views.token_ids.numel())} tokens", prof))
        out["ratios"] = ratios(out["variants"], variants[0])
        if save is not None:
            save(out)
        runner.close()
    echo(f"ratios against {variants[0]}: {out['ratios']}")
    return out


def ratios(results: dict[str, Any], baseline: str) -> dict[str, Any]:
    """Per variant: the baseline's median time over the variant's, per phase (> 1: faster), and its
    ``loss_step0`` relative to the baseline's."""
    base = results[baseline]
    out = {}
    for name, r in results.items():
        speed = {p: round(base["median_s"][p] / r["median_s"][p], 3) for p in PHASES if r["median_s"][p] > 0}
        b0 = base["loss_step0"]
        speed["loss_step0_rel_diff"] = abs(r["loss_step0"] - b0) / max(abs(b0), 1e-30)
        out[name] = speed
    return out
