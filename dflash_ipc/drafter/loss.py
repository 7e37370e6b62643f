"""DFlash training objective on a packed batch: context, anchors, attention masks, loss, metrics.

Batch (``SlotViews`` already on the drafter's device): ``planes [P, n, H]`` (``P = k`` target
planes, plus the target's last hidden state as plane ``k`` when the KL loss is on),
``token_ids [n]``, ``loss_mask [n]`` (uint8), ``seq_lens [b]`` (int32, sum ``n``). Several
documents sit back to back; RoPE positions restart at 0 in each.

One training step (:func:`compute_loss`):

1. **Anchors** (:func:`sample_anchors`): per document, positions ``i`` with
   ``loss_mask[i] & loss_mask[i+1]`` and ``i+1`` in the same document, at most
   ``num_anchors`` per document, drawn uniformly without replacement, then sorted. This is
   SpecForge's rule (``OnlineDFlashModel._sample_anchor_positions``: "anchors whose clean
   token and first target are supervised", capped at ``num_anchors`` per *sample*); a packed
   document here plays the role of one SpecForge sample, so the budget is per document.
2. **Blocks**: block ``j`` holds ``[token(a_j), MASK x (block_size-1)]`` at positions
   ``a_j + 0..block_size-1``.
3. **Attention** (:func:`build_attention_masks`): keys/values are ``[context (n) | blocks (Q)]``,
   queries the ``Q = N*block_size`` block tokens. A query of block ``j`` at position
   ``p = a_j + s`` sees

   * context tokens ``c`` of the same document with ``c < a_j`` (strict: at inference the
     target's hidden state of the anchor is not yet known), and in sliding layers only
     ``c > p - sliding_window`` (HF window semantics: the window counts the query itself);
   * its own block: bidirectional in full-attention layers, causal (``s' <= s``) and
     windowed in sliding layers (the SGLang/vLLM defaults for DFlash layer types);
   * nothing else. Blocks without a single valid label see nothing at all (their rows
     output 0, never NaN) and carry no loss.

   The same element-wise rule (:func:`mask_values`) feeds a dense boolean SDPA mask and the
   ``mask_mod`` of a flex ``BlockMask`` whose tile lists are computed analytically from the
   anchors (no ``[Q, n+Q]`` mask is ever materialized on the flex path).
4. **Labels** (:func:`block_labels`): slot ``s >= 1`` of block ``j`` predicts
   ``token[a_j + s]`` with weight ``exp(-(s-1)/gamma) * loss_mask[a_j+s] * [a_j+s in the
   same document]``; slot 0 (the anchor) has none.
5. **Loss** (:func:`chunked_lm_loss`): full-vocabulary cross-entropy through the frozen LM
   head, ``ce_chunk_tokens`` rows at a time, as a custom autograd function that recomputes
   each chunk's logits in backward, so neither pass holds more than one chunk of logits.
   Optional KL to the target: ``KL(p_target || q_draft)`` per supervised slot, with
   ``p_target = softmax(lm_head(last_hidden[a_j + s - 1]))``: the target's own prediction of
   token ``a_j + s`` comes from its last hidden state one position earlier (causal LM), the
   alignment SpecForge's ``_aligned_target_hidden`` uses (``label_index - 1``). Total:
   ``sum_w CE + kl_weight * sum_w KL`` (same weights ``w``), **not** divided; divide
   ``loss_sum`` by ``weight_sum`` (summed over ranks) to get the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from dflash_ipc.config import DrafterConfig, TrainingConfig
from dflash_ipc.drafter.model import FULL, SLIDING, DFlashDrafter
from dflash_ipc.transport.slots import SlotViews

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]

__all__ = [
    "concat_context",
    "DocumentIndex",
    "document_index",
    "valid_anchor_mask",
    "sample_anchors",
    "BlockLayout",
    "build_block_layout",
    "block_labels",
    "mask_values",
    "dense_attention_mask",
    "flex_block_mask",
    "build_attention_masks",
    "ChunkedLossResult",
    "chunked_lm_loss",
    "LossOutput",
    "compute_loss",
    "accuracy_per_pos",
    "expected_acceptance_length",
    "block_acceptance_lengths",
]

FLEX_TILE = 128  # flex_attention's default sparse block size


# --------------------------------------------------------------------------- context


def concat_context(
    planes: torch.Tensor, noise_std: float = 0.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[k, n, H]`` -> ``[n, k*H]``, layer-major (plane 0's H features, then plane 1's, ...).

    Adds ``N(0, noise_std^2)`` noise when ``noise_std > 0`` (``generator`` must live on the
    planes' device). Runs wherever ``planes`` lives: pass the drafter-side copy.
    """
    if planes.dim() != 3:
        raise ValueError(f"planes must be [k, n, H], got shape {tuple(planes.shape)}")
    ctx = torch.cat(list(planes.unbind(0)), dim=-1)  # always a fresh tensor, never a slot view
    if noise_std > 0:
        noise = torch.randn(ctx.shape, generator=generator, device=ctx.device, dtype=torch.float32)
        ctx = (ctx.float() + noise * noise_std).to(ctx.dtype)
    return ctx


