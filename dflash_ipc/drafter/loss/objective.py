"""DFlash training objective on a packed batch: context, anchors, attention masks, loss, metrics.

Batch (``SlotViews`` already on the drafter's device): ``planes [P, n, H]`` (``P = k`` target
planes, plus the target's last hidden state as plane ``k`` when the KL loss is on),
``token_ids [n]``, ``loss_mask [n]`` (uint8), ``seq_lens [b]`` (int32, sum ``n``). Several
documents sit back to back; RoPE positions restart at 0 in each.

One training step (:func:`compute_loss`): anchors, blocks and labels
(:mod:`dflash_ipc.drafter.loss.blocks`), attention masks (:mod:`dflash_ipc.drafter.loss.masks`), the drafter
forward, then the loss (:func:`chunked_lm_loss`): full-vocabulary cross-entropy through the frozen
LM head, its logits finished as the target finishes its own (``DrafterModelConfig.frozen_head``),
``ce_chunk_tokens`` rows at a time, as a custom autograd function that holds at most one
chunk of logits: with the head frozen it takes each chunk's gradient while the chunk's logits exist
(two head GEMMs per row); a trainable head recomputes them in backward (three).
Optional KL to the target: ``KL(p_target || q_draft)`` per supervised slot, with
``p_target = softmax(lm_head(last_hidden[a_j + s - 1]))`` (finished the same way): the target's own
prediction of token ``a_j + s`` comes from its last hidden state one position earlier (causal LM), the
alignment SpecForge's ``_aligned_target_hidden`` uses (``label_index - 1``). Total:
``sum_w CE + kl_weight * sum_w KL`` (same weights ``w``), **not** divided; divide
``loss_sum`` by ``weight_sum`` (summed over ranks) to get the mean. The weights ``w`` are the
fixed decay of :func:`block_labels` or, with ``training.loss_weighting = "dpace"``, the drafter's
own confidence (:func:`dpace_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_ipc.config import DrafterConfig, TrainingConfig
from dflash_ipc.drafter.loss.blocks import BlockLabels, block_labels, build_block_layout, document_index, sample_anchors
from dflash_ipc.drafter.loss.chunked_ce import ChunkedLossResult, chunked_lm_loss
from dflash_ipc.drafter.loss.masks import build_attention_masks
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter
from dflash_ipc.transport.slots import SlotViews

__all__ = [
    "concat_context",
    "ChunkedLossResult",
    "chunked_lm_loss",
    "LossOutput",
    "compute_loss",
    "accuracy_per_pos",
    "expected_acceptance_length",
    "block_acceptance_lengths",
    "dpace_weights",
]


# --------------------------------------------------------------------------- context


def concat_context(planes: torch.Tensor, noise_std: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
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


# --------------------------------------------------------------------------- D-PACE


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights ``[N, block_size]`` from the draft's probability of each label (arXiv 2605.18810).

    ``confidence[j, s]``: the drafter's probability ``q`` of block ``j``'s label at slot ``s`` (any
    value where ``valid`` is false). With the smoothed ``q~ = (1 - alpha) q + alpha`` at valid slots
    and 1 elsewhere (a slot without a label neither ends nor weakens the prefix)::

        w[j, s] = valid[j, s] * sum_{m >= s, valid[j, m]} prod_{i <= m} q~[j, i]

    ``sum_m prod_{i<=m} q~_i`` is the block's expected accepted draft length when each slot is
    accepted with probability ``q~``, and ``w_s`` its derivative by ``log q~_s``: the weighted CE
    ``sum_s w_s * (-log q_s)`` with ``w`` held constant has the gradient of minus that expected
    length (exactly so at ``alpha -> 0``). Early slots weigh most (every later acceptance goes
    through them); a slot behind a weak prefix weighs little until the prefix is learnt.
    """
    q = torch.where(valid, (1.0 - alpha) * confidence.detach().to(torch.float32) + alpha, 1.0)
    reach = torch.cumprod(q, dim=1) * valid
    return reach.flip(1).cumsum(1).flip(1) * valid


