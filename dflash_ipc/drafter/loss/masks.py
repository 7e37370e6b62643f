"""DFlash attention masks over a :class:`~dflash_ipc.drafter.loss.blocks.BlockLayout`.

**Attention** (:func:`build_attention_masks`): keys/values are ``[context (n) | blocks (Q)]``,
queries the ``Q = N*block_size`` block tokens. A query of block ``j`` at position
``p = a_j + s`` sees

* context tokens ``c`` of the same document with ``c < a_j`` (strict: at inference the
  target's hidden state of the anchor is not yet known), and in sliding layers only
  ``c > p - sliding_window`` (HF window semantics: the window counts the query itself);
* its own block: bidirectional in full-attention layers, causal (``s' <= s``) and
  windowed in sliding layers (the SGLang/vLLM defaults for DFlash layer types);
* nothing else. Blocks without a single valid label see nothing at all (their rows
  output 0, never NaN) and carry no loss.

The same element-wise rule (:func:`mask_values`) feeds a dense boolean SDPA mask, the
``mask_mod`` of a flex ``BlockMask`` whose tile lists are computed analytically from the
anchors, and the per-document context masks of the blockwise path (:func:`blockwise_mask`);
no ``[Q, n+Q]`` mask is ever materialized on the latter two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from dflash_ipc.drafter.loss.blocks import BlockLayout, MaskIndex
from dflash_ipc.drafter.model.blockwise import BlockwiseMask, merge_groups
from dflash_ipc.drafter.model.dflash_drafter import FULL, SLIDING

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]

FLEX_TILE = 128  # flex_attention's default sparse block size


# --------------------------------------------------------------------------- masks


def mask_values(idx: MaskIndex, q: torch.Tensor, kv: torch.Tensor, *, causal: bool, window: int | None) -> torch.Tensor:
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


def blockwise_mask(layout: BlockLayout, layer_type: str, sliding_window: int) -> BlockwiseMask:
    """The groups, context masks and own-block rule of :func:`~dflash_ipc.drafter.model.blockwise.blockwise_attention`:
    a group per run of blocks over one document (adjacent ones merged while cheap), scoring the union
    of its rows' visible context ranges (:class:`_RowRanges`); the same element-wise rule as the dense mask."""
    causal, window = _layer_rule(layer_type, sliding_window)
    idx, n, bs, nb = layout.index, layout.n_ctx, layout.block_size, layout.num_blocks
    dev = layout.anchors.device
    nq = layout.num_queries
    if nb == 0:
        empty = torch.zeros((0, bs, bs), dtype=torch.bool, device=dev)
        return BlockwiseMask(n, bs, (), (), empty, torch.zeros(0, dtype=torch.bool, device=dev))
    rows = _RowRanges.of(layout, causal, window)
    _, blocks_per_run = torch.unique_consecutive(layout.anchor_doc, return_counts=True)
    n_runs = blocks_per_run.numel()
    run_of_row = torch.arange(n_runs, device=dev).repeat_interleave(blocks_per_run * bs)
    lo = torch.full((n_runs,), _BIG, dtype=torch.int64, device=dev).scatter_reduce(
        0, run_of_row, rows.c_lo.masked_fill(rows.c_empty, _BIG), reduce="amin"
    )
    hi = torch.full((n_runs,), -1, dtype=torch.int64, device=dev).scatter_reduce(
        0, run_of_row, rows.c_hi.masked_fill(rows.c_empty, -1), reduce="amax"
    )
    first_block = torch.cat([blocks_per_run.new_zeros(1), blocks_per_run.cumsum(0)])
    groups = []
    for b0, b1, c0, c1 in zip(first_block[:-1].tolist(), first_block[1:].tolist(), lo.tolist(), (hi + 1).tolist()):
        groups.append((b0 * bs, b1 * bs, c0, c1) if c0 < c1 else (b0 * bs, b1 * bs, 0, 0))
    groups = merge_groups(groups)
    q_rows = torch.arange(nq, device=dev)
    context = tuple(
        mask_values(idx, q_rows[r0:r1, None], torch.arange(c0, c1, device=dev)[None, :], causal=causal, window=window)
        for r0, r1, c0, c1 in groups
    )
    own_block = mask_values(idx, q_rows.view(nb, bs, 1), (n + q_rows).view(nb, 1, bs), causal=causal, window=window)
    live = own_block.reshape(nq, bs).any(-1) | torch.cat([c.any(-1) for c in context])
    return BlockwiseMask(n, bs, tuple(groups), context, own_block, live)


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
    nq, kv_len = layout.num_queries, layout.kv_len
    tq, tkv = max(1, -(-nq // qb)), max(1, -(-kv_len // kb))
    partial, full = _key_tiles(layout, _RowRanges.of(layout, causal, window), qb, kb, tq, tkv)
    kv_num, kv_idx = _tile_lists(partial)
    full_num, full_idx = _tile_lists(full)
    pidx = _padded_index(layout.index, tq * qb, tkv * kb)

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


_BIG = torch.iinfo(torch.int64).max // 4  # an empty range's lower end: above every key index


class _RowRanges(NamedTuple):
    """Per query row: the context range ``[c_lo, c_hi]`` and the own-block range ``[b_lo, b_hi]`` it may
    see (inclusive), and which of them are empty (an invalid row sees nothing)."""

    c_lo: torch.Tensor
    c_hi: torch.Tensor
    b_lo: torch.Tensor
    b_hi: torch.Tensor
    c_empty: torch.Tensor
    b_empty: torch.Tensor

    @classmethod
    def of(cls, layout: BlockLayout, causal: bool, window: int | None) -> _RowRanges:
        idx, n, bs = layout.index, layout.n_ctx, layout.block_size
        q_rows = torch.arange(layout.num_queries, device=layout.anchors.device)
        c_lo = layout.doc_start[idx.q_doc] if layout.num_queries else idx.q_doc
        if window is not None:
            c_lo = torch.maximum(c_lo, idx.q_pos - window + 1)
        c_hi = idx.q_anchor - 1
        b_lo = n + idx.q_block * bs
        b_hi = b_lo + bs - 1
        if causal:
            b_hi = n + q_rows
        if window is not None:
            b_lo = torch.maximum(b_lo, n + q_rows - window + 1)
        return cls(c_lo, c_hi, b_lo, b_hi, (c_lo > c_hi) | ~idx.q_valid, ~idx.q_valid)


def _key_tiles(layout: BlockLayout, rows: _RowRanges, qb: int, kb: int, tq: int, tkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tq, tkv]`` booleans: the key tiles a query tile visits with ``mask_mod`` (partial) and those
    every row of a complete query tile sees entirely inside the context (full, ``mask_mod`` skipped)."""
    dev = layout.anchors.device
    nq, kv_len, n = layout.num_queries, layout.kv_len, layout.n_ctx
    row_tile = torch.arange(nq, device=dev) // qb

    def reduce(values: torch.Tensor, how: str, init: int) -> torch.Tensor:
        out = torch.full((tq,), init, dtype=torch.int64, device=dev)
        return out.scatter_reduce(0, row_tile, values, reduce=how, include_self=True)

    c_lo_e, c_hi_e = rows.c_lo.masked_fill(rows.c_empty, _BIG), rows.c_hi.masked_fill(rows.c_empty, -1)
    b_lo_e, b_hi_e = rows.b_lo.masked_fill(rows.b_empty, _BIG), rows.b_hi.masked_fill(rows.b_empty, -1)
    # Union over the tile's rows (any row may see it) ...
    u_c_lo, u_c_hi = reduce(c_lo_e, "amin", _BIG), reduce(c_hi_e, "amax", -1)
    u_b_lo, u_b_hi = reduce(b_lo_e, "amin", _BIG), reduce(b_hi_e, "amax", -1)
    # ... and intersection of context ranges (every row sees it; empty rows make it empty).
    i_c_lo = reduce(c_lo_e, "amax", -1)
    i_c_hi = reduce(c_hi_e, "amin", _BIG)

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
    return visit & ~full, full


def _tile_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[tq, tkv]`` tile choice as flex's (count per query tile, key tile indices listed first)."""
    num = m.sum(-1).to(torch.int32)
    order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


def _padded_index(idx: MaskIndex, q_pad: int, kv_pad: int) -> MaskIndex:
    """The index arrays padded so the kernel's reads past the ragged last tile stay in bounds;
    padded queries are invalid, padded keys belong to no document and no block."""
    return MaskIndex(
        q_doc=_pad(idx.q_doc, q_pad, -5),
        q_block=_pad(idx.q_block, q_pad, -5),
        q_anchor=_pad(idx.q_anchor, q_pad, 0),
        q_pos=_pad(idx.q_pos, q_pad, 0),
        q_valid=_pad(idx.q_valid, q_pad, False),
        kv_doc=_pad(idx.kv_doc, kv_pad, -7),
        kv_block=_pad(idx.kv_block, kv_pad, -7),
        kv_pos=_pad(idx.kv_pos, kv_pad, 0),
    )


def build_attention_masks(
    layout: BlockLayout,
    layer_types: Sequence[str],
    sliding_window: int,
    backend: str,
    flex_tile: int | tuple[int, int] = FLEX_TILE,
) -> dict[str, Any]:
    """One mask per layer type present: flex ``BlockMask`` (``backend="flex"``), dense bool ("sdpa") or
    :class:`~dflash_ipc.drafter.model.blockwise.BlockwiseMask` ("blockwise")."""
    out: dict[str, Any] = {}
    for lt in dict.fromkeys(layer_types):
        if backend == "flex":
            out[lt] = flex_block_mask(layout, lt, sliding_window, flex_tile)
        elif backend == "sdpa":
            out[lt] = dense_attention_mask(layout, lt, sliding_window)
        elif backend == "blockwise":
            out[lt] = blockwise_mask(layout, lt, sliding_window)
        else:
            raise ValueError(f"backend must be 'flex', 'sdpa' or 'blockwise' (got {backend!r})")
    return out
