"""gen-data's decoding, timed: samples/s of ``generate_batch`` per KV-cache mode and batch size, in one run
(``dflash-ipc bench gen-decode``).

Every (mode, batch size) decodes the same prompts (random ids of seeded lengths, greedy, no stop token, so every
row runs ``max_new`` steps) after one untimed warm-up batch (the compile, for ``compiled``); each mode's greedy ids
are compared with the dynamic cache's at the same batch size. Ratios are against ``dynamic`` at the same batch
size, measured in the same run. With a time budget, :func:`pick_decode` says which mode answers more prompts
within it once the compiled mode's compiles are paid (``gen-data --decode``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GenDecodeArgs:
    model: str = ""  # an HF model folder; "" = SmolLM2-135M's shapes with random weights
    layers: int = 30  # layers of the random model
    device: str = "cuda:0"
    dtype: str = "bfloat16"
    modes: tuple[str, ...] = ("dynamic", "static", "compiled")
    batch_sizes: tuple[int, ...] = (512,)
    max_new: int = 64
    prompt_len: tuple[int, int] = (24, 96)
    batches: int = 2  # timed batches per (mode, batch size)

    def __post_init__(self) -> None:
        unknown = set(self.modes) - {"dynamic", "static", "compiled"}
        if unknown:
            raise ValueError(f"--modes: unknown {sorted(unknown)}; choose from dynamic, static, compiled")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--batch-sizes: give one or more sizes >= 1")
        lo, hi = self.prompt_len
        if not 1 <= lo <= hi:
            raise ValueError("--prompt-len: MIN,MAX with 1 <= MIN <= MAX")


def pick_decode(rows: list[dict], batch_size: int, budget_s: float, graphs: int = 4, min_gain: float = 1.15) -> tuple[str, str]:
    """(mode, reason): ``compiled`` when the compiled static cache answers at least ``min_gain`` times the
    dynamic cache's prompts within ``budget_s``, its compile paid once per graph (a gen-data process compiles
    one graph per padded width class: about one for sampling requests and three for answers); else ``dynamic``."""
    by_mode = {r["mode"]: r for r in rows if r.get("batch_size") == batch_size}
    dyn, comp = by_mode.get("dynamic"), by_mode.get("compiled")
    if dyn is None or comp is None:
        return "dynamic", f"no dynamic and compiled rows at batch {batch_size}"
    dyn_n = dyn["samples_per_s"] * budget_s
    comp_n = comp["samples_per_s"] * max(budget_s - graphs * comp["warmup_s"], 0.0)
    gain = comp_n / dyn_n if dyn_n > 0 else 0.0
    mode = "compiled" if gain >= min_gain else "dynamic"
    return mode, (
        f"batch {batch_size}: dynamic {dyn_n:.0f} samples in {budget_s:.0f} s; compiled {comp_n:.0f} after {graphs} x "
        f"{comp['warmup_s']:.1f} s of compile ({gain:.2f}x, needs {min_gain:.2f}x): {mode}"
    )


def _model(args: GenDecodeArgs):
    import torch

    dtype = getattr(torch, args.dtype)
    if args.model:
        from transformers import AutoConfig, AutoModelForCausalLM

        from dflash_ipc.families import family_of

        attention = family_of(AutoConfig.from_pretrained(args.model)).attention_implementation("auto")  # gpt-oss has no sdpa
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attention).to(args.device).eval()
    from transformers import LlamaForCausalLM

    from dflash_ipc.target_spec.hf_config import smollm2_135m_config

    torch.manual_seed(0)
    return LlamaForCausalLM(smollm2_135m_config(args.layers)).to(device=args.device, dtype=dtype).eval()


def _timed(lm, batches: list[list[list[int]]], opts, device: str) -> tuple[float, float, list]:
    """(warm-up seconds, timed seconds, greedy ids of the timed batches): the first batch warms up (compiles)."""
    import torch

    from dflash_ipc.datagen.gen import generate_batch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    t = time.perf_counter()
    generate_batch(lm, batches[0], 0, set(), opts, seed=0)
    sync()
    warm = time.perf_counter() - t
    t = time.perf_counter()
    outs = [generate_batch(lm, b, 0, set(), opts, seed=0) for b in batches[1:]]
    sync()
    return warm, time.perf_counter() - t, [[r[0] for r in o] for o in outs]


def run_gen_decode_bench(args: GenDecodeArgs, on_row: Callable[[dict], None] = lambda row: None) -> dict:
    """Every batch size in one mode before the next mode, so a run cut short keeps its baseline rows."""
    import torch

    from dflash_ipc.datagen.gen import GenOptions

    lm = _model(args)
    vocab = lm.config.vocab_size
    lo, hi = args.prompt_len
    prompts = {}
    for bs in args.batch_sizes:
        rng = random.Random(bs)
        prompts[bs] = [[[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(bs)] for _ in range(args.batches + 1)]
    rows: list[dict] = []
    refs: dict[int, list] = {}
    for mode in args.modes:
        for bs in args.batch_sizes:
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(args.device)
            warm, secs, ids = _timed(lm, prompts[bs], GenOptions(batch_size=bs, max_new=args.max_new, decode=mode), args.device)
            if mode == "dynamic":
                refs[bs] = ids
            row = {
                "mode": mode,
                "batch_size": bs,
                "max_new": args.max_new,
                "samples_per_s": round(bs * args.batches / secs, 2),
                "step_ms": round(1000 * secs / (args.batches * args.max_new), 2),
                "warmup_s": round(warm, 2),
                "same_ids_as_dynamic": ids == refs[bs] if bs in refs else None,
            }
            if args.device.startswith("cuda"):
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
            base = next((r for r in rows if r["batch_size"] == bs and r["mode"] == "dynamic"), None)
            if base:
                row["ratio_vs_dynamic"] = round(row["samples_per_s"] / base["samples_per_s"], 3)
            rows.append(row)
            on_row(row)
    model = args.model or f"random SmolLM2 shapes, {args.layers} layers"
    return {"device": args.device, "model": model, "rows": rows}
