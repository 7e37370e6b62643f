"""Weighted full-vocabulary cross-entropy (+ KL to the target) through the frozen LM head, a chunk of rows at a time.

:func:`chunked_lm_loss` is a custom autograd function that holds at most one ``[chunk, vocab]`` block of
logits (two with KL). With the head frozen (the drafter's case) each chunk's gradient to the hidden state is
taken while the chunk's logits exist, two head GEMMs per row; a trainable head recomputes the logits in backward
(three). ``training.ce_compile`` runs each chunk's fp32 work after the GEMM through ``torch.compile``.

``training.ce_fp8`` (a frozen head's gradient taken in forward): both head GEMMs in e4m3 with row-wise
scales (:class:`~dflash_ipc.drafter.model.fp8_head.Fp8Head`): each chunk's hidden rows are quantized per row
before ``logits = X @ W^T``, and its gradient rows before ``dX = G @ W``. The gradient's label entry
(``softmax * scale - 1``, the one entry near -1) is taken out before that quantization and added back
exactly as ``coef * W[label]``: left in, it would set every row's scale, and the rest of the row (the
softmax's many small entries, whose sum is the larger part of ``dX``) would fall to e4m3's subnormals or
to zero. Without a gradient (held-out passes) the logits stay the bf16 GEMM's, as eval decodes; so does
the KL term's target distribution (a constant of the loss).

A target whose logits are finished after its head's matmul (``frozen_head``: Granite divides them, Gemma
soft-caps them; :mod:`~dflash_ipc.drafter.model.frozen_head`) has its draft and target logits finished in fp32 the
same way before the softmax; each chunk's gradient, taken with respect to the finished logits, is multiplied
by their slope (``d finished / d raw``) before the head's GEMM, in fp32, as the KL term's is adjusted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash_ipc.drafter.model.fp8_head import Fp8Head, pad_columns
from dflash_ipc.drafter.model.frozen_head import finish_logits_fp32, logit_slope, transforms_logits
from dflash_ipc.families.traits import FrozenHead
from dflash_ipc.platform.e4m3 import E4M3, E4M3_MAX, quantize_rows

__all__ = ["ChunkedLossResult", "chunked_lm_loss"]


def _ce_chunk_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of one chunk's logits (fp32 math whatever their dtype): log-sum-exp, CE against ``labels``, argmax."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return lse, lse - logits.gather(1, labels[:, None]).squeeze(1), logits.argmax(dim=-1)


def _ce_chunk_stats_in_place(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_ce_chunk_stats` with one fp32 ``[rows, vocab]`` buffer: the logits' fp32 copy (the logits
    themselves when they are fp32: consumed) becomes ``exp(logits - max)`` in place, where
    ``torch.logsumexp`` allocates that block again."""
    x = logits.float()
    pred = x.argmax(dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    top = x.amax(dim=-1, keepdim=True)
    lse = x.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
    return lse, lse - picked, pred


def _ce_chunk_grad(logits, lse, coef, labels, w, dtype: torch.dtype) -> torch.Tensor:
    """d(sum_w CE)/d(logits) of one chunk, ``softmax * coef - onehot(labels) * w``, computed in fp32, given in ``dtype``."""
    g = torch.exp(logits.float() - lse[:, None]) * coef[:, None]
    return g.scatter_add_(1, labels[:, None], -w[:, None]).to(dtype)


def _ce_chunk_grad_in_place(logits, lse, coef, labels, w, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_ce_chunk_grad` in one fp32 buffer (the logits' copy, or the fp32 logits themselves: consumed),
    where the out-of-place form allocates three."""
    g = logits.float().sub_(lse[:, None]).exp_().mul_(coef[:, None])
    return g.scatter_add_(1, labels[:, None], -w[:, None]).to(dtype)


def _scaled_softmax_in_place(logits: torch.Tensor, labels: torch.Tensor, scale: float):
    """One chunk's stats (:func:`_ce_chunk_stats`) and ``softmax * scale`` in one fp32 buffer (the logits' fp32
    copy, reused in place): the shared start of both eager stats-and-gradient passes."""
    x = logits.float()
    pred = x.argmax(dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    top = x.amax(dim=-1, keepdim=True)
    total = x.sub_(top).exp_().sum(dim=-1, keepdim=True)
    lse = total.log().add_(top).squeeze(1)
    return lse, lse - picked, pred, x.mul_(total.reciprocal_().mul_(scale))


def _ce_chunk_stats_and_grad(logits: torch.Tensor, labels: torch.Tensor, scale: float):
    """:func:`_ce_chunk_stats` and the gradient of one unit of row weight in the same pass over the chunk:
    ``softmax * scale - onehot(labels)``, in the logits' dtype. Eager: one fp32 buffer, reused in place."""
    lse, ce, pred, x = _scaled_softmax_in_place(logits, labels, scale)
    g = x.scatter_add_(1, labels[:, None], torch.full_like(lse[:, None], -1.0))
    return lse, ce, pred, g.to(logits.dtype)


def _ce_chunk_stats_and_grad_fusable(logits: torch.Tensor, labels: torch.Tensor, scale: float):
    """:func:`_ce_chunk_stats_and_grad` written out of place, the form ``torch.compile`` fuses into two kernels."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    g = torch.exp(x - lse[:, None]) * scale
    g = g.scatter_add(1, labels[:, None], torch.full_like(picked[:, None], -1.0))
    return lse, lse - picked, x.argmax(dim=-1), g.to(logits.dtype)


def _quantize_padded(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` with zero columns up to ``width`` (the FP8 GEMM's alignment), quantized per row."""
    return quantize_rows(pad_columns(x, width))


def _split_label_quantized(g: torch.Tensor, labels: torch.Tensor, width: int):
    """A chunk's fp32 gradient ``g`` (consumed) -> (``gq``, ``gs``: ``g`` without its label entries, padded to
    ``width`` and quantized per row; ``coef`` [rows] fp32: the label entries)."""
    coef = g.gather(1, labels[:, None]).squeeze(1)
    gq, gs = _quantize_padded(g.scatter_(1, labels[:, None], 0.0), width)
    return gq, gs, coef


def _ce_chunk_stats_and_grad_fp8(logits: torch.Tensor, labels: torch.Tensor, scale: float, width: int):
    """:func:`_ce_chunk_stats_and_grad` for the FP8 GEMM: the gradient of one unit of row weight split into its
    label entries (``coef = softmax * scale - 1`` there, fp32) and the rest, ``softmax * scale`` (>= 0), padded
    to ``width`` and quantized per row (``gq``, ``gs``). Eager: one fp32 buffer, reused in place."""
    lse, ce, pred, x = _scaled_softmax_in_place(logits, labels, scale)
    coef = x.gather(1, labels[:, None]).squeeze(1).sub_(1.0)
    x.scatter_(1, labels[:, None], 0.0)
    amax = x.amax(dim=-1, keepdim=True).clamp_min_(1e-12)
    gq = pad_columns(x.mul_(E4M3_MAX / amax).clamp_(max=E4M3_MAX), width).to(E4M3)
    return lse, ce, pred, gq, amax.div_(E4M3_MAX), coef


def _ce_chunk_stats_and_grad_fp8_fusable(logits: torch.Tensor, labels: torch.Tensor, scale: float, width: int):
    """:func:`_ce_chunk_stats_and_grad_fp8` out of place, the form ``torch.compile`` fuses (the quantization too)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, labels[:, None]).squeeze(1)
    rest = (torch.exp(x - lse[:, None]) * scale).scatter(1, labels[:, None], 0.0)
    gq, gs = _quantize_padded(rest, width)
    return lse, lse - picked, x.argmax(dim=-1), gq, gs, torch.exp(picked - lse) * scale - 1.0


class _ChunkFns(NamedTuple):
    """One chunk's work around the head GEMMs (:func:`_ce_chunk_fns`)."""

    stats: Callable
    grad: Callable
    stats_and_grad: Callable
    stats_and_grad_fp8: Callable
    quantize: Callable  # the hidden rows before the FP8 GEMM


@functools.cache
def _compiled_ce_chunk() -> _ChunkFns:
    """:func:`_ce_chunk_stats`, :func:`_ce_chunk_grad`, :func:`_ce_chunk_stats_and_grad_fusable` and the FP8
    path's :func:`_ce_chunk_stats_and_grad_fp8_fusable` and :func:`_quantize_padded` compiled once per process
    (``training.ce_compile``): each chunk's fp32 passes over ``[rows, vocab]`` fused into a few kernels;
    dynamic shapes (the last chunk of a batch is shorter, and every batch differs)."""
    return _ChunkFns(
        torch.compile(_ce_chunk_stats, dynamic=True),
        torch.compile(_ce_chunk_grad, dynamic=True),
        torch.compile(_ce_chunk_stats_and_grad_fusable, dynamic=True),
        torch.compile(_ce_chunk_stats_and_grad_fp8_fusable, dynamic=True),
        torch.compile(_quantize_padded, dynamic=True),
    )


def _ce_chunk_fns(compiled: bool, in_place: bool) -> _ChunkFns:
    """A chunk's work: compiled (fused kernels), or eager, in place when the logits are not read again."""
    if compiled:
        return _compiled_ce_chunk()
    if in_place:
        return _ChunkFns(
            _ce_chunk_stats_in_place, _ce_chunk_grad_in_place, _ce_chunk_stats_and_grad, _ce_chunk_stats_and_grad_fp8, _quantize_padded
        )
    return _ChunkFns(
        _ce_chunk_stats, _ce_chunk_grad, _ce_chunk_stats_and_grad_fusable, _ce_chunk_stats_and_grad_fp8_fusable, _quantize_padded
    )


class _ChunkedLMLoss(torch.autograd.Function):
    """Weighted CE (+ KL to target logits) over the full vocabulary, chunk by chunk; at most one
    ``[chunk, vocab]`` block of logits (two with KL) exists at any time.

    Two ways to the gradient of ``hidden``, chosen in forward:

    - **frozen head** (``grad_in_forward``: ``hidden`` needs a gradient, the head does not): each chunk's
      gradient of one unit of row weight, ``(softmax * (1 + kl) - onehot - kl * p_target) @ W``, is taken
      while its logits exist, and kept (``[rows, H]``, the size of ``hidden``); backward only scales it by
      the row weights (D-PACE's come after the last chunk: the gradient is linear in them). Two head GEMMs
      per chunk instead of three, one pass over the logits instead of two. With ``fp8_head`` both GEMMs
      run in e4m3 (module docstring).
    - **trainable head** (or no gradient wanted): forward keeps the per-row log-sum-exp; backward
      recomputes each chunk's logits for both gradients.

    ``head`` (a :class:`FrozenHead` whose logits are finished, else None): the logits the softmax sees are
    the finished ones, and the gradient reaches the GEMM through their slope (module docstring).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_w, target_hidden, kl_weight, chunk, reweight, compiled, grad_in_forward, fp8_head, head):
        r = hidden.shape[0]
        dev = hidden.device
        lse = torch.empty(r, dtype=torch.float32, device=dev)
        ce = torch.empty(r, dtype=torch.float32, device=dev)
        kl = torch.zeros(r, dtype=torch.float32, device=dev)
        pred = torch.empty(r, dtype=torch.int64, device=dev)
        unit_grad = torch.empty_like(hidden) if grad_in_forward else None
        with_kl = target_hidden is not None
        fp8 = fp8_head if grad_in_forward else None  # no gradient wanted: the bf16 logits eval sees
        # the gradient is adjusted in fp32 after the chunk's function: by the KL term, by the logits' slope
        adjusted = with_kl or head is not None
        # with KL the logits are read again after the stats: out of place, and eager
        fns = _ce_chunk_fns(compiled and not with_kl, in_place=not with_kl)
        for s in range(0, r, chunk):
            e = min(r, s + chunk)
            lab = labels[s:e]
            logits = F.linear(hidden[s:e], weight) if fp8 is None else fp8.logits(*fns.quantize(hidden[s:e], fp8.padded_hidden))
            slope = None
            if head is not None:  # finished in fp32; the slope taken before the stats may consume them
                logits = finish_logits_fp32(head, logits)
                slope = logit_slope(head, logits) if grad_in_forward else None
            elif with_kl:
                logits = logits.float()  # cast once: the KL term below reads it too
            g = split = None
            if not grad_in_forward:
                lse[s:e], ce[s:e], pred[s:e] = fns.stats(logits, lab)
            elif fp8 is not None and not adjusted:
                lse[s:e], ce[s:e], pred[s:e], *split = fns.stats_and_grad_fp8(logits, lab, 1.0 + kl_weight, fp8.padded_rows)
            else:
                lse[s:e], ce[s:e], pred[s:e], g = fns.stats_and_grad(logits, lab, 1.0 + kl_weight)
            if with_kl:
                t_logp = F.log_softmax(_target_logits(target_hidden[s:e], weight, head), dim=-1)
                kl[s:e] = (t_logp.exp() * (t_logp - (logits - lse[s:e, None]))).sum(-1)
                if grad_in_forward:
                    g = g.float().sub_(t_logp.exp_().mul_(kl_weight))
                del t_logp
            del logits
            if grad_in_forward and adjusted:
                g = g.float()
                if slope is not None:
                    g = g.mul_(slope)
                if fp8 is None:
                    g = g.to(weight.dtype)
                else:
                    split, g = _split_label_quantized(g, lab, fp8.padded_rows), None
            del slope
            if split is not None:  # the label entries exactly, the rest through the FP8 GEMM
                gq, gs, coef = split
                unit_grad[s:e] = (fp8.input_grad(gq, gs).float() + coef[:, None] * weight[lab].float()).to(hidden.dtype)
            elif grad_in_forward:
                unit_grad[s:e] = (g @ weight).to(hidden.dtype)
            del g, split
        if reweight is not None:
            row_w = reweight(ce).to(torch.float32)
        ce_sum = (ce * row_w).sum()
        kl_sum = (kl * row_w).sum()
        total = ce_sum + kl_weight * kl_sum
        if grad_in_forward:
            ctx.save_for_backward(unit_grad, row_w)
        else:
            ctx.save_for_backward(hidden, weight, labels, row_w, lse, target_hidden)
        ctx.grad_in_forward = bool(grad_in_forward)
        ctx.kl_weight = float(kl_weight)
        ctx.chunk = int(chunk)
        ctx.compiled = bool(compiled)
        ctx.head = head
        ctx.mark_non_differentiable(ce_sum, kl_sum, pred, row_w)
        return total, ce_sum, kl_sum, pred, row_w

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_kl, _g_pred, _g_row_w):
        no_grads = (None,) * 10
        if ctx.grad_in_forward:
            unit_grad, row_w = ctx.saved_tensors
            grad_h = (unit_grad.float() * (row_w * g_total)[:, None]).to(unit_grad.dtype)
            return grad_h, None, *no_grads
        hidden, weight, labels, row_w, lse, target_hidden = ctx.saved_tensors
        klw, chunk, head = ctx.kl_weight, ctx.chunk, ctx.head
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        r = hidden.shape[0]
        with_kl = target_hidden is not None and klw != 0.0
        # fp32 while the KL term, the logits' slope or the head's gradient still needs it; else in the GEMM's dtype
        g_dtype = torch.float32 if with_kl or want_w or head is not None else weight.dtype
        chunk_grad = _ce_chunk_fns(ctx.compiled and not with_kl, in_place=True).grad
        for s in range(0, r, chunk):
            e = min(r, s + chunk)
            w = row_w[s:e] * g_total
            logits = F.linear(hidden[s:e], weight)
            slope = None
            if head is not None:
                logits = finish_logits_fp32(head, logits)
                slope = logit_slope(head, logits)
            g = chunk_grad(logits, lse[s:e], w * (1.0 + klw), labels[s:e], w, g_dtype)
            del logits
            if with_kl:
                p_t = F.softmax(_target_logits(target_hidden[s:e], weight, head), dim=-1)
                g.sub_(p_t * (klw * w)[:, None])
                del p_t
            if slope is not None:
                g.mul_(slope)
            del slope
            if want_h:
                grad_h[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += g.t() @ hidden[s:e].float()
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, *no_grads


def _target_logits(target_hidden: torch.Tensor, weight: torch.Tensor, head: FrozenHead | None) -> torch.Tensor:
    """The target's own logits (fp32) of its last hidden states: the KL term's constant distribution."""
    raw = F.linear(target_hidden, weight)
    return raw.float() if head is None else finish_logits_fp32(head, raw)


class ChunkedLossResult(NamedTuple):
    loss_sum: torch.Tensor  # differentiable: sum_w CE + kl_weight * sum_w KL
    ce_sum: torch.Tensor  # detached
    kl_sum: torch.Tensor  # detached
    pred: torch.Tensor  # [R] argmax token of the draft
    row_weights: torch.Tensor  # [R] float32: the weights applied (``reweight``'s when given)


def chunked_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: int,
    *,
    target_hidden: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    reweight: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compiled: bool = False,
    fp8_head: Fp8Head | None = None,
    frozen_head: FrozenHead | None = None,
) -> ChunkedLossResult:
    """Weighted full-vocabulary CE of ``lm_head(hidden)`` vs ``labels``, ``chunk_rows`` rows at a time.

    ``target_hidden`` (``[R, H]``, the target's last hidden state aligned with each row) adds
    ``kl_weight * sum_w KL(softmax(lm_head(target_hidden)) || softmax(lm_head(hidden)))``; the
    target distribution is a constant (no gradient flows through it). Gradients reach
    ``hidden`` and, if it requires grad, ``lm_head_weight`` (through the draft logits).
    ``reweight`` maps the per-row CE (``[R]``, float32, no graph) to the row weights used instead
    of ``row_weights``: weights that depend on the draft's own predictions (D-PACE) at no extra
    pass over the vocabulary; they are constants to the gradient (stop-gradient). ``compiled``
    (``training.ce_compile``): each chunk's fp32 work after the GEMM through ``torch.compile``
    (without KL; the KL term stays eager). ``fp8_head`` (``training.ce_fp8``): the e4m3 copies of
    ``lm_head_weight``, for both GEMMs of the frozen head's path (module docstring); without a gradient
    wanted, and for a trainable head, the bf16 GEMMs. ``frozen_head``: what the target does to its logits after
    the head's matmul (divide, soft-cap): both the draft's and the target's logits are finished so (module docstring).
    """
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    if fp8_head is not None and (fp8_head.rows, fp8_head.hidden) != tuple(lm_head_weight.shape):
        raise ValueError(f"fp8_head is of a [{fp8_head.rows}, {fp8_head.hidden}] head, lm_head_weight is {list(lm_head_weight.shape)}")
    weight = lm_head_weight.to(hidden.dtype)
    row_w = row_weights.to(torch.float32)
    th = target_hidden.to(hidden.dtype) if (target_hidden is not None and kl_weight > 0) else None
    # the frozen head's path needs to know now whether a backward will come: decided here, outside the Function
    grad_in_forward = torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
    total, ce_sum, kl_sum, pred, row_w = _ChunkedLMLoss.apply(
        hidden,
        weight,
        labels.to(torch.int64),
        row_w,
        th,
        float(kl_weight),
        int(chunk_rows),
        reweight,
        bool(compiled),
        grad_in_forward,
        fp8_head,
        frozen_head if transforms_logits(frozen_head) else None,
    )
    return ChunkedLossResult(total, ce_sum, kl_sum, pred, row_w)
