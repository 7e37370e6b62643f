"""SpecForge 0.2.0's DFlash training step behind an in-process Hugging Face target, on random tokens.

SpecForge 0.2.0 dropped its in-process HF target backend (``model.target_backend`` only accepts
"sglang"; online training needs an external SGLang capture server plus Mooncake). This script
rebuilds the HF path its last version with one had (``scripts/train_dflash.py
--target-model-backend hf``, removed in commit 2a17d425): ``AutoModelForCausalLM`` forward with
``output_hidden_states=True``, the captured layers concatenated, then SpecForge 0.2.0's own
training step, unchanged:

  specforge.distributed.init_distributed            (one rank: nccl on CUDA, gloo on CPU)
  specforge.modeling.draft.dflash.DFlashDraftModel  (the drafter, Qwen3 layers, flex/sdpa attention)
  specforge.algorithms.common.dflash_family_model.OnlineDFlashModel  (anchors, masks, chunked CE, gamma decay)
  specforge.training.backend.FSDPTrainingBackend    (FSDP SHARD_GRAD_OP, bf16 mixed precision, as `specforge train`)
  specforge.optimizer.BF16Optimizer                 (AdamW over fp32 masters, grad clip, warmup + cosine)
  specforge.training.controller.TrainerCore         (forward_loss -> backward -> loss-normalised grads -> step)

``--lengths mixed``: each sequence's length drawn from shapes.doc_lengths (the draw make_data.py takes),
every batch padded to its longest sequence (right padding, attention mask and loss mask 0 there), as
SpecForge's collator pads; tokens/s counts the real tokens.

Prints one JSON line: steady-state tokens/s (target + drafter, the first --warmup steps excluded), the
split of a step between the target forward and the drafter's step, and peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, default_layer_ids, doc_lengths, hf_config, specforge_draft_config  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=0, help="sequences per step (0: the shape's default)")
    p.add_argument("--steps", type=int, default=20, help="timed + warm-up steps in all")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the steady figures")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=0, help="0: the shape's (8 SmolLM2, 16 8B)")
    p.add_argument("--num-anchors", type=int, default=512, help="per sequence (SpecForge training.num_anchors)")
    p.add_argument("--gamma", type=float, default=0.0, help="loss_decay_gamma (0: the shape's: 4 / 7)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--attention", choices=["flex_attention", "sdpa", "eager"], default="flex_attention")
    p.add_argument(
        "--layer-types",
        choices=["ipc", "full"],
        default="ipc",
        help="ipc: 4 sliding (window 2048) + 1 full, as dflash-ipc's default drafter; full: SpecForge's generated default",
    )
    p.add_argument(
        "--target-forward",
        choices=["causal-lm", "stack"],
        default="causal-lm",
        help="causal-lm: SpecForge's HF backend (whole CausalLM, logits, output_hidden_states); "
        "stack: decoder layers up to the last captured one, no head (dflash-ipc's capture)",
    )
    p.add_argument("--supervised", type=float, default=0.7, help="loss-masked share at the end of each sequence")
    p.add_argument("--lengths", choices=["fixed", "mixed"], default="fixed", help="sequence lengths (module docstring)")
    p.add_argument("--batches", type=int, default=0, help="distinct random batches, cycled (0: 3 fixed, 8 mixed)")
    p.add_argument("--objective-chunk-blocks", type=int, default=128)
    p.add_argument("--no-fsdp", action="store_true", help="skip the FSDP wrap (plain module)")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--out", default="", help="also write the JSON result here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ["SPECFORGE_DEVICE"] = device_type
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))

    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.distributed import destroy_distributed, init_distributed
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import DFlashTrainStrategy
    from transformers import AutoModelForCausalLM

    shape = SHAPES[args.shape]
    block = args.block_size or shape["drafter"]["block_size"]
    gamma = args.gamma or shape["drafter"]["gamma"]
    batch = args.batch or shape["drafter"]["batch"]
    S = args.seq_len
    dtype = torch.bfloat16

    init_distributed(timeout=10, tp_size=1)
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)

    # ---- the target: random weights, built on the device
    tcfg = hf_config(args.shape)
    tcfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
    target.eval().requires_grad_(False)
    n_layers = int(tcfg.num_hidden_layers)
    layer_ids = default_layer_ids(n_layers, args.draft_layers)
    build_target_s = time.perf_counter() - t0

    # ---- SpecForge's draft config, generated from the target as populate_dflash_generated_config does
    mask_token_id = int(tcfg.vocab_size) - 1
    if args.layer_types == "ipc":
        layer_types = ["sliding_attention"] * (args.draft_layers - 1) + ["full_attention"]
    else:
        layer_types = ["full_attention"] * args.draft_layers
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    rope = getattr(tcfg, "rope_parameters", None) or {}
    dcfg = specforge_draft_config(
        vocab_size=tcfg.vocab_size,
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_layers=args.draft_layers,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(tcfg, "rope_theta", 1e6)),
        max_position_embeddings=tcfg.max_position_embeddings,
        layer_types=layer_types,
        sliding_window=2048,
        block_size=block,
        num_target_layers=n_layers,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        attention=args.attention,
    )
    draft = DFlashDraftModel(dcfg).to(device=device, dtype=dtype)
    draft.mask_token_id = mask_token_id

    # ---- the frozen target embedding / LM head SpecForge keeps beside the drafter (TargetEmbeddingsAndHead,
    # here copied from the in-memory target instead of read back from its safetensors)
    parts = TargetEmbeddingsAndHead(tcfg)
    with torch.no_grad():
        parts.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if tcfg.tie_word_embeddings:
            parts.lm_head.weight = parts.embed_tokens.weight
        else:
            parts.lm_head.weight.copy_(target.get_output_embeddings().weight)
    parts.to(device=device, dtype=dtype).eval().requires_grad_(False)

    model = OnlineDFlashModel(
        draft_model=draft,
        target_lm_head=parts.lm_head,
        target_embed_tokens=parts.embed_tokens,
        mask_token_id=mask_token_id,
        block_size=block,
        attention_backend=args.attention,
        num_anchors=args.num_anchors,
        loss_decay_gamma=gamma,
        objective_chunk_blocks=args.objective_chunk_blocks,
        loss_type="dflash",
    ).to(device=device, dtype=dtype)

    def optimizer_factory(module):
        return BF16Optimizer(
            module, lr=args.lr, max_grad_norm=1.0, warmup_ratio=0.04, lr_scheduler="cosine", total_steps=max(args.steps, 1)
        )

    use_fsdp = not args.no_fsdp and device.type != "cpu"  # FSDP1 needs an accelerator: a CPU smoke run goes unwrapped
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(tp_size=1), optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(model, wrap=use_fsdp, optimizer_target=model.draft_model)
    wrapped.train()
    core = TrainerCore(DFlashTrainStrategy(wrapped), backend, accumulation_steps=1)

    # ---- the target's capture: SpecForge's HFDFlashTargetEngine.generate_dflash_data, or the bare stack
    stack = target.model
    last = max(layer_ids)

    @torch.no_grad()
    def capture(input_ids, attention_mask):
        if args.target_forward == "causal-lm":
            out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        # the stack up to the last captured layer, no final norm / head / logits
        h = stack.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        pe = stack.rotary_emb(h, pos)
        captured = []
        for i, layer in enumerate(stack.layers[: last + 1]):
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
            if i in layer_ids:
                captured.append(h)
        return torch.cat(captured, dim=-1)

    # ---- random token batches (a few, cycled), the loss mask on each sequence's last --supervised share
    gen = torch.Generator(device="cpu").manual_seed(0)
    n_batches = args.batches or (3 if args.lengths == "fixed" else 8)
    batches = []
    for i in range(n_batches):
        lens = doc_lengths(batch, S, args.lengths, seed=i)
        width = max(lens)
        ids = torch.randint(0, int(tcfg.vocab_size) - 2, (batch, width), generator=gen)
        am = torch.zeros(batch, width, dtype=torch.long)
        lm = torch.zeros(batch, width, dtype=torch.long)
        for j, n in enumerate(lens):
            am[j, :n] = 1
            lm[j, int(round(n * (1.0 - args.supervised))) : n] = 1
        batches.append((ids.to(device), am.to(device), lm.to(device), sum(lens)))

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for step in range(args.steps):
        ids, am, lm, real_tokens = batches[step % n_batches]
        sync()
        a = time.perf_counter()
        hidden = capture(ids, am)
        sync()
        b = time.perf_counter()
        res = core.train_step(
            TrainBatch(
                sample_ids=[f"s{step}-{j}" for j in range(ids.shape[0])],
                strategy="dflash",
                tensors={"input_ids": ids, "hidden_states": hidden, "loss_mask": lm},
            )
        )
        del hidden
        sync()
        c = time.perf_counter()
        loss = float(res.loss) if hasattr(res, "loss") else float("nan")
        rows.append({"step": step, "target_s": b - a, "drafter_s": c - b, "step_s": c - a, "loss": loss, "tokens": real_tokens})
        print(
            f"[specforge {args.shape}] step {step}: target {b - a:.3f}s drafter {c - b:.3f}s "
            f"-> {real_tokens / (c - a):,.0f} tok/s loss {loss:.4f}",
            file=sys.stderr,
            flush=True,
        )

    steady = rows[args.warmup :] or rows[-1:]
    mean = lambda k: statistics.fmean(r[k] for r in steady)  # noqa: E731
    med = lambda k: statistics.median(r[k] for r in steady)  # noqa: E731
    tokens = statistics.fmean(r["tokens"] for r in steady)  # real tokens per step (padding left out)
    result = {
        "trainer": "specforge-0.2.0 (HF target in-process)",
        "shape": args.shape,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seq_len": S,
        "lengths": args.lengths,
        "batch": batch,
        "tokens_per_step": tokens,
        "draft_layers": args.draft_layers,
        "layer_types": layer_types,
        "target_layer_ids": layer_ids,
        "block_size": block,
        "num_anchors_per_seq": args.num_anchors,
        "anchors_per_step": min(args.num_anchors, S - 1) * batch,  # at most (mixed: short sequences have fewer)
        "loss_decay_gamma": gamma,
        "lr": args.lr,
        "attention": args.attention,
        "target_forward": args.target_forward,
        "fsdp": use_fsdp,
        "steps": args.steps,
        "warmup_steps_excluded": min(args.warmup, len(rows) - len(steady)),
        "build_target_s": round(build_target_s, 2),
        "steady_step_s_mean": round(mean("step_s"), 4),
        "steady_step_s_median": round(med("step_s"), 4),
        "steady_target_s_mean": round(mean("target_s"), 4),
        "steady_drafter_s_mean": round(mean("drafter_s"), 4),
        "tokens_per_s": round(tokens / mean("step_s"), 1),
        "mean_tokens_per_step": round(tokens, 1),
        "tokens_per_s_median_step": round(tokens / med("step_s"), 1),
        "target_only_tokens_per_s": round(tokens / mean("target_s"), 1),
        "drafter_only_tokens_per_s": round(tokens / mean("drafter_s"), 1),
        "first_step_s": round(rows[0]["step_s"], 3),
        "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]],
    }
    if device.type == "cuda":
        result["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    destroy_distributed()
    return result


if __name__ == "__main__":
    main()
