"""One table from run.sh's results.jsonl: training tokens/s per trainer, shape, lengths and variant, peak GPU
memory, combined MFU, then dflash-ipc over SpecForge and both trainers' combined MFU per shape and lengths.

    python summarize.py results.jsonl [more.jsonl ...]

It imports dflash_ipc (run from the project's root with the package installed, as run.sh does) for the
FLOP counts below, so the table and the product count the same matmuls.

MFU counting rule (matmul FLOPs, a multiply-add = 2 FLOPs, over the step time and ``PEAK_TFLOPS``):

* target, per step: 2 x its matmul parameters x tokens per step. The parameters are those of the decoder
  layers through the last captured one (the layers the drafter needs; dflash-ipc runs exactly these),
  counted from the shape's transformers config (shapes.hf_config) by
  ``dflash_ipc.target.flops.layer_matmul_params``: every Linear of attention and MLP; for the Qwen3.5 hybrid's
  GatedDeltaNet layers their linear projections (qkv, z, a, b, out) and the tiny depthwise conv kernel, at the
  same 2 FLOPs per parameter per token. Embeddings, norms, attention scores (QK^T, PV) and the GatedDeltaNet
  state recurrence are left out. No LM head: both benches take the target's hidden states. SpecForge's
  ``causal-lm`` target forward (its former HF backend: the whole CausalLM with ``output_hidden_states``) also
  runs the layers past the last captured one, the final norm and the LM head over every token, whose outputs
  are thrown away; that work is not counted in ``MFU`` (a trainer is not credited for discarded work), and
  the per-shape lines give SpecForge's figure with it counted as well ("as run").
* drafter, per step: ``dflash_ipc.bench.drafter_step.gemm_flops`` on the drafter the row ran (5 layers at the
  target's widths, the row's block size, the whole vocabulary in the head), with query tokens = anchors x
  block size, context tokens = tokens per step, loss rows = anchors x (block size - 1): every trained layer
  weight 6 FLOPs per parameter per query token (forward + both gradients), the context K/V projections over
  the context tokens, ``fc`` forward + weight gradient, the frozen LM head forward + input gradient
  (4 x rows x hidden x vocab). Attention scores left out.
* combined MFU = (target + drafter FLOPs per step) / step time / peak; SpecForge's step time is its measured
  step (target forward, then drafter step), dflash-ipc's is tokens per step / its pipeline tokens/s (target and
  drafter processes sharing the GPU). drafter MFU = drafter FLOPs / the drafter step's time: SpecForge's
  drafter step runs alone on the GPU after the target's forward; dflash-ipc's (``drafter_step_split_s``) runs
  beside the target process on the same GPU, so it is the drafter's rate while sharing it.
* Both trainers at the same shape and anchors per step on fixed-length documents count the same FLOPs per step
  (the same target layers, the same tokens, the same drafter), so their combined-MFU ratio equals their
  tokens/s ratio; the MFU adds how far each is from the GPU's peak.
* ``mixed`` lengths: ``anchors_per_step`` is a cap (short documents hold fewer anchors), so the drafter's
  count and the MFU are upper bounds, printed with a leading "<".

``PEAK_TFLOPS``: 790, bf16 matrix products measured on an H200 (the ``--peak-tflops`` default of dflash-ipc's
benches; the data sheet's dense bf16 figure is higher).
"""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, default_layer_ids, hf_config  # noqa: E402

PEAK_TFLOPS = 790.0
DRAFT_LAYERS = 5  # both benches' drafter (shapes.py)


def target_flops(shape: str, tokens: float, layers: int, head: bool = False) -> float:
    """Matmul FLOPs of the target's forward over ``tokens`` through decoder layers 0..``layers``-1, plus the
    LM head over every token when ``head`` (module docstring)."""
    from dflash_ipc.target.flops import layer_matmul_params
    from dflash_ipc.target_spec.hf_config import text_config

    cfg = hf_config(shape)
    tc = text_config(cfg)
    params = sum(layer_matmul_params(cfg)[:layers])
    if head:
        params += int(tc.hidden_size) * int(tc.vocab_size)
    return 2.0 * params * tokens