def _dpace_reweight(valid: torch.Tensor, rows: torch.Tensor, alpha: float, in_head: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reweight`` for :func:`chunked_lm_loss`: per-row CE of the valid slots ``rows`` -> D-PACE row weights.
    ``in_head`` (``[len(rows)]``): the row's label is one the head can draft; a label outside a draft
    vocabulary is drafted with probability 0 and carries no weight."""

    def reweight(ce: torch.Tensor) -> torch.Tensor:
        confidence = torch.zeros(valid.numel(), dtype=torch.float32, device=ce.device)
        confidence[rows] = torch.where(in_head, torch.exp(-ce), 0.0)
        return dpace_weights(confidence.view_as(valid), valid, alpha).reshape(-1)[rows] * in_head

    return reweight


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
    # per_block=True: every block's eval-rule acceptance length (1 + accepted drafts), [num_blocks] int64, in anchor order
    block_accept: torch.Tensor | None = None


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
        block_accept=torch.zeros(0, dtype=torch.int64, device=dev),
    )


@dataclass
class _Batch:
    """A batch made ready for the drafter (:func:`_prepare`): its anchors, labels, weights and context."""

    planes: torch.Tensor
    k: int
    token_ids: torch.Tensor
    seq_lens: torch.Tensor
    doc: object  # blocks.DocIndex
    anchors: torch.Tensor
    anchor_doc: torch.Tensor
    lab: BlockLabels
    in_head: torch.Tensor  # [N, block_size]: the slot's label is one the head can draft
    weight_sum: torch.Tensor
    context: torch.Tensor
    use_kl: bool


def _check_batch(model: DFlashDrafter, planes: torch.Tensor, drafter_cfg: DrafterConfig, training_cfg: TrainingConfig) -> int:
    """The number of context planes ``k``, once the batch and the configs agree with the model."""
    mcfg = model.config
    if drafter_cfg.block_size != mcfg.block_size:
        raise ValueError(f"drafter_cfg.block_size {drafter_cfg.block_size} != model block_size {mcfg.block_size}")
    if not isinstance(drafter_cfg.anchor_chunk, int):
        raise ValueError(
            f"drafter.anchor_chunk = {drafter_cfg.anchor_chunk!r} is chosen per device before the first step "
            "(dflash_ipc.drafter.training.memory_plan.resolve_anchor_chunk)"
        )
    k = mcfg.num_context_planes
    if planes.dim() != 3 or planes.shape[0] not in (k, k + 1):
        raise ValueError(f"planes must be [k or k+1, n, H] with k={k} context planes, got {tuple(planes.shape)}")
    if training_cfg.kl_weight > 0 and planes.shape[0] != k + 1:
        raise ValueError(
            "training.kl_weight > 0 needs the target's last hidden state as an extra plane (target.capture_last_hidden = true)"
        )
    return k


def _weight_sum(lab: BlockLabels, training_cfg: TrainingConfig, dev: torch.device) -> torch.Tensor:
    """The loss's divisor for this batch (D-PACE "weights": 0 here, the chunks add theirs)."""
    if training_cfg.loss_weighting != "dpace":
        return lab.weights.reshape(-1)[lab.valid.reshape(-1).nonzero().squeeze(1)].sum()
    if training_cfg.dpace_normalizer == "blocks":
        return lab.valid.any(dim=1).sum().to(torch.float32)
    return torch.zeros((), dtype=torch.float32, device=dev)


def _prepare(model, views, drafter_cfg, training_cfg, generator, anchors) -> _Batch | None:
    """Anchors (sampled, or given), block labels and weights, the context; None without any anchor."""
    planes = views.planes
    k = _check_batch(model, planes, drafter_cfg, training_cfg)
    bs, n = model.config.block_size, planes.shape[1]
    token_ids = views.token_ids.to(torch.int64)
    loss_mask = views.loss_mask.bool()
    seq_lens = views.seq_lens
    doc = document_index(seq_lens, n)
    if anchors is None:
        anchors, anchor_doc = sample_anchors(
            loss_mask, seq_lens, drafter_cfg.num_anchors, bs, generator, doc=doc, max_per_batch=drafter_cfg.max_anchors_per_batch
        )
    else:
        anchors, anchor_doc = anchors[0].to(torch.int64), anchors[1].to(torch.int64)
    if anchors.numel() == 0:
        return None
    lab = block_labels(token_ids, loss_mask, anchors, doc.doc_end[anchor_doc], bs, training_cfg.loss_gamma)
    # With a draft vocabulary a label outside it cannot be drafted: no loss (its weight is 0), and a miss.
    in_head = lab.valid if model.draft_index is None else lab.valid & (model.draft_index[lab.labels.clamp(min=0)] >= 0)
    if model.draft_index is not None:
        lab = lab._replace(weights=lab.weights * in_head)
    weight_sum = _weight_sum(lab, training_cfg, planes.device)
    context = concat_context(planes[:k], drafter_cfg.noise_std, generator)
    use_kl = training_cfg.kl_weight > 0
    return _Batch(planes, k, token_ids, seq_lens, doc, anchors, anchor_doc, lab, in_head, weight_sum, context, use_kl)


class _ChunkOut(NamedTuple):
    res: ChunkedLossResult
    rows: torch.Tensor  # the chunk's valid slots, flat
    labels: torch.Tensor  # their labels (target ids)
    part: BlockLabels
    num_queries: int


def _chunk_loss(model: DFlashDrafter, b: _Batch, s: int, e: int, training_cfg: TrainingConfig) -> _ChunkOut:
    """Anchors ``[s, e)``: block layout, masks, the drafter's forward, the chunked CE (+ KL) of their valid slots."""
    bs, mcfg = model.config.block_size, model.config
    part = BlockLabels(*(t[s:e] for t in b.lab))
    layout = build_block_layout(b.seq_lens, b.anchors[s:e], b.anchor_doc[s:e], bs, block_valid=part.valid.any(dim=1), doc=b.doc)
    masks = build_attention_masks(layout, mcfg.layer_types, mcfg.sliding_window, model.attention_backend(b.context.device))
    block_ids = model.block_input_ids(b.token_ids[b.anchors[s:e]])
    hidden = model(b.context, layout.context_position_ids, block_ids, layout.block_position_ids, masks)
    rows = part.valid.reshape(-1).nonzero().squeeze(1)
    labels = part.labels.reshape(-1)[rows]
    head_rows = b.in_head[s:e].reshape(-1)[rows]
    target_hidden = b.planes[b.k][part.label_pos.reshape(-1)[rows] - 1] if b.use_kl else None
    dpace = training_cfg.loss_weighting == "dpace"
    res = chunked_lm_loss(
        hidden[rows],
        model.lm_head_weight,
        labels if model.draft_index is None else model.draft_index[labels].clamp(min=0),
        part.weights.reshape(-1)[rows],
        training_cfg.ce_chunk_tokens,
        target_hidden=target_hidden,
        kl_weight=training_cfg.kl_weight,
        reweight=_dpace_reweight(part.valid, rows, training_cfg.dpace_alpha, head_rows) if dpace else None,
        compiled=training_cfg.ce_compile,
        # the e4m3 head serves the training step's GEMMs; a pass without a gradient keeps the bf16 logits
        fp8_head=model.fp8_head() if training_cfg.ce_fp8 and torch.is_grad_enabled() else None,
        frozen_head=mcfg.frozen_head,  # the target's logits are the finished ones (divided, soft-capped)
    )
    return _ChunkOut(res, rows, labels, part, layout.num_queries)


class _Tally:
    """The step's metrics, summed over anchor chunks."""

    def __init__(self, bs: int, dev: torch.device, per_block: bool):
        f32 = dict(dtype=torch.float32, device=dev)
        self.correct, self.count = torch.zeros(bs, **f32), torch.zeros(bs, **f32)
        self.ce_sum, self.kl_sum = torch.zeros((), **f32), torch.zeros((), **f32)
        self.accept_len_sum, self.accept_blocks = torch.zeros((), **f32), torch.zeros((), **f32)
        self.num_queries = 0
        self.block_accept: list[torch.Tensor] | None = [] if per_block else None

    def add(self, out: _ChunkOut, model: DFlashDrafter) -> None:
        res, rows, labels, part = out.res, out.rows, out.labels, out.part
        dev, bs = rows.device, model.config.block_size
        pred = res.pred if model.draft_token_ids is None else model.draft_token_ids[res.pred]
        slot = rows % bs
        self.correct.index_add_(0, slot, (pred == labels).to(torch.float32))
        self.count.index_add_(0, slot, torch.ones(rows.numel(), dtype=torch.float32, device=dev))
        hit = torch.zeros(part.valid.numel(), dtype=torch.bool, device=dev)
        hit[rows] = pred == labels
        counted = part.valid[:, 1]  # blocks whose first draft slot has a label (every sampled anchor's)
        lengths = block_acceptance_lengths(hit.view_as(part.valid), part.valid)
        self.accept_len_sum += (lengths * counted).sum().to(torch.float32)
        self.accept_blocks += counted.sum().to(torch.float32)
        if self.block_accept is not None:
            self.block_accept.append(lengths)
        self.ce_sum += res.ce_sum
        self.kl_sum += res.kl_sum
        self.num_queries += out.num_queries


def compute_loss(
    model: DFlashDrafter,
    views: SlotViews,
    drafter_cfg: DrafterConfig,
    training_cfg: TrainingConfig,
    generator: torch.Generator | None = None,
    accumulate: Callable[[torch.Tensor], None] | None = None,
    *,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    per_block: bool = False,
) -> LossOutput:
    """One DFlash training forward on a packed batch (module docstring has the semantics).

    ``views`` must already be on the drafter's device; ``generator`` (anchors, noise) too.

    Anchor micro-batching: with ``drafter_cfg.anchor_chunk > 0`` the batch's anchors (sampled
    once, as without chunks) run through the drafter ``anchor_chunk`` blocks at a time. Blocks
    never see each other and the loss is a weighted *sum*, so the chunks' loss sums add up to the
    whole batch's and the weight (``weight_sum``) stays the whole batch's. Every chunk but the
    last is handed to ``accumulate`` (``DrafterTrainer.accumulate``: backward now, graph freed)
    before the next is built, so one chunk's activations live at a time; the returned
    ``loss_sum`` is the last chunk's, for ``DrafterTrainer.step``. Without ``accumulate`` the
    chunks' loss sums are added (graphs kept: the same numbers, no memory saving).

    ``anchors``: ``(positions, document index)``, ascending, instead of sampled ones (held-out passes
    anchor at every valid position; the generator is then only used for noise). ``per_block``: also
    return each block's eval-rule acceptance length (``LossOutput.block_accept``).

    ``training.loss_weighting = "dpace"``: each block's slot weights are :func:`dpace_weights` of
    the drafter's own probabilities of its labels in this forward (detached, so the weights steer
    the gradient without receiving any). A block lies in one anchor chunk, so chunking cannot change
    them. ``weight_sum`` is then the number of blocks with a label (``dpace_normalizer = "blocks"``:
    the loss is the mean over blocks of the expected-accepted-length credit, as the paper's author
    asked of SpecForge) or the sum of the D-PACE weights (``"weights"``: SpecForge's first
    integration); either is a sum over blocks, so the trainer's all-reduce makes it the global one.
    """
    bs, dev = model.config.block_size, views.planes.device
    b = _prepare(model, views, drafter_cfg, training_cfg, generator, anchors)
    if b is None:
        return _empty_output(model, bs, dev)
    n_anchors = b.anchors.numel()
    chunk = drafter_cfg.anchor_chunk if drafter_cfg.anchor_chunk > 0 else n_anchors
    tally = _Tally(bs, dev, per_block)
    weight_sum = b.weight_sum
    kept: list[torch.Tensor] = []
    for s in range(0, n_anchors, chunk):
        e = min(n_anchors, s + chunk)
        out = _chunk_loss(model, b, s, e, training_cfg)
        if training_cfg.loss_weighting == "dpace" and training_cfg.dpace_normalizer == "weights":
            weight_sum = weight_sum + out.res.row_weights.sum()
        tally.add(out, model)
        if e < n_anchors and accumulate is not None:
            accumulate(out.res.loss_sum)
            del out
        else:
            kept.append(out.res.loss_sum)
    return LossOutput(
        loss_sum=kept[0] if len(kept) == 1 else torch.stack(kept).sum(),
        weight_sum=weight_sum,
        correct_per_pos=tally.correct,
        count_per_pos=tally.count,
        num_blocks=n_anchors,
        num_query_tokens=tally.num_queries,
        ce_sum=tally.ce_sum,
        kl_sum=tally.kl_sum,
        accept_len_sum=tally.accept_len_sum,
        accept_blocks=tally.accept_blocks,
        block_accept=torch.cat(tally.block_accept) if per_block else None,
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
