"""Training-time tau by eval's rule: joint prefix acceptance per block, not a product of marginals."""

from __future__ import annotations

import pytest
import torch
from test_dflash_loss import manual_loss, packed_views, tiny_model

from dflash_ipc.config import TrainingConfig
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.transport.slots import SlotViews


def _hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1) == labels


def test_joint_prefix_differs_from_marginal_product():
    # Block size 4, vocabulary 5. Slot 0 is the anchor (no label). Block A: slots 1,2 right, 3 wrong.
    # Block B: slot 1 wrong, slots 2,3 right -- hits eval never reaches.
    vocab = 5
    labels = torch.tensor([[0, 1, 2, 3], [0, 4, 4, 4]])
    drafted = torch.tensor([[0, 1, 2, 0], [0, 3, 4, 4]])
    logits = torch.nn.functional.one_hot(drafted, vocab).float() * 5.0
    valid = torch.tensor([[False, True, True, True]] * 2)
    hit = _hits(logits, labels)
    lengths = L.block_acceptance_lengths(hit, valid)
    assert lengths.tolist() == [3, 1]  # A: 1 + 2 accepted; B: bonus only
    joint_tau = lengths.float().mean().item()
    acc = ((hit & valid).float().sum(0) / valid.float().sum(0).clamp(min=1)).tolist()
    assert acc[1:] == [0.5, 1.0, 0.5]
    marginal_tau = L.expected_acceptance_length(acc)
    assert joint_tau == pytest.approx(2.0)
    assert marginal_tau == pytest.approx(1 + 0.5 + 0.5 + 0.25)
    assert joint_tau != pytest.approx(marginal_tau)


def test_whole_blocks_right_or_wrong():
    # Marginals 0.5 everywhere predict 1 + .5 + .25 + .125; joint acceptance gives (4 + 1) / 2.
    hit = torch.tensor([[False, True, True, True], [False, False, False, False]])
    valid = torch.tensor([[False, True, True, True]] * 2)
    assert L.block_acceptance_lengths(hit, valid).tolist() == [4, 1]
    assert L.expected_acceptance_length([0, 0.5, 0.5, 0.5]) == pytest.approx(1.875)


def test_invalid_slot_ends_the_prefix_and_anchor_is_ignored():
    hit = torch.tensor([[False, True, True, True], [True, True, False, True], [True, True, True, True]])
    valid = torch.tensor([[True, True, False, True], [True, True, True, True], [False, True, True, True]])
    assert L.block_acceptance_lengths(hit, valid).tolist() == [2, 2, 4]
    with pytest.raises(ValueError, match="block_size"):
        L.block_acceptance_lengths(hit[:, :3], valid)


def test_compute_loss_reports_eval_rule_acceptance():
    model, dc = tiny_model(["sliding_attention", "full_attention"], block_size=4, num_anchors=3)
    lm = [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] + [1, 1, 1, 0, 1, 1, 1, 1] + [0, 1, 1, 1, 1, 1]
    views = packed_views([12, 8, 6], loss_mask=lm)
    tc = TrainingConfig(loss_gamma=7.0, ce_chunk_tokens=16)
    anchors, adoc = L.sample_anchors(views.loss_mask, views.seq_lens, 3, 4, torch.Generator().manual_seed(5))
    doc = L.document_index(views.seq_lens)
    lab = L.block_labels(views.token_ids, views.loss_mask, anchors, doc.doc_end[adoc], 4, 7.0)
    lay = L.build_block_layout(views.seq_lens, anchors, adoc, 4, lab.valid.any(1))
    masks = L.build_attention_masks(lay, model.config.layer_types, model.config.sliding_window, "sdpa")

    def predict(token_ids: torch.Tensor) -> torch.Tensor:
        """The model's argmax per block slot on these anchors."""
        with torch.no_grad():
            hidden = model(
                L.concat_context(views.planes[:3]),
                lay.context_position_ids,
                model.block_input_ids(token_ids[anchors]),
                lay.block_position_ids,
                masks,
            )
            return model.compute_logits(hidden).float().argmax(-1).view(len(anchors), 4)

    pred = predict(views.token_ids)
    # A random drafter hits almost nothing: write its own argmax into the labels of the first
    # `keep` slots of block j, so the batch has prefixes of several lengths (anchor tokens that
    # change move the predictions; the recount below reads them again).
    token_ids = views.token_ids.clone()
    for j, a in enumerate(anchors.tolist()):
        keep = j % 4
        for s in range(1, keep + 1):
            if lab.valid[j, s]:
                token_ids[a + s] = pred[j, s]
    views = SlotViews(planes=views.planes, token_ids=token_ids, loss_mask=views.loss_mask, seq_lens=views.seq_lens)
    out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(5))
    _, _, correct, count = manual_loss(model, views, anchors, 7.0)
    # Recount by hand from the model's logits on the same anchors.
    lab = L.block_labels(views.token_ids, views.loss_mask, anchors, doc.doc_end[adoc], 4, 7.0)
    pred = predict(views.token_ids)
    expected = []
    for j in range(len(anchors)):
        if not lab.valid[j, 1]:
            continue
        n = 1
        for s in range(1, 4):
            if not (lab.valid[j, s] and pred[j, s] == lab.labels[j, s]):
                break
            n += 1
        expected.append(n)
    assert len(set(expected)) > 1  # the case exercises several prefix lengths
    assert out.accept_blocks.item() == len(expected)
    assert out.accept_len_sum.item() == sum(expected)
    assert torch.equal(out.correct_per_pos, correct) and torch.equal(out.count_per_pos, count)