# --------------------------------------------------------------------------- documents & anchors


class DocumentIndex(NamedTuple):
    doc_of_token: torch.Tensor  # [n] int64
    doc_start: torch.Tensor  # [b] int64
    doc_end: torch.Tensor  # [b] int64 (exclusive)
    position_ids: torch.Tensor  # [n] int64, restarts at 0 in every document


def document_index(seq_lens: torch.Tensor, n: int | None = None) -> DocumentIndex:
    seq = seq_lens.to(torch.int64)
    total = int(seq.sum())
    if n is not None and total != n:
        raise ValueError(f"seq_lens sum to {total} but the batch has {n} tokens")
    doc_end = torch.cumsum(seq, 0)
    doc_start = doc_end - seq
    doc_of_token = torch.repeat_interleave(torch.arange(seq.numel(), device=seq.device), seq, output_size=total)
    position_ids = torch.arange(total, device=seq.device) - doc_start[doc_of_token]
    return DocumentIndex(doc_of_token, doc_start, doc_end, position_ids)


def valid_anchor_mask(
    loss_mask: torch.Tensor, seq_lens: torch.Tensor, doc: DocumentIndex | None = None
) -> torch.Tensor:
    """``[n]`` bool: ``loss_mask[i] & loss_mask[i+1]`` with ``i+1`` in the same document."""
    lm = loss_mask.bool()
    n = lm.numel()
    doc = doc if doc is not None else document_index(seq_lens, n)
    nxt = torch.zeros_like(lm)
    nxt[:-1] = lm[1:]
    same_doc = torch.arange(1, n + 1, device=lm.device) < doc.doc_end[doc.doc_of_token]
    return lm & nxt & same_doc


