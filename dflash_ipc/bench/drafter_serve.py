"""The drafter's serving-time step, reduced head vs the target's whole head (``dflash-ipc bench drafter-serve``).

One step of a served drafter, as z-lab's loop and the engines run it: the context tokens the last
verification kept (``--new-ctx``, about τ) projected and appended to the cached context (``--ctx``
tokens), one block of ``block_size`` tokens through the layers, then the head on the block's
``block_size - 1`` draft positions and the greedy pick. Heads, on the same body:

* ``whole``: the target's head, ``[V, H]`` logits, argmax (what SGLang and z-lab's class serve);
* ``reduced``: the drafter's own ``N`` rows, argmax over them, ``d2t`` maps the row to a target id;
* ``reduced-scatter``: the ``N`` rows' logits scattered into a ``-inf`` ``[V]`` row, then argmax
  (vLLM's ``DFlashQwen3ForCausalLM.compute_logits``: its sampler takes full-vocabulary logits).

Random bf16 weights of the export's own modeling code (:mod:`dflash_ipc.drafter.export.hf_modeling`) at the
given shapes (default: a 5-layer drafter at Qwen3.6-27B's widths and 248,320-token vocabulary, 32,768
draft rows). Each (batch, head) cell: ``--warmup`` untimed steps, then the median of ``--steps``
CUDA-event-timed steps (wall clock on a CPU). Ratios are against ``whole`` at the same batch. The
result also says whether the two reduced routes drafted the same tokens (``reduced_routes_agree``).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass

HEADS = ("whole", "reduced", "reduced-scatter")


@dataclass
class ServeShape:
    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_layers: int = 5
    num_heads: int = 24  # Qwen3.6-27B's attention: 24 q / 4 kv heads of 256
    num_kv_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 248_320
    draft_vocab_size: int = 32_768
    num_target_layers: int = 64
    capture_layers: int = 5
    block_size: int = 16
    ctx: int = 1024
    new_ctx: int = 4

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size < self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in (0, vocab_size = {self.vocab_size}); got {self.draft_vocab_size}")
        if self.block_size < 2 or self.new_ctx < 1 or self.ctx < self.new_ctx:
            raise ValueError("block_size >= 2, new_ctx >= 1 and ctx >= new_ctx")


def _hf_config(s: ServeShape, reduced: bool):
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        vocab_size=s.vocab_size,
        max_position_embeddings=s.ctx + 4 * s.block_size,
        layer_types=["full_attention"] * s.num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7},
        draft_vocab_size=s.draft_vocab_size if reduced else 0,
        dflash_config={"block_size": s.block_size, "mask_token_id": 0, "target_layer_ids": list(range(s.capture_layers))},
    )


def _timer(device):
    import torch

    if device.type == "cuda":

        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return run

    def run_cpu(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run_cpu


def _step(model, whole, head: str, pos, noise, new, cache, keep: int):
    """One served step: the body on one block over the cached context, then ``head``'s greedy pick."""
    import torch

    from dflash_ipc.drafter.export.hf_modeling import crop_cache

    with torch.inference_mode():
        h = model(pos, noise, new, past_key_values=cache, use_cache=True)[:, 1:]
        crop_cache(cache, keep)  # the next step's context: only what verification keeps
        if head == "whole":
            return whole(h).argmax(-1)
        if head == "reduced":
            row = model.lm_head(h).argmax(-1)
            return row + model.d2t[row]
        return model.compute_logits(h, whole).argmax(-1)


def run_drafter_serve_bench(shape: ServeShape, batches: list[int], *, device: str = "cuda", steps: int = 20, warmup: int = 5) -> dict:
    import torch
    from transformers import DynamicCache

    from dflash_ipc.drafter.export.hf_modeling import DFlashIpcDraftModel, crop_cache

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = DFlashIpcDraftModel(_hf_config(shape, reduced=True)).to(dtype).eval()
        whole = torch.nn.Linear(shape.hidden_size, shape.vocab_size, bias=False).to(dtype)
        ids = torch.sort(torch.randperm(shape.vocab_size)[: shape.draft_vocab_size]).values
    model.d2t.copy_(ids - torch.arange(shape.draft_vocab_size, device=dev))
    timer, rows = _timer(dev), []
    reduced_agree, in_rows = True, True
    k, s, b_size = shape.capture_layers, shape, shape.block_size
    for b in batches:
        cache = DynamicCache(config=model.config)
        noise = torch.randn(b, b_size, s.hidden_size, device=dev, dtype=dtype)
        with torch.inference_mode():  # the cached context: one step's worth, its block cropped away
            prefill = torch.randn(b, s.ctx - s.new_ctx, k * s.hidden_size, device=dev, dtype=dtype)
            model(torch.arange(s.ctx - s.new_ctx + b_size, device=dev).expand(b, -1), noise, prefill, past_key_values=cache, use_cache=True)
            crop_cache(cache, s.ctx - s.new_ctx)
        new = torch.randn(b, s.new_ctx, k * s.hidden_size, device=dev, dtype=dtype)
        pos = torch.arange(s.ctx - s.new_ctx, s.ctx + b_size, device=dev).expand(b, -1)
        picks = {}
        for head in HEADS:
            step = functools.partial(_step, model, whole, head, pos, noise, new, cache, s.ctx - s.new_ctx)
            picks[head] = step()  # a step leaves the cache as it found it: every timed step drafts the same block
            for _ in range(warmup):
                timer(step)
            times = [timer(step) for _ in range(steps)]
            rows.append({"batch": b, "head": head, "ms": round(1e3 * statistics.median(times), 4)})
        reduced_agree &= bool(torch.equal(picks["reduced"], picks["reduced-scatter"]))
        in_rows &= bool(torch.isin(picks["reduced"], ids).all())
    base = {r["batch"]: r["ms"] for r in rows if r["head"] == "whole"}
    for r in rows:
        r["vs_whole"] = round(r["ms"] / base[r["batch"]], 4)
    return {
        "shape": asdict(shape),
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "steps": steps,
        "rows": rows,
        # the two reduced routes are one computation: the same tokens, each one of the draft rows' ids
        "reduced_routes_agree": reduced_agree and in_rows,
    }
