"""Where the draft blocks of a packed batch sit: documents, anchors, block layout, labels.

Batch: ``token_ids [n]``, ``loss_mask [n]`` (uint8), ``seq_lens [b]`` (int32, sum ``n``): several
documents back to back; RoPE positions restart at 0 in each.

* **Anchors** (:func:`sample_anchors`): per document, positions ``i`` with
  ``loss_mask[i] & loss_mask[i+1]`` and ``i+1`` in the same document, at most
  ``num_anchors`` per document, drawn uniformly without replacement, then sorted. This is
  SpecForge's rule (``OnlineDFlashModel._sample_anchor_positions``: "anchors whose clean
  token and first target are supervised", capped at ``num_anchors`` per *sample*); a packed
  document here plays the role of one SpecForge sample, so the budget is per document.
* **Blocks**: block ``j`` holds ``[token(a_j), MASK x (block_size-1)]`` at positions
  ``a_j + 0..block_size-1``.
* **Labels** (:func:`block_labels`): slot ``s >= 1`` of block ``j`` predicts
  ``token[a_j + s]`` with weight ``exp(-(s-1)/gamma) * loss_mask[a_j+s] * [a_j+s in the
  same document]``; slot 0 (the anchor) has none.

The attention rule over this layout is :mod:`dflash_ipc.drafter.loss.masks`; the loss, :mod:`dflash_ipc.drafter.loss.objective`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

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


def valid_anchor_mask(loss_mask: torch.Tensor, seq_lens: torch.Tensor, doc: DocumentIndex | None = None) -> torch.Tensor:
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
