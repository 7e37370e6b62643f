"""``drafter.anchor_chunk = "auto"``: the most anchors one drafter forward may hold on this GPU.

A drafter step's memory is its fixed state (parameters, AdamW state, the frozen embedding and LM head, and
with ``training.ce_fp8`` the head's two e4m3 copies),
what every anchor chunk shares (the packed context, the chunked CE's logits) and what grows with the
anchors of one forward: every anchor is a block of ``block_size`` query tokens, and every query token
keeps its activations in every drafter layer until the chunk's backward. Only that last part follows
``anchor_chunk``; the rest is there whatever the chunk.

Pure: :func:`choose_anchor_chunk` takes the widths and the memory figures as numbers (tests give them;
:func:`resolve_anchor_chunk` measures them in the drafter process). The budget is the smaller of

* the device's free memory now, less what this drafter will still allocate (its AdamW state is made
  in the warm-up), and
* the device's total memory, less a co-located target's certain needs (weights, captured planes, ring
  slots, one layer's forward activations: ``runtime.resources.target_need_bytes``) and this drafter's fixed state,

less a reserve (CUDA contexts, allocator fragmentation). The second term holds when the drafter measures
before the target beside it has loaded its weights (the drafter warms up while the targets load); the
first when something else holds the GPU. Each query token's activations are counted as
``(14 * hidden + 6 * q_dim + 6 * intermediate)`` elements per layer, the figure measured on one H200
at Qwen3-8B widths (a 1,024-anchor chunk more: +24.2 GiB at hidden 4096, 5 layers, block 16), times
``MARGIN``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: the per-anchor estimate is multiplied by this (the allocator's rounding, the mask and index tensors)
MARGIN = 1.2
#: chunks are whole multiples of this many anchors (kernel shapes that repeat; at most one shorter chunk)
GRANULE = 128
#: kept free of the drafter's plan: two CUDA contexts, allocator fragmentation, the metrics' small tensors
RESERVE_BYTES = 6 << 30
#: the chunked CE's transient bytes per logit: the GEMM's output, its fp32 copy and the fp32 gradient or softmax
CE_BYTES_PER_LOGIT_FP32 = 12
#: and under a target's final soft-cap (Gemma), the fp32 slope of the capped logits (drafter/model/frozen_head.py)
CE_BYTES_PER_LOGIT_SOFTCAP = 4


@dataclass(frozen=True)
class DrafterWidths:
    """The drafter step's shapes, as numbers: its layers' widths, its head, its batches."""

    hidden: int
    intermediate: int
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    num_layers: int
    num_planes: int  # captured target planes concatenated into the context
    head_rows: int  # the LM head's rows (the target's vocabulary, or the draft vocabulary)
    block_size: int
    context_tokens: int  # tokens of one packed batch (data.token_budget)
    dtype_bytes: int  # the drafter's compute dtype
    ce_chunk_tokens: int
    ce_softcap: bool = False  # the target soft-caps its logits: the CE keeps their slope per chunk too


def bytes_per_anchor(w: DrafterWidths) -> int:
    """Activations one anchor's block keeps until its chunk's backward, all layers (module docstring)."""
    per_token_layer = 14 * w.hidden + 6 * w.q_dim + 6 * w.intermediate
    return int(math.ceil(MARGIN * w.block_size * w.num_layers * per_token_layer * w.dtype_bytes))


def shared_step_bytes(w: DrafterWidths) -> int:
    """What every chunk of a step shares: the concatenated context, its projection, each layer's
    context keys and values, and one CE chunk's logits with their fp32 passes."""
    n, d = w.context_tokens, w.dtype_bytes
    context = n * (w.num_planes + 1) * w.hidden * d + w.num_layers * n * 2 * w.kv_dim * d
    ce = w.ce_chunk_tokens * w.head_rows * (d + CE_BYTES_PER_LOGIT_FP32 + CE_BYTES_PER_LOGIT_SOFTCAP * w.ce_softcap)
    return int(MARGIN * (context + ce))


def device_budget(free_bytes: int, total_bytes: int, drafter_pending: int, drafter_fixed: int, target_need: int) -> int:
    """Bytes the anchor chunks' activations and the shared step buffers may take (module docstring)."""
    by_free = free_bytes - max(0, drafter_pending)
    by_total = total_bytes - target_need - drafter_fixed
    return min(by_free, by_total) - RESERVE_BYTES


