"""SpecForge 0.2.0's DFlash training step on a dflash-ipc config's data, for a wall-clock budget, exported in
dflash-ipc's layout: the peer side of the τ-per-GPU-minute comparison (README.md, ``STAGE=tau``).

    python specforge_tau.py --config configs/smollm2-1gpu-synth.toml --train-s 420 --out runs/tau/specforge

What trains is SpecForge's own library step, as ``specforge_bench.py`` drives it: ``DFlashDraftModel``,
``OnlineDFlashModel`` (its anchor sampling, masks, chunked whole-vocabulary CE and loss decay), its FSDP
backend on one rank (CUDA; unwrapped on a CPU), ``BF16Optimizer`` (AdamW over fp32 masters, grad clip,
warm-up + cosine) and ``TrainerCore``, behind an in-process Hugging Face target (``--target-forward
causal-lm``: the whole causal LM with ``output_hidden_states``, as SpecForge's former HF backend ran it;
``stack``: dflash-ipc's own capture, the decoder layers up to the last captured one).

Held equal to the dflash-ipc run of the same config:

* the data: the config's records read by dflash-ipc's reader (``load_corpus``: the same token ids, gen-data's
  stored answer ids included, and the same loss masks), drawn by dflash-ipc's plan (``plan_epoch``: the
  mix's weights, the length buckets, the run's seed), each batch right-padded to its longest record as
  SpecForge's collator pads, at ``--token-budget`` padded positions per step;
* the drafter: the config's shape (layers, layer types, sliding window, block size, widths), its captured
  target layers, its lr, betas, weight decay, warm-up share, grad clip and ``training.loss_gamma``;
* the seconds: ``--train-s`` (or ``--train-s-from`` the dflash-ipc run: the seconds its ``metrics.jsonl``
  records) counts training from the first step's start (target forward, drafter step, optimizer) to the
  last step's end, as ``training.max_seconds`` does; start-up, one warm-up forward + backward on the first
  batch (the compiles: dflash-ipc's ``drafter.warm_up`` runs before its clock too) and the export are
  outside. Training ends at the step boundary nearest the budget (dflash-ipc plans its last step to end on it).

SpecForge's own, where the recipes differ: ``--num-anchors`` 512 per sequence (SpecForge's default), the
whole vocabulary in the head, its loss decay ``exp(-(k-1)/gamma)``, its mask-token choice
(``resolve_mask_token_id``), its initialisation. The cosine's length: SpecForge takes ``total_steps`` up
front; ``--total-steps 0`` (default) sets it as a user who knows the step time would: from the pace of
steps PACE_FROM..PLAN_AT (so the cosine ends at ``--train-s``; those first steps ran at the start of a
provisional warm-up). Training stops at the budget or at the planned last step, whichever comes first.

Writes, under ``--out``:
  specforge/training_state.pt, specforge/draft_config.json   SpecForge's checkpoint of the draft (its
                                                             controller's ``draft_state_dict``) and config
  specforge/hf                                               SpecForge's own export (``export_to_hf``)
  export                                                     the same drafter in dflash-ipc's layout
                                                             (specforge_export.py): ``eval --drafter``
  train.json                                                 what ran (also printed as the last line)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shapes  # noqa: E402
import specforge_export  # noqa: E402
from tau_table import ipc_run_summary  # noqa: E402

#: steps left out of the pace (compiles, allocator warm-up) and the step the schedule is fitted at
PACE_FROM, PLAN_AT = 3, 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the dflash-ipc run's config (TOML)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="SECTION.KEY=VALUE over the config (as `up --set`)")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--train-s", type=float, help="seconds of training steps (the dflash-ipc run's training.max_seconds)")
    when.add_argument("--train-s-from", metavar="RUN_DIR", help="as many seconds as this dflash-ipc run trained (its metrics.jsonl)")
    p.add_argument("--out", required=True, help="output folder (module docstring)")
    p.add_argument("--num-anchors", type=int, default=512, help="anchors per sequence (SpecForge training.num_anchors)")
    p.add_argument("--token-budget", type=int, default=32768, help="padded positions per step (0: the config's data.token_budget)")
    p.add_argument("--max-batch-size", type=int, default=0, help="sequences per step at most (0: the config's)")
    p.add_argument("--total-steps", type=int, default=0, help="the cosine's length (0: fitted to --train-s, module docstring)")
    p.add_argument("--target-forward", choices=["causal-lm", "stack"], default="causal-lm")
    p.add_argument("--attention", choices=["auto", "flex_attention", "sdpa"], default="auto", help="auto: flex on CUDA, sdpa elsewhere")
    dtypes = ["auto", "bfloat16", "float32"]
    p.add_argument("--dtype", choices=dtypes, default="auto", help="the draft's weights; auto: bf16 (SpecForge's) on CUDA, fp32 on CPUs")
    p.add_argument("--objective-chunk-blocks", type=int, default=128, help="SpecForge training.objective_chunk_blocks")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_specforge(device_type: str) -> None:
    """One SpecForge rank in this process (nccl on CUDA, gloo on a CPU), as specforge_bench.py starts it."""
    os.environ["SPECFORGE_DEVICE"] = device_type
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from specforge.distributed import init_distributed

    init_distributed(timeout=10, tp_size=1)


def drafter_shape(cfg, tokenizer):
    """dflash-ipc's drafter shape for ``cfg`` (the same the dflash-ipc run trains), with SpecForge's mask token;
    and the target's HF config."""
    from specforge.training.model_utils import resolve_mask_token_id

    from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig
    from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids, text_config

    hf_config = load_hf_config(cfg.target, vocab_size=len(tokenizer))
    text = text_config(hf_config)
    layer_ids = resolve_layer_ids(cfg.target, int(text.num_hidden_layers))
    mask_id = resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=int(text.vocab_size))
    whole_head = dataclasses.replace(cfg.drafter, draft_vocab_size=0)  # SpecForge's head: the whole vocabulary
    return DrafterModelConfig.from_configs(whole_head, hf_config, layer_ids, int(mask_id)), hf_config


