"""A dflash-ipc config (TOML) for one of shapes.py's shapes, target and drafter sharing one device.

Variants (the work per step is what differs):
  parity : the SpecForge bench's work per step: 512 anchors per document, no per-batch cap, the whole
           vocabulary in the head; block / gamma / layers as shapes.py.
  native : the project's own anchor budget at that size: SmolLM2 96 anchors per document
           (smollm2-1gpu-synth.toml, which also trains a 16,384-row draft vocabulary: not here, random
           tokens have no frequencies), 8B and 27B max_anchors_per_batch 1024 (bench-9b-x2.toml / h200-1gpu.toml).

Speed options (``--levers``): ``on`` (default): drafter.compile + training.ce_compile at every size,
drafter.anchor_chunk "auto" (drafter/training/memory_plan.py) and the drafter reading same-GPU ring slots in place
(transport.drafter_in_place "auto"); ``off``: the earlier settings (SmolLM2 compiled, 8B without compile,
anchor_chunk 1024 at parity, slots copied out).

FP8 (``--fp8-linears``, run.sh's ``FP8_LINEARS``): ``drafter.fp8_linears``, the drafter's linears trained with
FP8 matmuls through torchao ("rowwise" or "tensorwise"; default "none").
FP8 loss head (``--ce-fp8``, default on when the environment has ``CE_FP8=1``): training.ce_fp8, the frozen
head's two GEMMs in the chunked CE in e4m3.

Lengths (``--lengths``): ``fixed`` (every document ``--seq-len`` tokens) or ``mixed`` (shapes.doc_lengths);
the data file must match (make_data.py --lengths). A Qwen3.5 shape's target is built from ``target.spec``
(random weights), with the tokenizer make_target.py wrote in ``--model``.

    python gen_ipc_config.py --shape smollm2 --variant parity --model /root/peer-bench/smollm2 \
        --data /root/peer-bench/data.jsonl --out /root/peer-bench/smollm2-parity.toml [--device cuda:0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, qwen3_5_spec  # noqa: E402


def toml_value(v) -> str:
    return json.dumps(v)  # strings, numbers, bools and flat lists read the same in TOML


def build(
    shape: str,
    variant: str,
    model: str,
    data: str,
    device: str,
    seq_len: int,
    batch: int,
    epochs: int,
    levers: str = "on",
    lengths: str = "fixed",
    fp8_linears: str = "none",
) -> dict:
    s = SHAPES[shape]
    d = s["drafter"]
    batch = batch or d["batch"]
    spec = qwen3_5_spec(shape) if s["arch"] == "qwen3_5" else None
    big = (spec or s["config"])["hidden_size"] >= 2048
    on_cuda = device.startswith("cuda")
    drafter = {
        "num_layers": 5,
        "block_size": d["block_size"],
        "sliding_window": 2048,
        "num_anchors": 512,
        "max_anchors_per_batch": 0,
        "noise_std": 0.0,
        "dtype": "bfloat16" if on_cuda else "float32",
        "attention": "auto",
    }
    if fp8_linears != "none":
        drafter["fp8_linears"] = fp8_linears
    training = {
        "lr": 6e-4,
        "betas": [0.9, 0.999],
        "weight_decay": 0.0,
        "warmup_fraction": 0.04,
        "max_steps": 0,
        "grad_clip": 1.0,
        "loss_gamma": d["gamma"],
        "checkpoint_every": 0,
        "checkpoint_on_finish": False,
        "export_on_finish": False,
    }
    transport = {"backend": "auto", "ring_slots": 4, "max_outstanding_per_drafter": 2, "drafter_prefetch": 1}
    if big:
        training["ce_chunk_tokens"] = 4096
        if variant == "parity":
            drafter["anchor_chunk"] = 1024
        else:
            drafter["max_anchors_per_batch"] = 1024
    else:
        transport.update(max_outstanding_per_drafter=3, drafter_prefetch=2)
        if on_cuda:
            drafter["compile"] = True
            training.update(ce_compile=True, ce_chunk_tokens=8192)
        if variant == "native":
            drafter["num_anchors"] = 96
    if levers == "on":
        drafter["compile"] = on_cuda
        training["ce_compile"] = on_cuda
        transport["drafter_in_place"] = "auto"
        if big:
            drafter["anchor_chunk"] = "auto"
    else:
        transport["drafter_in_place"] = False
    if not on_cuda:
        transport["backend"] = "cpu-shm"
    # the model folder holds a checkpoint (Llama / Qwen3) or, for a Qwen3.5 spec, the tokenizer alone
    target = {"model_path": model} if spec is None else {"tokenizer": model, "spec": spec}
    return {
        "run": {
            "name": f"peers-{shape}-{variant}",
            "seed": 0,
            "handshake_timeout_s": 900,
            "heartbeat_interval_s": 1.0,
            "heartbeat_timeout_s": 600,
            "teardown_grace_s": 30,
        },
        "topology": {"targets": [device], "drafters": [device]},
        "transport": transport,
        "data": {
            "paths": [data],
            "max_seq_len": seq_len,
            "bucket_edges": [seq_len],
            "token_budget": batch * seq_len,
            # mixed lengths: as many documents as the token budget packs (mean ~470 tokens)
            "max_batch_size": batch if lengths == "fixed" else max(batch, batch * seq_len // 64),
            "num_epochs": epochs,
        },
        # target.tokenizer unset: the checkpoint's own (make_target.py writes one of the model's vocabulary)
        "target": target | {"dtype": "bfloat16" if on_cuda else "float32"},
        "drafter": drafter,
        "training": training,
    }


def _table(name: str, fields: dict, lines: list[str]) -> None:
    lines.append(f"\n[{name}]")
    lines += [f"{k} = {toml_value(v)}" for k, v in fields.items() if not isinstance(v, dict)]
    for k, v in fields.items():
        if isinstance(v, dict):
            _table(f"{name}.{k}", v, lines)


def to_toml(cfg: dict) -> str:
    lines = ["# written by benchmarks/peers/gen_ipc_config.py"]
    for section, fields in cfg.items():
        _table(section, fields, lines)
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--variant", choices=["parity", "native"], default="parity")
    p.add_argument("--model", required=True, help="the random checkpoint folder (make_target.py)")
    p.add_argument("--data", required=True, help="the random-token JSONL (make_data.py)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=0, help="documents per batch (0: the shape's)")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--levers", choices=["on", "off"], default="on", help="the speed options (module docstring)")
    p.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed", help="the data's document lengths (make_data.py)")
    p.add_argument("--fp8-linears", choices=["none", "rowwise", "tensorwise"], default="none", help="drafter.fp8_linears")
    p.add_argument("--ce-fp8", action="store_true", default=os.environ.get("CE_FP8") == "1", help="training.ce_fp8 (env CE_FP8=1)")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=JSON", help="overrides, e.g. drafter.anchor_chunk=0")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = build(
        args.shape,
        args.variant,
        args.model,
        args.data,
        args.device,
        args.seq_len,
        args.batch,
        args.epochs,
        args.levers,
        args.lengths,
        args.fp8_linears,
    )
    if args.ce_fp8:
        cfg["training"]["ce_fp8"] = True
    for item in args.set:
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        try:
            cfg[section][field] = json.loads(value)
        except json.JSONDecodeError:
            cfg[section][field] = value
    with open(args.out, "w") as f:
        f.write(to_toml(cfg))
    print(f"[gen_ipc_config] {args.shape}/{args.variant} -> {args.out}")


if __name__ == "__main__":
    main()