def choose_anchor_chunk(w: DrafterWidths, anchors: int, budget_bytes: int) -> int:
    """The anchor chunk for ``anchors`` anchors per batch within ``budget_bytes``.

    All anchors in one forward when they fit; else the fewest chunks that fit, of equal size rounded up
    to ``GRANULE`` (never above what fits). At least ``GRANULE`` (or ``anchors`` when fewer) even when
    nothing fits: the step then fails as it would have, and the log names the budget.
    """
    if anchors < 1:
        raise ValueError(f"anchors must be >= 1, got {anchors}")
    per_anchor = bytes_per_anchor(w)
    fit = (budget_bytes - shared_step_bytes(w)) // per_anchor
    if fit >= anchors:
        return anchors
    fit = (max(0, fit) // GRANULE) * GRANULE
    if fit < GRANULE:
        return min(anchors, GRANULE)
    chunks = -(-anchors // fit)
    per_chunk = -(-anchors // chunks)
    return min(fit, -(-per_chunk // GRANULE) * GRANULE)


def max_anchors_per_batch(drafter_cfg, data_cfg) -> int:
    """The most anchors a batch can train on: the per-batch cap (follow-wait: its ceiling), else every
    document's ``num_anchors`` over the most documents a batch holds, at most one per token."""
    if drafter_cfg.anchor_budget == "follow-wait":
        return drafter_cfg.resolved_max_anchors_auto()
    if drafter_cfg.max_anchors_per_batch > 0:
        return drafter_cfg.max_anchors_per_batch
    return min(data_cfg.token_budget, drafter_cfg.num_anchors * data_cfg.max_batch_size)


def drafter_widths(model, cfg) -> DrafterWidths:
    """:class:`DrafterWidths` of a built drafter (``DFlashDrafter``) under config ``cfg``."""
    m = model.config
    return DrafterWidths(
        hidden=m.hidden_size,
        intermediate=m.intermediate_size,
        q_dim=m.num_attention_heads * m.head_dim,
        kv_dim=m.num_key_value_heads * m.head_dim,
        num_layers=m.num_layers,
        num_planes=m.num_context_planes,
        head_rows=int(model.lm_head_weight.shape[0]),
        block_size=m.block_size,
        context_tokens=cfg.data.token_budget + cfg.transport.slot_tokens,
        dtype_bytes=model.trainable_parameters()[0].element_size(),
        ce_chunk_tokens=cfg.training.ce_chunk_tokens,
        ce_softcap=m.frozen_head.final_logit_softcap is not None,
    )


def drafter_fixed_bytes(model, ce_fp8: bool = False) -> int:
    """The drafter's fixed state: its parameters in the compute dtype, and per trainable parameter an
    fp32 master, gradient and two AdamW moments (:mod:`dflash_ipc.drafter.training.trainer`); ``ce_fp8``
    (``training.ce_fp8``): the head's e4m3 copies too, made at the first step (:mod:`~dflash_ipc.drafter.model.fp8_head`)."""
    from dflash_ipc.drafter.model.fp8_head import fp8_head_bytes

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() for p in model.trainable_parameters())
    head = fp8_head_bytes(*model.lm_head_weight.shape) if ce_fp8 else 0
    return params + buffers + 16 * trainable + head


def resolve_anchor_chunk(cfg, model, device, target_need: int | None = None) -> tuple[object, str]:
    """``cfg`` with ``drafter.anchor_chunk = "auto"`` replaced by the chunk this device fits, and a
    line saying why (``cfg`` unchanged and "" for a set chunk). CPU: all anchors in one forward.
    ``target_need``: the bytes a target beside the drafter needs (the process shell measures it with
    ``runtime.resources.target_need_bytes``; None: no target shares the device)."""
    import torch

    d = cfg.drafter
    if d.anchor_chunk != "auto":
        return cfg, ""
    anchors = max_anchors_per_batch(d, cfg.data)
    device = torch.device(device)
    if device.type != "cuda":
        chunk, why = anchors, f"drafter.anchor_chunk auto: {anchors} (all of a batch's anchors; {device} has no memory plan)"
    else:
        w = drafter_widths(model, cfg)
        free, total = torch.cuda.mem_get_info(device)
        fixed = drafter_fixed_bytes(model, cfg.training.ce_fp8)
        pending = fixed - torch.cuda.memory_allocated(device)
        target = int(target_need or 0)
        budget = device_budget(int(free), int(total), pending, fixed, target)
        chunk = choose_anchor_chunk(w, anchors, budget)
        gib = 2**30
        why = (
            f"drafter.anchor_chunk auto: {chunk} of {anchors} anchors per forward on {device} "
            f"(free {free / gib:.1f} of {total / gib:.1f} GiB; target beside it {target / gib:.1f} GiB, drafter state "
            f"{fixed / gib:.1f} GiB; budget {budget / gib:.1f} GiB, {bytes_per_anchor(w) / 2**20:.1f} MiB per anchor, "
            f"{shared_step_bytes(w) / gib:.1f} GiB shared)"
        )
    return dataclasses.replace(cfg, drafter=dataclasses.replace(d, anchor_chunk=chunk)), why