def specforge_draft_config(shape, attention: str):
    """SpecForge's ``DFlashDraftModel`` config of dflash-ipc's drafter shape (the inverse of specforge_export)."""
    return shapes.specforge_draft_config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        max_position_embeddings=shape.max_position_embeddings,
        layer_types=list(shape.layer_types),
        sliding_window=shape.sliding_window,
        block_size=shape.block_size,
        num_target_layers=shape.num_target_layers,
        target_layer_ids=shape.target_layer_ids,
        mask_token_id=shape.mask_token_id,
        attention=attention,
        initializer_range=shape.initializer_range,
    )


def _frozen_tables(embed: torch.Tensor, head: torch.Tensor):
    """The target's embedding and LM head as the frozen modules SpecForge keeps beside its drafter."""
    emb = torch.nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=head.device, dtype=head.dtype)
    with torch.no_grad():
        lm_head.weight.copy_(head)
    lm_head.requires_grad_(False)
    return emb, lm_head


@dataclasses.dataclass
class Step:
    """SpecForge's training step and what it needs to save and re-plan."""

    core: object
    backend: object
    draft: object
    dtype: torch.dtype
    warmup_ratio: float
    fsdp: bool


def build_step(cfg, args, shape, embed, head, device, attention: str, total_steps: int) -> Step:
    """SpecForge's drafter, loss wrapper, backend, optimizer and ``TrainerCore``, as specforge_bench.py builds them."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.optimizer import BF16Optimizer
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import DFlashTrainStrategy

    dtype = getattr(torch, args.dtype)
    draft = DFlashDraftModel(specforge_draft_config(shape, attention)).to(device=device, dtype=dtype)
    draft.mask_token_id = shape.mask_token_id
    emb, lm_head = _frozen_tables(embed.to(device, dtype), head.to(device, dtype))
    model = OnlineDFlashModel(
        draft_model=draft,
        target_lm_head=lm_head,
        target_embed_tokens=emb,
        mask_token_id=shape.mask_token_id,
        block_size=shape.block_size,
        attention_backend=attention,
        num_anchors=args.num_anchors,
        loss_decay_gamma=cfg.training.loss_gamma,
        objective_chunk_blocks=args.objective_chunk_blocks,
        loss_type="dflash",
    ).to(device=device, dtype=dtype)
    t = cfg.training
    warmup_ratio = t.warmup_fraction if t.warmup_fraction > 0 else min(0.5, t.warmup_steps / max(total_steps, 1))

    def optimizer_factory(module):
        return BF16Optimizer(
            module,
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.grad_clip if t.grad_clip > 0 else 1e9,
            total_steps=max(total_steps, 2),
            warmup_ratio=warmup_ratio,
            lr_scheduler="cosine",
        )

    fsdp = device.type != "cpu"  # FSDP1 needs an accelerator: a CPU run goes unwrapped (specforge_bench.py)
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(tp_size=1), optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(model, wrap=fsdp, optimizer_target=model.draft_model)
    wrapped.train()
    if tuple(t.betas) != (0.9, 0.999):  # BF16Optimizer builds AdamW with torch's default betas
        for group in backend.optimizer.optimizer.param_groups:
            group["betas"] = tuple(t.betas)
    core = TrainerCore(DFlashTrainStrategy(wrapped), backend, accumulation_steps=1)
    return Step(core, backend, draft, dtype, warmup_ratio, fsdp)


def refit_schedule(optimizer, total_steps: int, done: int, warmup_ratio: float) -> None:
    """Replace ``optimizer``'s (a BF16Optimizer) warm-up + cosine by one of ``total_steps``, advanced to step ``done``."""
    from specforge.lr_scheduler import CosineAnnealingWarmupLR

    optimizer.scheduler = CosineAnnealingWarmupLR(
        optimizer.optimizer, total_steps=total_steps, warmup_steps=int(warmup_ratio * total_steps)
    )
    for _ in range(done):
        optimizer.scheduler.step()


