"""Blockwise DFlash attention: each document's context and each block's own keys, never the dense ``[Q, n+Q]``.

A block query sees (``drafter/loss/masks.py``) a contiguous range of its own document's context and keys of
its own block only. The dense SDPA path still scores every query against all ``n + Q`` keys, almost all
of them masked (under 1 % visible in a packed batch of many blocks); on the CPU, where no kernel skips
masked tiles, that is most of a drafter step. Here the queries are cut into *groups* (runs of blocks
over one document, adjacent runs merged while that costs little) and each group scores only its
context range ``[c0, c1)``; every block's own keys are scored as one batched ``[bs, bs]`` product.
One softmax over ``[context range | own block]`` per row gives exactly what the dense path gives
(the same keys, the same mask), in plain differentiable matmuls: ``O(sum of group rows x range + Q x bs)``.

Rows that see nothing (invalid blocks) output 0, as on the other paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Two adjacent groups are scored as one when that adds at most this many masked scores per head:
#: fewer, larger products beat many small ones (each costs a few kernel launches, forward and backward).
MERGE_SLACK = 1 << 14


@dataclass(frozen=True)
class BlockwiseMask:
    """What :func:`blockwise_attention` needs of a layout and a layer type (built by ``masks.blockwise_mask``).

    ``groups[i] = (r0, r1, c0, c1)``: query rows ``[r0, r1)`` (whole blocks) score context keys
    ``[c0, c1)`` under ``context[i]`` (bool ``[r1 - r0, c1 - c0]``); ``own_block`` (bool ``[N, bs, bs]``)
    is each block's rule over its own keys; ``live`` (bool ``[Q]``) marks rows that see anything."""

    n_ctx: int
    block_size: int
    groups: tuple[tuple[int, int, int, int], ...]
    context: tuple[torch.Tensor, ...]
    own_block: torch.Tensor
    live: torch.Tensor


def merge_groups(groups: list[tuple[int, int, int, int]], slack: int = MERGE_SLACK) -> list[tuple[int, int, int, int]]:
    """Adjacent ``(r0, r1, c0, c1)`` groups joined while the joined product holds at most ``slack``
    more scores than the two apart (an empty context range has ``c0 >= c1``)."""
    out: list[tuple[int, int, int, int]] = []
    for g in groups:
        if out:
            c0, c1 = _join(out[-1][2:], g[2:])
            joined = (out[-1][0], g[1], c0, c1)
            if _area(joined) <= _area(out[-1]) + _area(g) + slack:
                out[-1] = joined
                continue
        out.append(g)
    return out


def _join(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, int]:
    if a[1] <= a[0]:
        return b[0], b[1]
    if b[1] <= b[0]:
        return a[0], a[1]
    return min(a[0], b[0]), max(a[1], b[1])


def _area(g: tuple[int, int, int, int]) -> int:
    r0, r1, c0, c1 = g
    return (r1 - r0) * max(0, c1 - c0)


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockwiseMask, scale: float) -> torch.Tensor:
    """``q`` ``[1, H, Q, hd]`` over ``k``/``v`` ``[1, KV, n+Q, hd]`` (``[context | blocks]``, ``H % KV == 0``,
    query head ``h`` reads key head ``h // (H // KV)``); returns ``[1, H, Q, hd]``."""
    _, heads, nq, hd = q.shape
    if not mask.groups:  # no blocks
        return q.new_zeros(q.shape)
    kv_heads, n, bs = k.shape[1], mask.n_ctx, mask.block_size
    rep, nb = heads // kv_heads, nq // bs
    qh = (q[0] * scale).view(kv_heads, rep, nq, hd)  # heads grouped under the key head they read
    kc, vc = k[0, :, None, :n], v[0, :, None, :n]  # [KV, 1, n, hd]
    kb = k[0, :, n:].reshape(kv_heads, 1, nb, bs, hd)
    vb = v[0, :, n:].reshape(kv_heads, 1, nb, bs, hd)
    neg = float("-inf")
    own = (qh.reshape(kv_heads, rep, nb, bs, hd) @ kb.transpose(-1, -2)).masked_fill(~mask.own_block, neg)  # [KV, rep, N, bs, bs]
    own = own.reshape(kv_heads, rep, nq, bs)
    outs = []
    for (r0, r1, c0, c1), ctx_mask in zip(mask.groups, mask.context):
        live = mask.live[r0:r1, None]
        scores = qh[:, :, r0:r1] @ kc[:, :, c0:c1].transpose(-1, -2)  # [KV, rep, rows, c1 - c0]
        scores = torch.cat([scores.masked_fill(~ctx_mask, neg), own[:, :, r0:r1]], dim=-1)
        probs = torch.softmax(scores.masked_fill(~live, 0.0), dim=-1)  # a dead row: uniform, zeroed below
        width = c1 - c0
        out = probs[..., :width] @ vc[:, :, c0:c1]
        b0, b1 = r0 // bs, r1 // bs
        out = out + (probs[..., width:].reshape(kv_heads, rep, b1 - b0, bs, bs) @ vb[:, :, b0:b1]).reshape(kv_heads, rep, r1 - r0, hd)
        outs.append(out * live.to(out.dtype))
    return torch.cat(outs, dim=2).reshape(1, heads, nq, hd)
