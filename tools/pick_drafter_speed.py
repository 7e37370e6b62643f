"""The drafter speed options a `bench drafter-step` result earns, as config overrides for the next training call.

    python3 tools/pick_drafter_speed.py drafter_step.json [--min-speedup 1.05] [--max-loss-diff 5e-3] [--speedup]

Prints `section.key=value ...` for the fastest variant whose median step beats the baseline (the bench's first
variant) by at least --min-speedup and whose first-step loss on the same weights, batch and anchors is within
--max-loss-diff (relative) of the baseline's; prints nothing when no variant earns it (train as configured).
With --speedup it prints that variant's step speed-up instead (1.0 when none), to plan the steps a budget holds.
The reasons go to stderr, one line per variant.
"""

from __future__ import annotations

import argparse
import json
import sys

from dflash_ipc.bench.drafter_step import variant_overrides


def pick(result: dict, min_speedup: float, max_loss_diff: float) -> tuple[str | None, list[str]]:
    """(the variant to train with or None, one reason line per variant)."""
    best, best_speed, reasons = None, min_speedup, []
    for name, r in result.get("ratios", {}).items():
        speed, diff = r.get("step", 0.0), r.get("loss_step0_rel_diff", float("inf"))
        # a tie keeps the variant listed first (the bench lists the baseline first): no change for nothing
        ok = (speed > best_speed if best is not None else speed >= best_speed) and diff <= max_loss_diff
        reasons.append(f"{name}: step {speed:.3f}x, first-step loss {diff:.2e} from the baseline's{' <- best so far' if ok else ''}")
        if ok:
            best, best_speed = name, speed
    return best, reasons


def overrides(variant: str) -> list[str]:
    fields = variant_overrides(variant)
    return [f"{section}.{key}={json.dumps(value)}" for section, kv in fields.items() for key, value in kv.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--min-speedup", type=float, default=1.05)
    ap.add_argument("--max-loss-diff", type=float, default=5e-3)
    ap.add_argument("--speedup", action="store_true", help="print the picked variant's step speed-up instead")
    args = ap.parse_args(argv)
    try:
        with open(args.result, encoding="utf-8") as f:
            result = json.load(f)  # the bench's --out file: one JSON object, rewritten after each variant
    except (OSError, ValueError) as e:
        print(f"no drafter-step result to pick from ({args.result}: {e}): training as configured", file=sys.stderr)
        if args.speedup:
            print("1.0")
        return 0
    best, reasons = pick(result, args.min_speedup, args.max_loss_diff)
    if args.speedup:
        print(result["ratios"][best]["step"] if best is not None else "1.0")
        return 0
    for line in reasons:
        print(line, file=sys.stderr)
    if best is not None:
        print(" ".join(overrides(best)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