class Capture:
    """The target's captured layers for a right-padded batch (``--target-forward``)."""

    def __init__(self, cfg, mode: str, layer_ids: list[int], vocab_size: int, device):
        self.mode, self.layer_ids = mode, list(layer_ids)
        if mode == "causal-lm":
            from dflash_ipc.eval.target_lm import build_target_lm

            self.lm = build_target_lm(cfg.target, device, vocab_size=vocab_size, dtype=cfg.target.dtype)
        else:
            from dflash_ipc.target.model import build_target

            self.target = build_target(cfg.target, device, vocab_size)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.mode == "causal-lm":
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
            return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return torch.cat(self.target.capture(input_ids), dim=-1)


def planned_batches(data, seed: int, corpus, pad_id: int):
    """``(epoch, input_ids, attention_mask, loss_mask, real tokens)`` of dflash-ipc's plan of ``data`` (a
    DataConfig: its mix, buckets, token budget and batch size) with the run's ``seed``, epoch after epoch."""
    from dflash_ipc.data.plan import plan_epoch

    for epoch in range(data.num_epochs):
        for pb in plan_epoch(corpus.lengths, data, seed, epoch, 1, 0, sources=corpus.sources):
            ids, mask, lens = corpus.collate(list(pb.sample_indices), pad_id, pb.padded_len)
            attn = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).to(torch.long)
            yield epoch, ids, attn, mask.to(torch.long), int(lens.sum())


def anchors_of(loss_mask: torch.Tensor, num_anchors: int) -> int:
    """Anchors SpecForge samples in this batch: per sequence, at most ``num_anchors`` positions whose token
    and next token are both supervised (``OnlineDFlashModel._sample_anchor_positions``)."""
    valid = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    return int(valid.sum(dim=1).clamp(max=num_anchors).sum())


def _train_batch(n: int, ids, hidden, loss_mask):
    from specforge.runtime.contracts import TrainBatch

    tensors = {"input_ids": ids, "hidden_states": hidden, "loss_mask": loss_mask}
    return TrainBatch(sample_ids=[f"b{n}-{j}" for j in range(ids.shape[0])], strategy="dflash", tensors=tensors)


