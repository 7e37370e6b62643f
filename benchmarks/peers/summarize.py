"""One table from run.sh's results.jsonl: training tokens/s per trainer, shape, lengths and variant, peak GPU
memory, then dflash-ipc over SpecForge per shape and lengths.

    python summarize.py results.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import sys


def rows(paths):
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    yield json.loads(line)


def gib(b) -> str:
    return f"{b / 2**30:.1f}" if b else "-"


HEADER = (
    f"{'trainer':<11} {'shape':<12} {'len':<6} {'variant':<26} {'tok/s':>9} {'steady':>9} {'target-only':>11} "
    f"{'anchors':>8} {'GiB':>6}  notes"
)


def specforge_line(r: dict) -> tuple[str, float]:
    variant = f"{r['target_forward']},{r['attention'][:4]},{'fsdp' if r['fsdp'] else 'plain'}"
    note = f"batch {r['batch']}x{r['seq_len']}, step {r['steady_step_s_mean']:.3f}s (target {r['steady_target_s_mean']:.3f})"
    line = (
        f"{'specforge':<11} {r['shape']:<12} {r.get('lengths', 'fixed'):<6} {variant:<26} {r['tokens_per_s']:>9,.0f} "
        f"{r['tokens_per_s_median_step']:>9,.0f} {r['target_only_tokens_per_s']:>11,.0f} {r['anchors_per_step']:>8} "
        f"{r.get('peak_gpu_allocated_gib', '-'):>6}  {note}"
    )
    return line, r["tokens_per_s"]


def ipc_line(r: dict) -> tuple[str, float]:
    v = r.get("variants", {})
    fo, ipc = v.get("forward-only", {}), v.get("cuda-ipc", {})
    peak = max((ipc.get("peak_gpu_mem_bytes") or {}).values(), default=0)
    split = ipc.get("drafter_step_split_s", {})
    note = f"bound by {ipc.get('bound_by')}, drafter step {split.get('step_s')}s, wait {ipc.get('drafter_wait_pct')}%"
    if "error" in ipc:
        note = ipc["error"][:100]
    name = f"{r['variant']},levers {r.get('levers', '-')}"
    line = (
        f"{'dflash-ipc':<11} {r['shape']:<12} {r.get('lengths', 'fixed'):<6} {name:<26} {ipc.get('tokens_per_s', 0):>9,.0f} "
        f"{ipc.get('steady_tokens_per_s', 0) or 0:>9,.0f} {fo.get('target_tokens_per_s', 0):>11,.0f} "
        f"{r.get('anchors_per_step', ''):>8} {gib(peak):>6}  {note}"
    )
    return line, ipc.get("tokens_per_s", 0) or 0


def main(paths) -> None:
    print(HEADER)
    sf: dict[tuple, float] = {}
    ipc: list[tuple[tuple, str, float]] = []
    for r in rows(paths):
        t = r.get("trainer", "")
        if t.startswith("specforge"):
            line, rate = specforge_line(r)
            key = (r["shape"], r.get("lengths", "fixed"))
            sf[key + (r["anchors_per_step"],)] = rate
            if r.get("num_anchors_per_seq") == 512:  # SpecForge's default budget: what dflash-ipc's other rows meet
                sf[key + ("default",)] = rate
            print(line)
        elif t == "dflash-ipc":
            if "error" in r:
                print(f"{'dflash-ipc':<11} {r['shape']:<12} {r.get('lengths', 'fixed'):<6} {r['variant']:<26} {'-':>9}  {r['error']}")
                continue
            line, rate = ipc_line(r)
            key = (r["shape"], r.get("lengths", "fixed"))
            ipc.append((key, f"{r['variant']},levers {r.get('levers', '-')}", rate, r.get("anchors_per_step")))
            print(line)
        elif "zlab_load" in r:
            print(
                f"zlab-check: load {r['zlab_load'] or 'clean'}, block logits max diff {r['block_logits_max_abs_diff']}, "
                f"argmax {r['block_argmax_agree']}, lossless {r['all_lossless']}, acceptance identical {r['acceptance_identical']}"
            )
    pairs = []
    for key, name, rate, anchors in ipc:  # after every row is read: the SpecForge rows may come later
        other = sf.get(key + (anchors,)) or sf.get(key + ("default",))
        if other:
            pairs.append((key, name, rate / other))
    if pairs:
        print("\ndflash-ipc / SpecForge tokens/s (SpecForge at the same shape, lengths and anchors per step, else at 512 per sequence):")
        for (shape, lengths), name, ratio in pairs:
            print(f"  {shape:<12} {lengths:<6} {name:<26} {ratio:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