def sample_anchors(
    loss_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    *,
    doc: DocumentIndex | None = None,
    max_per_batch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample draft-block anchors per document.

    Candidates are positions ``i`` with ``loss_mask[i]`` and ``loss_mask[i+1]`` set and
    ``i+1`` inside ``i``'s document. Each document contributes ``min(num_anchors, #candidates)``
    anchors drawn uniformly without replacement (SpecForge's per-sample budget, a document
    being one sample). ``block_size`` does not restrict the candidates (a block may run past
    its document's end; those slots just carry no loss, as in SpecForge) and is only checked.

    ``max_per_batch`` > 0 caps the whole packed batch: a batch of many short documents would
    otherwise bring ``num_anchors`` blocks per document (and its drafter step would grow with the
    document count, not the token budget); the cap keeps a uniform random subset.

    Returns ``(anchors [N] int64 global positions, ascending; doc [N] int64 document index)``.
    One vectorized pass: random keys, a single sort by ``(document, key)``, a rank cut.
    """
    if num_anchors < 1:
        raise ValueError("num_anchors must be >= 1")
    if block_size < 2:
        raise ValueError("block_size must be >= 2")
    n = loss_mask.numel()
    dev = loss_mask.device
    doc = doc if doc is not None else document_index(seq_lens, n)
    valid = valid_anchor_mask(loss_mask, seq_lens, doc)
    keys = torch.rand(n, generator=generator, device=dev, dtype=torch.float64)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))  # invalid ones sort last
    order = torch.argsort(doc.doc_of_token.to(torch.float64) * 4.0 + keys)
    # Documents are contiguous, so sorted slot i still belongs to document doc_of_token[i].
    rank = torch.arange(n, device=dev) - doc.doc_start[doc.doc_of_token]
    take = (rank < num_anchors) & valid[order]
    anchors = order[take]
    if max_per_batch > 0 and anchors.numel() > max_per_batch:
        pick = torch.randperm(anchors.numel(), generator=generator, device="cpu" if generator is None else generator.device)
        anchors = anchors[pick[:max_per_batch].to(dev)]
    anchors = torch.sort(anchors).values
    return anchors, doc.doc_of_token[anchors]


# --------------------------------------------------------------------------- block layout


class MaskIndex(NamedTuple):
    """Per-query and per-key index arrays the mask rule reads (flex ``mask_mod`` closure)."""

    q_doc: torch.Tensor  # [Q] document of the block
    q_block: torch.Tensor  # [Q] block id
    q_anchor: torch.Tensor  # [Q] global anchor position
    q_pos: torch.Tensor  # [Q] global position a_j + s
    q_valid: torch.Tensor  # [Q] bool: the block has >= 1 valid label
    kv_doc: torch.Tensor  # [n+Q] document (context keys), -1 for block keys
    kv_block: torch.Tensor  # [n+Q] -1 for context keys, block id for block keys
    kv_pos: torch.Tensor  # [n+Q] global position (context index, or a_j + s)


@dataclass
class BlockLayout:
    n_ctx: int
    block_size: int
    num_blocks: int
    anchors: torch.Tensor  # [N] global anchor positions
    anchor_doc: torch.Tensor  # [N]
    block_valid: torch.Tensor  # [N] bool
    doc_start: torch.Tensor  # [b]
    doc_end: torch.Tensor  # [b]
    context_position_ids: torch.Tensor  # [n]
    block_position_ids: torch.Tensor  # [N, block_size] in-document positions
    index: MaskIndex

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.n_ctx + self.num_queries


def build_block_layout(
    seq_lens: torch.Tensor,
    anchors: torch.Tensor,
    anchor_doc: torch.Tensor,
    block_size: int,
    block_valid: torch.Tensor | None = None,
    n: int | None = None,
    doc: DocumentIndex | None = None,
) -> BlockLayout:
    doc = doc if doc is not None else document_index(seq_lens, n)
    n_ctx = doc.doc_of_token.numel()
    dev = anchors.device
    anchors = anchors.to(torch.int64)
    anchor_doc = anchor_doc.to(torch.int64)
    nb = anchors.numel()
    if block_valid is None:
        block_valid = torch.ones(nb, dtype=torch.bool, device=dev)
    offs = torch.arange(block_size, device=dev)
    q_pos = (anchors[:, None] + offs).reshape(-1)
    q_block = torch.arange(nb, device=dev).repeat_interleave(block_size)
    q_doc = anchor_doc.repeat_interleave(block_size)
    q_anchor = anchors.repeat_interleave(block_size)
    q_valid = block_valid.to(torch.bool).repeat_interleave(block_size)
    neg = torch.full((nb * block_size,), -1, dtype=torch.int64, device=dev)
    index = MaskIndex(
        q_doc=q_doc,
        q_block=q_block,
        q_anchor=q_anchor,
        q_pos=q_pos,
        q_valid=q_valid,
        kv_doc=torch.cat([doc.doc_of_token, neg]),
        kv_block=torch.cat([torch.full((n_ctx,), -1, dtype=torch.int64, device=dev), q_block]),
        kv_pos=torch.cat([torch.arange(n_ctx, device=dev), q_pos]),
    )
    block_pos = (anchors - doc.doc_start[anchor_doc])[:, None] + offs
    return BlockLayout(
        n_ctx=n_ctx,
        block_size=block_size,
        num_blocks=nb,
        anchors=anchors,
        anchor_doc=anchor_doc,
        block_valid=block_valid.to(torch.bool),
        doc_start=doc.doc_start,
        doc_end=doc.doc_end,
        context_position_ids=doc.position_ids,
        block_position_ids=block_pos,
        index=index,
    )


# --------------------------------------------------------------------------- labels


class BlockLabels(NamedTuple):
    label_pos: torch.Tensor  # [N, bs] global position each slot predicts (a_j + s), clamped
    labels: torch.Tensor  # [N, bs] token ids (garbage where not valid)
    valid: torch.Tensor  # [N, bs] bool
    weights: torch.Tensor  # [N, bs] float32 (0 where not valid)


def block_labels(
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_doc_end: torch.Tensor,
    block_size: int,
    gamma: float,
) -> BlockLabels:
    """Slot ``s >= 1`` predicts ``token[a+s]``, weight ``exp(-(s-1)/gamma)`` if supervised and in-document."""
    n = token_ids.numel()
    offs = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, None] + offs
    in_doc = pos < anchor_doc_end[:, None]
    safe = pos.clamp(max=n - 1)
    valid = in_doc & (offs > 0) & loss_mask.bool()[safe]
    decay = torch.exp(-(offs - 1).clamp(min=0).to(torch.float32) / gamma)
    weights = decay[None, :] * valid.to(torch.float32)
    return BlockLabels(safe, token_ids[safe], valid, weights)


# --------------------------------------------------------------------------- masks


def mask_values(
    idx: MaskIndex, q: torch.Tensor, kv: torch.Tensor, *, causal: bool, window: int | None
) -> torch.Tensor:
    """The DFlash visibility rule, element-wise on broadcastable query/key indices."""
    kv_block = idx.kv_block[kv]
    kv_pos = idx.kv_pos[kv]
    ctx_ok = (kv_block < 0) & (idx.kv_doc[kv] == idx.q_doc[q]) & (kv_pos < idx.q_anchor[q])
    vis = ctx_ok | (kv_block == idx.q_block[q])
    if causal:
        vis = vis & (kv_pos <= idx.q_pos[q])
    if window is not None:
        vis = vis & (kv_pos > idx.q_pos[q] - window)
    return vis & idx.q_valid[q]


def _layer_rule(layer_type: str, sliding_window: int) -> tuple[bool, int | None]:
    if layer_type == SLIDING:
        return True, sliding_window
    if layer_type == FULL:
        return False, None
    raise ValueError(f"unknown layer type {layer_type!r}")


def dense_attention_mask(layout: BlockLayout, layer_type: str, sliding_window: int) -> torch.Tensor:
    """Boolean ``[Q, n+Q]`` mask (True = may attend) for ``F.scaled_dot_product_attention``."""
    causal, window = _layer_rule(layer_type, sliding_window)
    dev = layout.anchors.device
    q = torch.arange(layout.num_queries, device=dev)[:, None]
    kv = torch.arange(layout.kv_len, device=dev)[None, :]
    return mask_values(layout.index, q, kv, causal=causal, window=window)


def _pad(t: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    if t.numel() >= length:
        return t
    return torch.cat([t, t.new_full((length - t.numel(),), value)])


def flex_block_mask(
    layout: BlockLayout,
    layer_type: str,
    sliding_window: int,
    tile: int | tuple[int, int] = FLEX_TILE,
) -> Any:
    """A flex ``BlockMask`` for one layer type, with tile lists computed from the anchors.

    Per query row the visible keys are (at most) one context range ``[lo, a_j - 1]`` and one
    range inside its own block; per ``tile``-row query tile the union of those ranges gives
    the key tiles to visit (conservative, exact masking is done by ``mask_mod``). Context key
    tiles that every row of a complete query tile sees entirely are listed as *full* tiles
    (``mask_mod`` skipped). Cost: ``O(Q + tiles)``, no ``[Q, n+Q]`` tensor.
    """
    if BlockMask is None:  # pragma: no cover
        raise RuntimeError("flex attention is not available in this torch build")
    causal, window = _layer_rule(layer_type, sliding_window)
    qb, kb = (tile, tile) if isinstance(tile, int) else tile
    idx = layout.index
    dev = layout.anchors.device
    n, nq, kv_len, bs = layout.n_ctx, layout.num_queries, layout.kv_len, layout.block_size
    tq, tkv = max(1, -(-nq // qb)), max(1, -(-kv_len // kb))
    big = torch.iinfo(torch.int64).max // 4

    # Per query row: context range [c_lo, c_hi] and own-block range [b_lo, b_hi] (inclusive).
    q_rows = torch.arange(nq, device=dev)
    c_lo = layout.doc_start[idx.q_doc] if nq else idx.q_doc
    if window is not None:
        c_lo = torch.maximum(c_lo, idx.q_pos - window + 1)
    c_hi = idx.q_anchor - 1
    b_lo = n + idx.q_block * bs
    b_hi = b_lo + bs - 1
    if causal:
        b_hi = n + q_rows
    if window is not None:
        b_lo = torch.maximum(b_lo, n + q_rows - window + 1)
    c_empty = (c_lo > c_hi) | ~idx.q_valid
    b_empty = ~idx.q_valid
    c_lo_e, c_hi_e = c_lo.masked_fill(c_empty, big), c_hi.masked_fill(c_empty, -1)
    b_lo_e, b_hi_e = b_lo.masked_fill(b_empty, big), b_hi.masked_fill(b_empty, -1)

    row_tile = q_rows // qb

    def reduce(values: torch.Tensor, how: str, init: int) -> torch.Tensor:
        out = torch.full((tq,), init, dtype=torch.int64, device=dev)
        return out.scatter_reduce(0, row_tile, values, reduce=how, include_self=True)

    # Union over the tile's rows (any row may see it) ...
    u_c_lo, u_c_hi = reduce(c_lo_e, "amin", big), reduce(c_hi_e, "amax", -1)
    u_b_lo, u_b_hi = reduce(b_lo_e, "amin", big), reduce(b_hi_e, "amax", -1)
    # ... and intersection of context ranges (every row sees it; empty rows make it empty).
    i_c_lo = reduce(c_lo.masked_fill(c_empty, big), "amax", -1)
    i_c_hi = reduce(c_hi.masked_fill(c_empty, -1), "amin", big)

    k_first = torch.arange(tkv, device=dev) * kb
    k_last = torch.clamp(k_first + kb - 1, max=kv_len - 1)

    def overlaps(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (k_first[None, :] <= hi[:, None]) & (k_last[None, :] >= lo[:, None])

    visit = overlaps(u_c_lo, u_c_hi) | overlaps(u_b_lo, u_b_hi)
    complete_q = (torch.arange(tq, device=dev) + 1) * qb <= nq
    complete_kv = (k_first + kb) <= n  # whole tile inside the context
    full = (
        (k_first[None, :] >= i_c_lo[:, None])
        & ((k_first + kb - 1)[None, :] <= i_c_hi[:, None])
        & complete_q[:, None]
        & complete_kv[None, :]
    )
    partial = visit & ~full

    def lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(-1).to(torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None], order[None, None]

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)

    # Pad the index arrays so the kernel's reads past the ragged last tile stay in bounds;
    # padded queries are invalid, padded keys belong to no document and no block.
    q_pad, kv_pad = tq * qb, tkv * kb
    pidx = MaskIndex(
        q_doc=_pad(idx.q_doc, q_pad, -5),
        q_block=_pad(idx.q_block, q_pad, -5),
        q_anchor=_pad(idx.q_anchor, q_pad, 0),
        q_pos=_pad(idx.q_pos, q_pad, 0),
        q_valid=_pad(idx.q_valid, q_pad, False),
        kv_doc=_pad(idx.kv_doc, kv_pad, -7),
        kv_block=_pad(idx.kv_block, kv_pad, -7),
        kv_pos=_pad(idx.kv_pos, kv_pad, 0),
    )

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_values(pidx, q_idx, kv_idx, causal=causal, window=window)

    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(qb, kb),
        mask_mod=mask_mod,
        seq_lengths=(nq, kv_len),
    )


def build_attention_masks(
    layout: BlockLayout,
    layer_types: Sequence[str],
    sliding_window: int,
    backend: str,
    flex_tile: int | tuple[int, int] = FLEX_TILE,
) -> dict[str, Any]:
    """One mask per layer type present: flex ``BlockMask`` (``backend="flex"``) or dense bool."""
    out: dict[str, Any] = {}
    for lt in dict.fromkeys(layer_types):
        if backend == "flex":
            out[lt] = flex_block_mask(layout, lt, sliding_window, flex_tile)
        elif backend == "sdpa":
            out[lt] = dense_attention_mask(layout, lt, sliding_window)
        else:
            raise ValueError(f"backend must be 'flex' or 'sdpa' (got {backend!r})")
    return out


# --------------------------------------------------------------------------- chunked loss


class _ChunkedLMLoss(torch.autograd.Function):
    """Weighted CE (+ KL to target logits) over the full vocabulary, chunk by chunk.

    Forward keeps only the per-row log-sum-exp; backward recomputes each chunk's logits, so
    at most one ``[chunk, vocab]`` block of logits (two with KL) exists at any time.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_w, target_hidden, kl_weight, chunk):
        r = hidden.shape[0]
        dev = hidden.device
        lse = torch.empty(r, dtype=torch.float32, device=dev)
        ce = torch.empty(r, dtype=torch.float32, device=dev)
        kl = torch.zeros(r, dtype=torch.float32, device=dev)
        pred = torch.empty(r, dtype=torch.int64, device=dev)
        for s in range(0, r, chunk):
            e = min(r, s + chunk)
            logits = F.linear(hidden[s:e], weight).float()
            lse_c = torch.logsumexp(logits, dim=-1)
            lse[s:e] = lse_c
            ce[s:e] = lse_c - logits.gather(1, labels[s:e, None]).squeeze(1)
            pred[s:e] = logits.argmax(dim=-1)
            if target_hidden is not None:
                t_logp = F.log_softmax(F.linear(target_hidden[s:e], weight).float(), dim=-1)
                kl[s:e] = (t_logp.exp() * (t_logp - (logits - lse_c[:, None]))).sum(-1)
            del logits
        ce_sum = (ce * row_w).sum()
        kl_sum = (kl * row_w).sum()
        total = ce_sum + kl_weight * kl_sum
        ctx.save_for_backward(hidden, weight, labels, row_w, lse, target_hidden)
        ctx.kl_weight = float(kl_weight)
        ctx.chunk = int(chunk)
        ctx.mark_non_differentiable(ce_sum, kl_sum, pred)
        return total, ce_sum, kl_sum, pred

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_kl, _g_pred):
        hidden, weight, labels, row_w, lse, target_hidden = ctx.saved_tensors
        klw, chunk = ctx.kl_weight, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        r = hidden.shape[0]
        for s in range(0, r, chunk):
            e = min(r, s + chunk)
            w = row_w[s:e] * g_total
            logits = F.linear(hidden[s:e], weight).float()
            g = torch.exp(logits - lse[s:e, None]) * (w * (1.0 + klw))[:, None]  # softmax * ...
            del logits
            g.scatter_add_(1, labels[s:e, None], -w[:, None])
            if target_hidden is not None and klw != 0.0:
                p_t = F.softmax(F.linear(target_hidden[s:e], weight).float(), dim=-1)
                g.sub_(p_t * (klw * w)[:, None])
                del p_t
            if want_h:
                grad_h[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += g.t() @ hidden[s:e].float()
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


class ChunkedLossResult(NamedTuple):
    loss_sum: torch.Tensor  # differentiable: sum_w CE + kl_weight * sum_w KL
    ce_sum: torch.Tensor  # detached
    kl_sum: torch.Tensor  # detached
    pred: torch.Tensor  # [R] argmax token of the draft


def chunked_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: int,
    *,
    target_hidden: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> ChunkedLossResult:
    """Weighted full-vocabulary CE of ``lm_head(hidden)`` vs ``labels``, ``chunk_rows`` rows at a time.

    ``target_hidden`` (``[R, H]``, the target's last hidden state aligned with each row) adds
    ``kl_weight * sum_w KL(softmax(lm_head(target_hidden)) || softmax(lm_head(hidden)))``; the
    target distribution is a constant (no gradient flows through it). Gradients reach
    ``hidden`` and, if it requires grad, ``lm_head_weight`` (through the draft logits).
    """
    if chunk_rows < 1:
        raise ValueError("chunk_rows must be >= 1")
    weight = lm_head_weight.to(hidden.dtype)
    row_w = row_weights.to(torch.float32)
    th = target_hidden.to(hidden.dtype) if (target_hidden is not None and kl_weight > 0) else None
    total, ce_sum, kl_sum, pred = _ChunkedLMLoss.apply(
        hidden, weight, labels.to(torch.int64), row_w, th, float(kl_weight), int(chunk_rows)
    )
    return ChunkedLossResult(total, ce_sum, kl_sum, pred)


# --------------------------------------------------------------------------- compute_loss


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # scalar with grad: weighted sum (CE + kl_weight*KL), not divided
    weight_sum: torch.Tensor  # float32 scalar: sum of the label weights
    correct_per_pos: torch.Tensor  # [block_size] float32: top-1 hits per block slot (slot 0 stays 0)
    count_per_pos: torch.Tensor  # [block_size] float32: valid labels per block slot (unweighted)
    num_blocks: int
    num_query_tokens: int
    ce_sum: torch.Tensor  # detached weighted CE sum
    kl_sum: torch.Tensor  # detached weighted KL sum (0 without KL)
    # Eval-rule acceptance (block_acceptance_lengths): sum over blocks of 1 + the longest correct
    # draft prefix, and the number of blocks counted; their ratio is tau as `dflash-ipc eval` counts it.
    accept_len_sum: torch.Tensor | None = None  # float32 scalar
    accept_blocks: torch.Tensor | None = None  # float32 scalar


def _empty_output(model: DFlashDrafter, bs: int, dev: torch.device) -> LossOutput:
    # Keep every trainable parameter in the graph (zero gradient) so DDP and optimizers
    # behave the same on a batch with nothing to learn.
    zero = sum((p.sum() * 0.0 for p in model.trainable_parameters()), torch.zeros((), device=dev))
    z = torch.zeros(bs, dtype=torch.float32, device=dev)
    return LossOutput(
        loss_sum=zero,
        weight_sum=torch.zeros((), dtype=torch.float32, device=dev),
        correct_per_pos=z,
        count_per_pos=z.clone(),
        num_blocks=0,
        num_query_tokens=0,
        ce_sum=torch.zeros((), device=dev),
        kl_sum=torch.zeros((), device=dev),
        accept_len_sum=torch.zeros((), dtype=torch.float32, device=dev),
        accept_blocks=torch.zeros((), dtype=torch.float32, device=dev),
    )


def compute_loss(
    model: DFlashDrafter,
    views: SlotViews,
    drafter_cfg: DrafterConfig,
    training_cfg: TrainingConfig,
    generator: torch.Generator | None = None,
) -> LossOutput:
    """One DFlash training forward on a packed batch (module docstring has the semantics).

    ``views`` must already be on the drafter's device; ``generator`` (anchors, noise) too.
    """
    mcfg = model.config
    bs = mcfg.block_size
    if drafter_cfg.block_size != bs:
        raise ValueError(f"drafter_cfg.block_size {drafter_cfg.block_size} != model block_size {bs}")
    planes = views.planes
    k = mcfg.num_context_planes
    if planes.dim() != 3 or planes.shape[0] not in (k, k + 1):
        raise ValueError(
            f"planes must be [k or k+1, n, H] with k={k} context planes, got {tuple(planes.shape)}"
        )
    use_kl = training_cfg.kl_weight > 0
    if use_kl and planes.shape[0] != k + 1:
        raise ValueError(
            "training.kl_weight > 0 needs the target's last hidden state as an extra plane "
            "(target.capture_last_hidden = true)"
        )
    n = planes.shape[1]
    dev = planes.device
    token_ids = views.token_ids.to(torch.int64)
    loss_mask = views.loss_mask.bool()
    seq_lens = views.seq_lens

    doc = document_index(seq_lens, n)
    anchors, anchor_doc = sample_anchors(
        loss_mask, seq_lens, drafter_cfg.num_anchors, bs, generator, doc=doc, max_per_batch=drafter_cfg.max_anchors_per_batch
    )
    if anchors.numel() == 0:
        return _empty_output(model, bs, dev)
    lab = block_labels(token_ids, loss_mask, anchors, doc.doc_end[anchor_doc], bs, training_cfg.loss_gamma)
    layout = build_block_layout(seq_lens, anchors, anchor_doc, bs, block_valid=lab.valid.any(dim=1), doc=doc)

    context = concat_context(planes[:k], drafter_cfg.noise_std, generator)
    masks = build_attention_masks(layout, mcfg.layer_types, mcfg.sliding_window, model.attention_backend(dev))
    hidden = model(
        context,
        layout.context_position_ids,
        model.block_input_ids(token_ids[anchors]),
        layout.block_position_ids,
        masks,
    )

    rows = lab.valid.reshape(-1).nonzero().squeeze(1)
    labels = lab.labels.reshape(-1)[rows]
    weights = lab.weights.reshape(-1)[rows]
    target_hidden = None
    if use_kl:
        target_hidden = planes[k][lab.label_pos.reshape(-1)[rows] - 1]
    res = chunked_lm_loss(
        hidden[rows],
        model.lm_head_weight,
        labels,
        weights,
        training_cfg.ce_chunk_tokens,
        target_hidden=target_hidden,
        kl_weight=training_cfg.kl_weight,
    )
    slot = rows % bs
    correct = torch.zeros(bs, dtype=torch.float32, device=dev).index_add_(
        0, slot, (res.pred == labels).to(torch.float32)
    )
    count = torch.zeros(bs, dtype=torch.float32, device=dev).index_add_(
        0, slot, torch.ones_like(weights)
    )
    hit = torch.zeros(lab.valid.numel(), dtype=torch.bool, device=dev)
    hit[rows] = res.pred == labels
    counted = lab.valid[:, 1]  # blocks whose first draft slot has a label (every sampled anchor's)
    accept_len = block_acceptance_lengths(hit.view_as(lab.valid), lab.valid) * counted
    return LossOutput(
        loss_sum=res.loss_sum,
        weight_sum=weights.sum(),
        correct_per_pos=correct,
        count_per_pos=count,
        num_blocks=layout.num_blocks,
        num_query_tokens=layout.num_queries,
        ce_sum=res.ce_sum,
        kl_sum=res.kl_sum,
        accept_len_sum=accept_len.sum().to(torch.float32),
        accept_blocks=counted.sum().to(torch.float32),
    )


# --------------------------------------------------------------------------- metrics


def accuracy_per_pos(correct_per_pos: torch.Tensor, count_per_pos: torch.Tensor) -> torch.Tensor:
    """``correct / count`` per block slot, 0 where a slot had no valid label."""
    count = count_per_pos.to(torch.float64)
    return torch.where(count > 0, correct_per_pos.to(torch.float64) / count.clamp(min=1), torch.zeros_like(count))


def expected_acceptance_length(acc_per_pos: Sequence[float] | torch.Tensor) -> float:
    """Predicted mean acceptance length ``tau`` from per-slot top-1 accuracies.

    ``acc_per_pos`` is indexed by block slot (length ``block_size``); slot 0 is the anchor
    (always "accepted": the target's own token) and its entry is ignored. With
    ``acc_s`` the accuracy of slot ``s``::

        tau = 1 + sum_{s=1}^{bs-1} prod_{i=1}^{s} acc_i

    i.e. one token from every verification step plus the expected length of the accepted
    draft prefix, treating slots as independent (per-slot accuracies are marginal, so this
    estimates the greedy acceptance length; NaN entries count as 0).
    """
    acc = torch.as_tensor(acc_per_pos, dtype=torch.float64).flatten()
    if acc.numel() < 1:
        return 1.0
    acc = torch.nan_to_num(acc[1:], nan=0.0).clamp(0.0, 1.0)
    return float(1.0 + torch.cumprod(acc, 0).sum()) if acc.numel() else 1.0


def block_acceptance_lengths(hit: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Tokens one verification step of each block would produce, by eval's rule (``[N]`` int64).

    ``hit[j, s]``: the draft's argmax at slot ``s`` of block ``j`` equals the label; ``valid``:
    the slot has a label. Slot 0 (the anchor) is ignored. A block yields 1 (the target's bonus
    token) plus the longest prefix of slots ``1, 2, ...`` that are valid and hit: acceptance is
    *joint* (a miss ends the block, later hits count for nothing), as in ``eval.verify``; an
    invalid slot (document end, unsupervised token) ends the prefix like the end of generation.
    The mean over blocks is the eval-rule tau; :func:`expected_acceptance_length` instead
    multiplies per-slot marginals as if the slots of a block were independent: it overstates
    tau when later slots hit in blocks whose earlier slots missed (hits eval never reaches) and
    understates it when whole blocks are right or wrong together.
    """
    if hit.shape != valid.shape or hit.dim() != 2:
        raise ValueError(f"hit and valid must both be [N, block_size], got {tuple(hit.shape)} and {tuple(valid.shape)}")
    ok = (hit & valid)[:, 1:].to(torch.int64)
    return 1 + ok.cumprod(dim=1).sum(dim=1)