def warm_up(step: Step, capture: Capture, batch, device) -> float:
    """One target forward and one drafter forward + backward on ``batch`` before the clock starts, gradients
    discarded, no optimizer step: the compiles and first allocations, as dflash-ipc's drafter warm-up
    (``drafter.warm_up``) makes them before its run's clock starts. Returns its seconds."""
    t0 = time.perf_counter()
    _, ids, attn, lm, _ = batch
    ids, attn, lm = ids.to(device), attn.to(device), lm.to(device)
    out = step.core.strategy.forward_loss(_train_batch(0, ids, capture(ids, attn).to(step.dtype), lm))
    loss = out.loss if out.loss_terms is None else out.loss_terms[0]
    loss.backward()
    for p in step.backend.module.parameters():
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def train(step: Step, capture: Capture, batches, args, device, max_steps: int) -> dict:
    """Steps until ``--train-s`` seconds of them ran, the planned last step, or the data's end."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first_batch = next(batches, None)
    if first_batch is None:
        raise ValueError("the plan holds no batch: no data to train on")
    warmup_s = warm_up(step, capture, first_batch, device)
    batches = itertools.chain([first_batch], batches)
    total = args.total_steps or max_steps or 1000  # provisional until PLAN_AT (module docstring)
    schedule = "--total-steps" if args.total_steps else f"provisional (fewer than {PLAN_AT} steps ran)"
    fitted, pace = bool(args.total_steps), None
    n = tokens = anchors = 0
    marks: dict[int, float] = {}
    first = last = {}
    epoch = 0
    sync()
    t0 = time.perf_counter()
    for epoch, ids, attn, lm, real in batches:
        ids, attn, lm = ids.to(device), attn.to(device), lm.to(device)
        hidden = capture(ids, attn).to(step.dtype)
        res = step.core.train_step(_train_batch(n, ids, hidden, lm))
        del hidden
        sync()
        n += 1
        elapsed = time.perf_counter() - t0
        tokens, anchors = tokens + real, anchors + anchors_of(lm, args.num_anchors)
        opt = step.backend.optimizer
        last = {
            "step": n,
            "epoch": epoch,
            "loss": float(res.loss),
            "lr": float(opt.scheduler.get_last_lr()[0]),
            "elapsed_s": round(elapsed, 3),
        }
        acc = res.metrics.get("acc", res.metrics.get("accuracy"))
        if acc is not None:
            last["acc"] = round(float(acc), 4)
        first = first or dict(last)
        marks[n] = elapsed
        if not fitted and n == PLAN_AT:
            pace = (elapsed - marks[PACE_FROM]) / (PLAN_AT - PACE_FROM)
            total = n + int(max(0.0, args.train_s - elapsed) / pace) if pace > 0 else n
            total = min(total, max_steps) if max_steps else total
            refit_schedule(opt, max(total, n + 1), n, step.warmup_ratio)
            fitted, schedule = True, f"fitted at step {PLAN_AT} from the pace of steps {PACE_FROM + 1}-{PLAN_AT}"
            print(f"[specforge] {pace:.3f} s per step: the cosine ends at step {total}", file=sys.stderr, flush=True)
        if n % args.log_every == 0 or n == 1:
            rate = f"{tokens / elapsed:,.0f} tok/s"
            print(f"[specforge] step {n}: loss {last['loss']:.4f} lr {last['lr']:.2e} {rate}", file=sys.stderr, flush=True)
        # the budget ends at the nearest step boundary: this step's end, or the next one's if that is nearer
        if elapsed + (elapsed - marks.get(n - 1, 0.0)) / 2 >= args.train_s or n >= total:
            break
    trained_s = time.perf_counter() - t0
    return {
        "warmup_s": round(warmup_s, 2),
        "steps": n,
        "trained_s": round(trained_s, 2),
        "schedule_total_steps": total,
        "schedule": schedule,
        "pace_s_per_step": None if pace is None else round(pace, 4),
        "epochs_started": epoch + 1,
        "tokens": tokens,
        "tokens_per_s": round(tokens / max(trained_s, 1e-9), 1),
        "anchors_per_step_mean": round(anchors / max(n, 1), 1),
        "first": first,
        "last": last,
    }


def save(step: Step, shape_cfg, out: Path, chat_template_kwargs: dict) -> dict:
    """SpecForge's checkpoint of the draft and its own export, then dflash-ipc's export of the same weights."""
    from specforge.export.to_hf import export_to_hf

    sf = out / "specforge"
    sf.mkdir(parents=True, exist_ok=True)
    full = step.backend.state_dict()["model"]  # FSDP: gathered on rank 0, on the CPU (as SpecForge's checkpoints)
    draft_state = step.core.strategy.checkpoint_state_filter(full)
    torch.save({"draft_state_dict": {k: v.detach().cpu() for k, v in draft_state.items()}}, sf / "training_state.pt")
    shape_cfg.to_json_file(str(sf / "draft_config.json"))
    hf = export_to_hf(str(sf / "training_state.pt"), str(sf / "draft_config.json"), str(sf / "hf"))
    export = specforge_export.convert(hf, out / "export", chat_template_kwargs)
    return {"specforge_checkpoint": str(sf / "training_state.pt"), "specforge_hf": str(hf), "export": str(export)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.train_s_from:
        args.train_s = ipc_run_summary(args.train_s_from)["trained_s"]
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    attention = args.attention if args.attention != "auto" else ("flex_attention" if device.type == "cuda" else "sdpa")
    from dflash_ipc.config import load_config
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.tokenizer import config_tokenizer
    from dflash_ipc.platform.devices import dtype_from_name
    from dflash_ipc.target_spec.heads import target_head_weights

    # a bad config or batching is refused before SpecForge's process group starts
    cfg = load_config(args.config, sets=args.sets)
    budget = args.token_budget or cfg.data.token_budget
    try:
        data = dataclasses.replace(cfg.data, token_budget=budget, max_batch_size=args.max_batch_size or cfg.data.max_batch_size)
    except ValueError as e:
        raise ValueError(f"--token-budget {budget} / --max-batch-size: {e}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_specforge(device_type)

    from specforge.distributed import destroy_distributed

    torch.manual_seed(cfg.run.seed)
    tokenizer = config_tokenizer(cfg)
    corpus = load_corpus(cfg.data, tokenizer, Path(cfg.data.cache_dir) if cfg.data.cache_dir else out / "data")
    shape, hf_config = drafter_shape(cfg, tokenizer)
    embed, head = target_head_weights(cfg.target, hf_config, device, dtype_from_name(cfg.target.dtype))
    total = args.total_steps or cfg.training.max_steps or 1000
    step = build_step(cfg, args, shape, embed, head, device, attention, total)
    del embed, head
    capture = Capture(cfg, args.target_forward, shape.target_layer_ids, len(tokenizer), device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = planned_batches(data, cfg.run.seed, corpus, pad_id)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    run = train(step, capture, batches, args, device, cfg.training.max_steps)
    result = {
        "trainer": "specforge-0.2.0",
        "config": str(args.config),
        "sets": list(args.sets),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "train_s": args.train_s,
        "train_s_from": args.train_s_from,
        **run,
        "drafter": shape.to_dict(),
        "num_anchors_per_seq": args.num_anchors,
        "loss_decay_gamma": cfg.training.loss_gamma,
        "lr": cfg.training.lr,
        "warmup_ratio": step.warmup_ratio,
        "token_budget": budget,
        "attention": attention,
        "target_forward": args.target_forward,
        "dtype": args.dtype,
        "fsdp": step.fsdp,
        "data_samples": corpus.num_samples,
    }
    if device.type == "cuda":
        result["peak_gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del capture
    result.update(save(step, step.draft.config, out, cfg.chat_template.kwargs))
    (out / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    destroy_distributed()
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:  # a bad config, data file, run directory or drafter: named in the message
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
