"""Held-out τ by simulated decoding: ``dflash-ipc eval``'s greedy decode replayed on teacher-forced data.

gen-data's held-out answers (temperature 0) are the target's own greedy continuations, so eval's
decode of a held-out prompt can be replayed from per-anchor acceptance lengths alone. ``a(p)``: the
draft slots a block anchored at answer token ``p`` gets accepted (slot 0 is the known token at
``p``; the longest prefix of slots ``1..B-1`` whose argmax equals the data's next tokens; a slot past
the document end or on an unsupervised token ends the prefix). Eval's first block is anchored at
the first answer token (the target's prefill produced it; not a verification step), each step
emits ``a(p) + 1`` tokens (the accepted drafts and the target's bonus token) and the next block is
anchored at ``p + a(p) + 1``::

    answer    r0 r1 r2 r3 r4 r5 r6 r7 r8        (L = 9; r8 = <|im_end|>, eval's stop)
    a(p)       2  .  .  0  4  .  .  .  .
    steps     [r0 ->] r1 r2 r3 | [r3 ->] r4 | [r4 ->] r5 r6 r7 r8   (no bonus after r8: the answer ended)
    tau       8 tokens / 3 steps; with max_new 7 the last step is cut after r6: 6 tokens / 3 steps

The last step is cut where eval cuts it: at the answer's end (its last token is the stop token eval
stops on) or after ``max_new`` answer tokens (eval's ``--max-new`` counts the prefill's token too).
A held-out pass (:func:`score_holdout_batch`) anchors a block at **every** valid position, so ``a(p)``
is known wherever the chain lands, and pools ``tokens / steps`` over answers as eval pools over
prompts. Each run of supervised tokens of a document is one answer (gen-data records have one).
Blocks anchored at uniformly drawn positions (the earlier estimate, kept as ``tau_holdout_uniform``)
overstate eval's τ: real blocks start right after a correction, systematically harder positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_ipc.config import DrafterConfig, TrainingConfig
from dflash_ipc.drafter.loss.blocks import document_index, sample_anchors, valid_anchor_mask
from dflash_ipc.drafter.loss.objective import compute_loss
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter
from dflash_ipc.transport.slots import SlotViews

__all__ = ["HoldoutScore", "answer_spans", "chained_counts", "chained_decode", "score_holdout_batch"]


def chained_decode(accepted: Sequence[int], max_new: int = 0) -> tuple[int, int]:
    """``(tokens, steps)`` of eval's decode of one answer: τ = tokens / steps.

    ``accepted[i]``: draft slots accepted by a block anchored at answer token ``i`` (``i = 0``: the
    first generated token); the answer has ``len(accepted)`` tokens, its last one the stop token.
    ``max_new`` > 0 decodes only the first ``max_new`` answer tokens (eval's ``--max-new``); 0: all.
    ``tokens`` excludes the prefill's first token, as eval's τ does.
    """
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0 (got {max_new})")
    end = len(accepted) if max_new == 0 else min(len(accepted), max_new)
    tokens = steps = p = 0
    while p < end - 1:
        a = int(accepted[p])
        if a < 0:
            raise ValueError(f"no acceptance length at answer token {p}: every position the decode reaches needs an anchor")
        tokens += min(a + 1, end - 1 - p)
        steps += 1
        p += a + 1
    return tokens, steps


def answer_spans(loss_mask: torch.Tensor, seq_lens: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` global positions of every run of supervised tokens, a run never crossing a document."""
    lm = loss_mask.bool().cpu()
    n = lm.numel()
    if n == 0:
        return []
    doc = document_index(seq_lens.cpu(), n)
    first = torch.zeros(n, dtype=torch.bool)
    first[doc.doc_start[doc.doc_start < n]] = True
    prev = torch.zeros(n, dtype=torch.bool)
    prev[1:] = lm[:-1]
    starts = (lm & (first | ~prev)).nonzero().squeeze(1)
    last = torch.zeros(n, dtype=torch.bool)
    last[(doc.doc_end - 1)[doc.doc_end > doc.doc_start]] = True
    nxt = torch.zeros(n, dtype=torch.bool)
    nxt[:-1] = lm[1:]
    ends = (lm & (last | ~nxt)).nonzero().squeeze(1) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def chained_counts(
    loss_mask: torch.Tensor, seq_lens: torch.Tensor, anchors: torch.Tensor, accept_lengths: torch.Tensor, max_new: int = 0
) -> tuple[int, int, int]:
    """``(tokens, steps, answers)`` of eval's decode over every answer of a packed batch.

    ``anchors`` [N] global positions and ``accept_lengths`` [N] (1 + accepted drafts, as
    ``block_acceptance_lengths`` counts them) of blocks anchored at every valid position."""
    acc = torch.full((loss_mask.numel(),), -1, dtype=torch.int64)
    acc[anchors.cpu().to(torch.int64)] = accept_lengths.cpu().to(torch.int64) - 1
    acc_list = acc.tolist()
    tokens = steps = 0
    spans = answer_spans(loss_mask, seq_lens)
    for start, end in spans:
        t, s = chained_decode(acc_list[start:end], max_new)
        tokens += t
        steps += s
    return tokens, steps, len(spans)


@dataclass
class HoldoutScore:
    """One held-out batch's sums (a pass adds its batches' up)."""

    tokens: int  # simulated decode: tokens emitted by verification steps
    steps: int  # simulated verification steps
    answers: int
    blocks: int  # blocks scored: one per valid anchor
    uniform_accept_sum: float  # uniform anchors (the training rule): sum of acceptance lengths
    uniform_blocks: int
    ce_sum: float  # weighted CE over every scored block
    weight_sum: float


@torch.no_grad()
def score_holdout_batch(
    model: DFlashDrafter, views: SlotViews, drafter_cfg: DrafterConfig, training_cfg: TrainingConfig, seed: int, max_new: int
) -> HoldoutScore:
    """Score one held-out batch: blocks at every valid anchor, chained by eval's rule (module docstring).

    Noise off. The uniform anchors of the earlier estimate are drawn as training draws them, from a
    generator seeded by ``seed`` (the same blocks every pass), and read out of the every-anchor
    blocks. Memory: ``drafter.anchor_chunk`` blocks per forward, or (0) as many as the uniform
    draw holds, the most a training step of this batch runs at once; no gradient is kept.
    """
    bs = model.config.block_size
    loss_mask, seq_lens = views.loss_mask, views.seq_lens
    dev = loss_mask.device
    generator = torch.Generator(device=dev)
    generator.manual_seed(seed)
    doc = document_index(seq_lens, loss_mask.numel())
    uniform, _ = sample_anchors(
        loss_mask, seq_lens, drafter_cfg.num_anchors, bs, generator, doc=doc, max_per_batch=drafter_cfg.max_anchors_per_batch
    )
    every = valid_anchor_mask(loss_mask, seq_lens, doc).nonzero().squeeze(1)
    cfg = dataclasses.replace(drafter_cfg, noise_std=0.0, anchor_chunk=drafter_cfg.anchor_chunk or max(1, uniform.numel()))
    out = compute_loss(model, views, cfg, training_cfg, anchors=(every, doc.doc_of_token[every]), per_block=True)
    lengths = out.block_accept
    tokens, steps, answers = chained_counts(loss_mask, seq_lens, every, lengths, max_new)
    picked = lengths[torch.searchsorted(every, uniform)] if uniform.numel() else lengths[:0]
    return HoldoutScore(
        tokens=tokens,
        steps=steps,
        answers=answers,
        blocks=int(every.numel()),
        uniform_accept_sum=float(picked.sum()),
        uniform_blocks=int(picked.numel()),
        ce_sum=float(out.ce_sum),
        weight_sum=float(out.weight_sum),
    )