def drafter_model_config(shape: str, block_size: int, draft_layers: int = DRAFT_LAYERS):
    """The drafter's ``DrafterModelConfig`` over ``shape``'s target, as dflash-ipc resolves it (default layers)."""
    from dflash_ipc.config.drafter import DrafterConfig
    from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig

    cfg = hf_config(shape)
    layer_ids = default_layer_ids(int(cfg.num_hidden_layers), draft_layers)
    drafter = DrafterConfig(num_layers=draft_layers, block_size=block_size)
    return DrafterModelConfig.from_configs(drafter, cfg, layer_ids, int(cfg.vocab_size) - 1)


def drafter_flops(shape: str, anchors: int, tokens: float, block_size: int, draft_layers: int = DRAFT_LAYERS) -> float:
    """Matmul FLOPs of one drafter step: ``gemm_flops`` (it reads only the model's config) at ``anchors``."""
    from dflash_ipc.bench.drafter_step import gemm_flops

    model = types.SimpleNamespace(config=drafter_model_config(shape, block_size, draft_layers))
    layers, head = gemm_flops(model, int(tokens), anchors * block_size, anchors * (block_size - 1))
    return layers + head


def row_figures(r: dict) -> dict:
    """A result row's FLOPs per step and its MFUs (None where the row has no time for them): ``mfu``
    (combined), ``drafter_mfu``, and for SpecForge's ``causal-lm`` forward ``mfu_as_run`` (module docstring)."""
    shape, dcfg = r["shape"], r.get("drafter_cfg") or {}
    defaults = SHAPES[shape]["drafter"]
    block = int(r.get("block_size") or dcfg.get("block_size") or defaults["block_size"])
    draft_layers = int(r.get("draft_layers") or dcfg.get("num_layers") or DRAFT_LAYERS)
    tokens = float(r.get("tokens_per_step") or defaults["batch"] * int(r.get("seq_len") or 2048))
    num_layers = int(hf_config(shape).num_hidden_layers)
    layers_run = max(r.get("target_layer_ids") or default_layer_ids(num_layers, draft_layers)) + 1
    f_target = target_flops(shape, tokens, layers_run)
    f_drafter = drafter_flops(shape, int(r["anchors_per_step"]), tokens, block, draft_layers)
    out = {"tokens_per_step": tokens, "target_flops": f_target, "drafter_flops": f_drafter, "upper_bound": r.get("lengths") == "mixed"}
    if r.get("trainer", "").startswith("specforge"):
        step_s, drafter_s = r.get("steady_step_s_mean"), r.get("steady_drafter_s_mean")
        if r.get("target_forward", "causal-lm") == "causal-lm" and step_s:
            as_run = target_flops(shape, tokens, num_layers, head=True) + f_drafter
            out["mfu_as_run"] = as_run / step_s / (PEAK_TFLOPS * 1e12)
    else:
        ipc = r.get("variants", {}).get("cuda-ipc", {})
        rate = ipc.get("tokens_per_s") or 0
        step_s = tokens / rate if rate else None
        drafter_s = (ipc.get("drafter_step_split_s") or {}).get("step_s")
    peak = PEAK_TFLOPS * 1e12
    out["mfu"] = (f_target + f_drafter) / step_s / peak if step_s else None
    out["drafter_mfu"] = f_drafter / drafter_s / peak if drafter_s else None
    return out


def fmt_mfu(value: float | None, upper_bound: bool = False) -> str:
    return "-" if value is None else f"{'≤' if upper_bound else ''}{value:.2f}"


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
    f"{'anchors':>8} {'GiB':>6} {'MFU':>5} {'drafter MFU':>11}  notes"
)


def mfu_columns(fig: dict) -> str:
    return f"{fmt_mfu(fig['mfu'], fig['upper_bound']):>5} {fmt_mfu(fig['drafter_mfu'], fig['upper_bound']):>11}"


