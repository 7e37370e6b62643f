"""gen-data's decoding, timed: samples/s of ``generate_batch`` per decode mode and batch size, in one run.

Every (mode, batch size) decodes the same prompts (random ids of seeded lengths, greedy, no stop
token, so every row runs ``--max-new`` steps) after one untimed warm-up batch (the compile, for
``compiled``); the greedy ids of each mode are compared with the dynamic cache's at the same batch
size. Ratios are against ``dynamic`` at the same batch size, measured in the same run.

    python tools/gen_decode_bench.py --model /root/models/smollm2 --device cuda:0 \\
        --batch-sizes 512,2048 --modes dynamic,compiled --max-new 192 --batches 2 --out $OUT/gen_decode.json
    python tools/gen_decode_bench.py --random-smollm2 --layers 4 --device cpu --batch-sizes 8 --max-new 16
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dflash_ipc.datagen.gen import GenOptions, generate_batch


def _model(args) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.model:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    from transformers import LlamaForCausalLM

    from dflash_ipc.target_spec.hf_config import smollm2_135m_config

    torch.manual_seed(0)
    conf = smollm2_135m_config(args.layers)  # SmolLM2-135M's shapes, random weights
    return LlamaForCausalLM(conf).to(device=args.device, dtype=dtype).eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="an HF model folder; else --random-smollm2")
    ap.add_argument("--random-smollm2", action="store_true")
    ap.add_argument("--layers", type=int, default=30, help="layers of the random model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="dynamic,static,compiled")
    ap.add_argument("--batch-sizes", default="512")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--prompt-len", default="24,96", help="min,max prompt tokens")
    ap.add_argument("--batches", type=int, default=2, help="timed batches per (mode, batch size)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.model and not args.random_smollm2:
        ap.error("give --model DIR or --random-smollm2")
    lm = _model(args)
    vocab = lm.config.vocab_size
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    prompts = {}
    for bs in sizes:
        rng = random.Random(bs)
        prompts[bs] = [[[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(bs)] for _ in range(args.batches + 1)]
    rows: list[dict] = []
    refs: dict[int, list] = {}
    # every batch size in one mode before the next mode: a run cut short still has the baseline rows
    for mode in args.modes.split(","):
        for bs in sizes:
            opts = GenOptions(batch_size=bs, max_new=args.max_new, decode=mode)
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats(args.device)
            t = time.perf_counter()
            generate_batch(lm, prompts[bs][0], 0, set(), opts, seed=0)  # warm-up (and compile)
            _sync(args.device)
            warm = time.perf_counter() - t
            t = time.perf_counter()
            outs = [generate_batch(lm, b, 0, set(), opts, seed=0) for b in prompts[bs][1:]]
            _sync(args.device)
            secs = time.perf_counter() - t
            ids = [[r[0] for r in o] for o in outs]
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
            print(json.dumps(row), flush=True)
            if args.out:  # after every row: a run stopped at its timeout keeps what it measured
                model = args.model or f"random SmolLM2 shapes, {args.layers} layers"
                with open(args.out, "w") as f:
                    json.dump({"device": args.device, "model": model, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
