"""gen-data's decode mode for a data call, from a `tools/gen_decode_bench.py` result measured on the same GPU.

    python3 tools/pick_decode.py gen_decode.json --budget-s 390 [--batch-size 2048] [--graphs 4] [--min-gain 1.15]

Prints `compiled` when the compiled static cache answers more prompts within the budget than the dynamic cache,
its compile paid once per graph (a process compiles one graph per padded width class: about one for sampling
requests and three for answers), by at least --min-gain; otherwise `dynamic` (also when the probe has no row
of that batch size, failed or timed out). Greedy ids equal to the dynamic cache's are reported, not required: on
random bf16 weights near-tied logits flip with the kernels' summation order. The reason goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def pick(rows: list[dict], batch_size: int, budget_s: float, graphs: int, min_gain: float) -> tuple[str, str]:
    """(mode, reason) from the probe's rows (each: mode, batch_size, samples_per_s, warmup_s)."""
    by_mode = {r["mode"]: r for r in rows if r.get("batch_size") == batch_size}
    dyn, comp = by_mode.get("dynamic"), by_mode.get("compiled")
    if dyn is None or comp is None:
        return "dynamic", f"no dynamic and compiled rows at batch {batch_size} in the probe"
    decoding_s = budget_s - graphs * comp["warmup_s"]
    dyn_n, comp_n = dyn["samples_per_s"] * budget_s, comp["samples_per_s"] * max(decoding_s, 0.0)
    gain = comp_n / dyn_n if dyn_n > 0 else 0.0
    mode = "compiled" if gain >= min_gain else "dynamic"
    return mode, (
        f"batch {batch_size}: dynamic {dyn['samples_per_s']:.1f} samples/s -> {dyn_n:.0f} in {budget_s:.0f} s; compiled "
        f"{comp['samples_per_s']:.1f} samples/s after {graphs} x {comp['warmup_s']:.1f} s of compile -> {comp_n:.0f} "
        f"({gain:.2f}x, needs {min_gain:.2f}x): {mode}; greedy ids as the dynamic cache's: {comp.get('same_ids_as_dynamic')} "
        "(bf16 kernels of another order may flip near-ties of random weights; the answers stay the target's own)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--budget-s", type=float, required=True)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--graphs", type=int, default=4)
    ap.add_argument("--min-gain", type=float, default=1.15)
    args = ap.parse_args(argv)
    try:
        rows = json.loads(args.result.read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"pick_decode: no usable probe ({e}): dynamic", file=sys.stderr)
        print("dynamic")
        return 0
    mode, reason = pick(rows, args.batch_size, args.budget_s, args.graphs, args.min_gain)
    print(f"pick_decode: {reason}", file=sys.stderr)
    print(mode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