def specforge_line(r: dict, fig: dict) -> tuple[str, float]:
    variant = f"{r['target_forward']},{r['attention'][:4]},{'fsdp' if r['fsdp'] else 'plain'}"
    note = f"batch {r['batch']}x{r['seq_len']}, step {r['steady_step_s_mean']:.3f}s (target {r['steady_target_s_mean']:.3f})"
    line = (
        f"{'specforge':<11} {r['shape']:<12} {r.get('lengths', 'fixed'):<6} {variant:<26} {r['tokens_per_s']:>9,.0f} "
        f"{r['tokens_per_s_median_step']:>9,.0f} {r['target_only_tokens_per_s']:>11,.0f} {r['anchors_per_step']:>8} "
        f"{r.get('peak_gpu_allocated_gib', '-'):>6} {mfu_columns(fig)}  {note}"
    )
    return line, r["tokens_per_s"]


def ipc_line(r: dict, fig: dict) -> tuple[str, float]:
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
        f"{r.get('anchors_per_step', ''):>8} {gib(peak):>6} {mfu_columns(fig)}  {note}"
    )
    return line, ipc.get("tokens_per_s", 0) or 0


def print_pairs(ipc: list[tuple], sf: dict[tuple, tuple[float, dict]]) -> None:
    """dflash-ipc over SpecForge in tokens/s, then both trainers' combined MFU, per shape, lengths and anchors."""
    pairs = []
    for key, name, rate, anchors, fig in ipc:  # after every row is read: the SpecForge rows may come later
        other = sf.get(key + (anchors,)) or sf.get(key + ("default",))
        if other:
            pairs.append((key, name, anchors, rate, fig, *other))
    if not pairs:
        return
    print("\ndflash-ipc / SpecForge tokens/s (SpecForge at the same shape, lengths and anchors per step, else at 512 per sequence):")
    for (shape, lengths), name, _, rate, _, sf_rate, _ in pairs:
        print(f"  {shape:<12} {lengths:<6} {name:<26} {rate / sf_rate:.2f}")
    print(f"\ncombined MFU, target + drafter matmul FLOPs per step / step time / {PEAK_TFLOPS:.0f} TFLOP/s (summarize.py's docstring):")
    for (shape, lengths), name, anchors, _, fig, _, sf_fig in pairs:
        bound = fig["upper_bound"] or sf_fig["upper_bound"]
        line = f"  {shape:<12} {lengths:<6} {name:<26} {anchors:>6} anchors: combined MFU dflash-ipc {fmt_mfu(fig['mfu'], bound)} "
        line += f"vs SpecForge {fmt_mfu(sf_fig['mfu'], bound)}"
        if sf_fig.get("mfu_as_run") is not None:
            line += f" (as run, its discarded layers and LM head counted: {fmt_mfu(sf_fig['mfu_as_run'], bound)})"
        print(line)


def main(paths) -> None:
    print(HEADER)
    sf: dict[tuple, tuple[float, dict]] = {}
    ipc: list[tuple] = []
    for r in rows(paths):
        t = r.get("trainer", "")
        if t.startswith("specforge"):
            fig = row_figures(r)
            line, rate = specforge_line(r, fig)
            key = (r["shape"], r.get("lengths", "fixed"))
            sf[key + (r["anchors_per_step"],)] = (rate, fig)
            if r.get("num_anchors_per_seq") == 512:  # SpecForge's default budget: what dflash-ipc's other rows meet
                sf[key + ("default",)] = (rate, fig)
            print(line)
        elif t == "dflash-ipc":
            if "error" in r:
                print(f"{'dflash-ipc':<11} {r['shape']:<12} {r.get('lengths', 'fixed'):<6} {r['variant']:<26} {'-':>9}  {r['error']}")
                continue
            fig = row_figures(r)
            line, rate = ipc_line(r, fig)
            key = (r["shape"], r.get("lengths", "fixed"))
            ipc.append((key, f"{r['variant']},levers {r.get('levers', '-')}", rate, r.get("anchors_per_step"), fig))
            print(line)
        elif "zlab_load" in r:
            print(
                f"zlab-check: load {r['zlab_load'] or 'clean'}, block logits max diff {r['block_logits_max_abs_diff']}, "
                f"argmax {r['block_argmax_agree']}, lossless {r['all_lossless']}, acceptance identical {r['acceptance_identical']}"
            )
    print_pairs(ipc, sf)


if __name__ == "__main__":
    main(sys.argv[1:])
