"""The τ table at equal training seconds: dflash-ipc's drafter and SpecForge's, decoded by the same
``dflash-ipc eval --suite`` (README.md, ``STAGE=tau``).

    python tau_table.py --ipc-eval eval-ipc.json --sf-eval eval-specforge.json --ipc-run RUN_DIR --sf-train train.json

``--ipc-eval`` / ``--sf-eval``: the JSON line ``dflash-ipc eval --suite ... --json`` prints for each drafter;
``--ipc-run``: the dflash-ipc run directory (its ``metrics.jsonl``: steps and training seconds);
``--sf-train``: specforge_tau.py's ``train.json``. Prints one row per set (τ of each, their ratio, and
whether each decoded losslessly: eval's token-exact check against plain greedy decoding), the training
each had, then one JSON line with the same figures (``--json-out`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def last_json_line(path: str | Path) -> dict:
    """The last line of ``path`` that parses as a JSON object (eval prints its report last)."""
    for line in reversed(Path(path).read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError(f"{path}: no JSON report (did the eval run finish? its log says why)")


def ipc_run_summary(run_dir: str | Path) -> dict:
    """Steps, training seconds and tokens of a dflash-ipc run from its ``metrics.jsonl``. Seconds as
    ``training.max_seconds`` counts them: each invocation's ``elapsed_s`` runs from its first step, so a resumed
    run (``elapsed_s`` starting over) adds the last value of every invocation."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: not found; {run_dir} is not a dflash-ipc run directory that trained")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("elapsed_s") is not None and "tokens" in r]
    if not steps:
        raise ValueError(f"{path}: no training steps recorded")
    trained_s, before = 0.0, 0.0
    for r in steps:
        if float(r["elapsed_s"]) < before:  # a resumed invocation's clock starts over
            trained_s += before
        before = float(r["elapsed_s"])
    trained_s += before
    tokens = sum(int(r["tokens"]) for r in steps)
    return {
        "steps": int(steps[-1]["step"]),
        "trained_s": round(trained_s, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / max(trained_s, 1e-9), 1),
        "loss_last": steps[-1].get("loss"),
    }


def _lossless(rep: dict) -> str:
    if rep.get("lossless") is None:
        return "distributional"
    return "yes" if rep["lossless"] else f"NO ({len(rep.get('mismatched_prompts') or [])} differ)"


def tau_rows(ipc_eval: dict, sf_eval: dict) -> list[dict]:
    """One row per set both reports decoded, in the dflash-ipc report's order."""
    rows = []
    for name, a in ipc_eval["sets"].items():
        b = sf_eval["sets"].get(name)
        if b is None:
            continue
        rows.append(
            {
                "set": name,
                "prompts": a["prompts"],
                "tau_ipc": round(a["tau"], 3),
                "tau_specforge": round(b["tau"], 3),
                "ratio": round(a["tau"] / b["tau"], 3) if b["tau"] else None,
                "lossless_ipc": a.get("lossless"),
                "lossless_specforge": b.get("lossless"),
                "lossless": f"{_lossless(a)} / {_lossless(b)}",
            }
        )
    return rows


def format_table(rows: list[dict], ipc_train: dict, sf_train: dict) -> str:
    header = ("set", "prompts", "tau dflash-ipc", "tau SpecForge", "ipc / SF", "lossless (ipc / SF)")
    cells = [header]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        cells.append((r["set"], str(r["prompts"]), f"{r['tau_ipc']:.2f}", f"{r['tau_specforge']:.2f}", ratio, r["lossless"]))
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"training: dflash-ipc {ipc_train['steps']} steps in {ipc_train['trained_s']:.1f} s ({ipc_train['tokens_per_s']:,.0f} tok/s); "
        f"SpecForge {sf_train['steps']} steps in {sf_train['trained_s']:.1f} s ({sf_train['tokens_per_s']:,.0f} tok/s, "
        f"{sf_train.get('anchors_per_step_mean', 0):,.0f} anchors/step)"
    )
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ipc-eval", required=True)
    p.add_argument("--sf-eval", required=True)
    p.add_argument("--ipc-run", required=True)
    p.add_argument("--sf-train", required=True)
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    ipc_eval, sf_eval = last_json_line(args.ipc_eval), last_json_line(args.sf_eval)
    ipc_train = ipc_run_summary(args.ipc_run)
    sf_train = json.loads(Path(args.sf_train).read_text())
    rows = tau_rows(ipc_eval, sf_eval)
    print(format_table(rows, ipc_train, sf_train))
    keep = (
        *("steps", "trained_s", "warmup_s", "tokens_per_s", "anchors_per_step_mean"),
        *("schedule", "schedule_total_steps", "num_anchors_per_seq", "token_budget"),
    )
    result = {
        "kind": "tau",
        "rows": rows,
        "eval": {k: ipc_eval.get(k) for k in ("max_new", "dtype", "temperature", "humaneval_as")},
        "dflash_ipc": {**ipc_train, "run": str(args.ipc_run), "drafter": ipc_eval.get("drafter")},
        "specforge": {**{k: sf_train.get(k) for k in keep}, "drafter": sf_eval.get("drafter")},
        "all_lossless": all(r["lossless_ipc"] is not False and r["lossless_specforge"] is not False for r in rows),
    }
    line = json.dumps(result)
    print(line)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
