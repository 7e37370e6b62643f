"""eval's suite against the FP8 target on the CPU, for measurement only: torch's CPU ``_scaled_mm`` stands in
for the GPU's FP8 GEMM (the same e4m3 weights, per-row weight and per-token input scales, bf16 output). The
product refuses FP8 off CUDA >= 8.9 (it would be slow: here ~30 s per 64-token prompt for SmolLM2-135M on two
cores), so this script lifts that device check in its own process and changes nothing else.

    python tools/eval_fp8_cpu.py --config W/train.toml --model DIR --drafter W/run/export/drafter \\
        --suite synth=W/synth.holdout.jsonl,builtin=W/builtin.holdout.jsonl,everyday=configs/eval/everyday.jsonl \\
        --n 6 --max-new 64 --quantization fp8 --dtype bfloat16 > out.json

``--model``: the target checkpoint (and tokenizer), e.g. ``tools/convert_smollm2_gguf.py``'s output, in place of the
config's ``target.model_path`` (default: the config's target). Prints eval's JSON report on stdout, its progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", default=None, help="the target checkpoint and tokenizer (default: the config's)")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--suite", required=True, help="NAME=PATH,... as eval --suite")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--quantization", choices=("none", "fp8"), default="fp8")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the target's FP8 lines say what was quantized

    import dflash_ipc.target.fp8 as fp8
    import dflash_ipc.target.model as model
    from dflash_ipc.config import load_config
    from dflash_ipc.eval.prompts import set_name
    from dflash_ipc.eval.run import run_suite

    fp8.fp8_device_problem = model.fp8_device_problem = lambda device, dtype=None: None
    overrides: dict = {"topology.targets": ["cpu"], "topology.drafters": ["cpu"]}
    if args.model:
        overrides |= {"target.model_path": args.model, "target.tokenizer": args.model}
    cfg = load_config(args.config, overrides)
    sets = [set_name(entry) for entry in args.suite.split(",") if entry.strip()]
    report = run_suite(
        cfg,
        args.drafter,
        sets,
        n=args.n,
        max_new=args.max_new,
        dtype=args.dtype,
        target_device="cpu",
        drafter_device="cpu",
        workers=1,
        speed_prompts=1,
        target_quantization=args.quantization,
        echo=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
