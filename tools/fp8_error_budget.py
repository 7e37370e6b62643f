"""Where the FP8 target's hidden-state error comes from, on CPU, at a config's real layer widths.

    python tools/fp8_error_budget.py --config configs/h200-1gpu.toml --layers 2 --tokens 160

Builds the config's spec target cut to its first ``--layers`` decoder layers (vocabulary cut to
2,000: the embedding plays no part in the error), random weights as the benchmarks use, in bf16,
and captures every layer's output for one random document, once in bf16 and once per group of
linear layers put in FP8 (:class:`~dflash_ipc.target.fp8.Fp8Linear`, the real ``_scaled_mm``,
which runs on CPU too): all, the MLPs, the GatedDeltaNet projections, its two small gate
projections, attention. Prints per captured layer the relative error and per-token cosine
against bf16 (the same measure as ``bench/target_forward.py``'s agreement table), and the
per-token norm of the embedding and of each layer's output (a random-weight stack's layers
dwarf its residual input, so nothing dilutes a layer's own error). About 2 minutes for 2 layers
on two CPU cores, ~2 GB of memory.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch import nn

from dflash_ipc.bench.target_forward import agreement, spec_with_layers
from dflash_ipc.config import TargetConfig, load_config
from dflash_ipc.target.fp8 import Fp8Linear
from dflash_ipc.target.model import build_target

GROUPS: dict[str, Callable[[str], bool]] = {
    "all": lambda n: True,
    "mlp": lambda n: ".mlp." in n,
    "gdn_projections": lambda n: ".linear_attn." in n and not n.endswith(("in_proj_a", "in_proj_b")),
    "gdn_gates_a_b": lambda n: n.endswith(("in_proj_a", "in_proj_b")),
    "attention": lambda n: ".self_attn." in n,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/h200-1gpu.toml")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="Also write the rows as JSON here.")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    spec = spec_with_layers(load_config(args.config).target.spec, args.layers)
    spec["vocab_size"] = 2000
    model = build_target(TargetConfig(spec=spec, layer_ids=list(range(args.layers)), dtype="bfloat16", varlen=False), "cpu")
    ids = torch.randint(0, 2000, (1, args.tokens))
    ref = [p.detach().clone() for p in model.capture(ids)]
    embed_norm = model.stack.embed_tokens(ids).float().norm(dim=-1).mean().item()
    out_norms = [round(p.float().norm(dim=-1).mean().item(), 1) for p in ref]
    print(f"per-token norm: embedding {embed_norm:.2f}, layer outputs {out_norms}", flush=True)
    linears = [(n, m) for n, m in model.stack.named_modules() if type(m) is nn.Linear]
    rows = {}
    for group, keep in GROUPS.items():
        swapped = []
        for name, mod in linears:
            if keep(name):
                parent_name, _, child = name.rpartition(".")
                parent = model.stack.get_submodule(parent_name)
                setattr(parent, child, Fp8Linear(mod))
                swapped.append((parent, child, mod))
        try:
            rows[group] = agreement([ref], [model.capture(ids)], model.layer_ids) if swapped else []
        finally:
            for parent, child, mod in swapped:
                setattr(parent, child, mod)
        cells = " | ".join(f"L{r['layer']} rel {r['rel_error']:.4f} cos {r['cos_mean']:.4f}/{r['cos_min']:.4f}" for r in rows[group])
        print(f"{group:<16} {len(swapped):>3} linears in FP8: {cells or 'none in these layers'}", flush=True)
    if args.out:
        summary = {"config": args.config, "layers": args.layers, "tokens": args.tokens, "embed_norm": embed_norm, "out_norms": out_norms}
        with open(args.out, "w") as f:
            json.dump({**summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
