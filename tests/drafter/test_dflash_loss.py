"""DFlash objective: context layout, anchors, attention masks, labels/weights, chunked loss, metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5TextConfig

from dflash_ipc.config import DrafterConfig, TrainingConfig
from dflash_ipc.drafter.loss import blocks as B
from dflash_ipc.drafter.loss import masks as M
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.transport.slots import SlotViews

H, V = 64, 300


def tiny_model(layer_types, *, block_size=4, window=6, num_anchors=8, k=3, seed=0, noise_std=0.0):
    torch.manual_seed(seed)
    target = Qwen3_5TextConfig(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        num_hidden_layers=8,
        intermediate_size=128,
    )
    dc = DrafterConfig(
        num_layers=len(layer_types),
        layer_types=list(layer_types),
        block_size=block_size,
        sliding_window=window,
        num_anchors=num_anchors,
        noise_std=noise_std,
        attention="sdpa",
    )
    cfg = DrafterModelConfig.from_configs(dc, target, list(range(k)), V - 1)
    g = torch.Generator().manual_seed(seed + 1)
    model = DFlashDrafter(cfg, torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.1, "sdpa")
    return model, dc


def packed_views(seq_lens, *, planes=3, loss_mask=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    n = int(seq.sum())
    lm = torch.ones(n, dtype=torch.uint8) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.uint8)
    return SlotViews(
        planes=torch.randn(planes, n, H, generator=g),
        token_ids=torch.randint(0, V - 1, (n,), generator=g),
        loss_mask=lm,
        seq_lens=seq,
    )


def split_by_documents(full: SlotViews, seq_lens: list[int], docs: int) -> list[SlotViews]:
    """``full`` (documents of ``seq_lens`` packed) as two batches: its first ``docs`` documents, and the rest."""
    cut = sum(seq_lens[:docs])

    def part(lo, hi, seq):
        return SlotViews(
            planes=full.planes[:, lo:hi],
            token_ids=full.token_ids[lo:hi],
            loss_mask=full.loss_mask[lo:hi],
            seq_lens=torch.tensor(seq, dtype=torch.int32),
        )

    return [part(0, cut, seq_lens[:docs]), part(cut, sum(seq_lens), seq_lens[docs:])]


# --------------------------------------------------------------------------- context


def test_concat_context_layout_is_layer_major():
    planes = torch.arange(3 * 5 * 4, dtype=torch.float32).view(3, 5, 4)
    ctx = L.concat_context(planes, 0.0)
    assert ctx.shape == (5, 12)
    for i in range(5):
        for j in range(3):
            assert torch.equal(ctx[i, 4 * j : 4 * (j + 1)], planes[j, i])
    ctx[0, 0] = -1.0
    assert planes[0, 0, 0] == 0.0  # a fresh tensor, never a view of the slot


def test_concat_context_noise():
    planes = torch.zeros(2, 4000, 8)
    a = L.concat_context(planes, 0.5, torch.Generator().manual_seed(3))
    b = L.concat_context(planes, 0.5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert abs(a.std().item() - 0.5) < 0.01 and abs(a.mean().item()) < 0.01
    assert torch.equal(L.concat_context(planes, 0.0), torch.zeros(4000, 16))


def test_document_index_positions_restart():
    doc = B.document_index(torch.tensor([3, 0, 2], dtype=torch.int32), 5)
    assert doc.doc_of_token.tolist() == [0, 0, 0, 2, 2]
    assert doc.position_ids.tolist() == [0, 1, 2, 0, 1]
    assert doc.doc_start.tolist() == [0, 3, 3] and doc.doc_end.tolist() == [3, 3, 5]
    with pytest.raises(ValueError):
        B.document_index(torch.tensor([3, 3]), 5)


# --------------------------------------------------------------------------- anchors


def test_anchor_candidates_hand_built():
    # docs [0..5] [6..9] [10..11]; loss_mask per token:
    lm = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.uint8)
    seq = torch.tensor([6, 4, 2])
    valid = B.valid_anchor_mask(lm, seq)
    # 1: lm[1]&lm[2]; 4: lm[4]&lm[5]; 5: next (6) is another document; 6: lm[6]&lm[7];
    # 7: lm[8]=0; 9: lm[9]&lm[10] but 10 is another document; 10: lm[10]&lm[11]; 11: end.
    assert valid.nonzero().squeeze(1).tolist() == [1, 4, 6, 10]
    anchors, doc = B.sample_anchors(lm, seq, 100, 4, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [1, 4, 6, 10] and doc.tolist() == [0, 0, 1, 2]


def test_anchor_budget_is_per_document_and_uniform():
    seq = torch.tensor([40, 5, 30, 3])
    n = int(seq.sum())
    lm = torch.ones(n, dtype=torch.uint8)
    lm[50:60] = 0
    valid = B.valid_anchor_mask(lm, seq)
    doc = B.document_index(seq, n)
    per_doc_valid = torch.zeros(4, dtype=torch.int64).index_add_(0, doc.doc_of_token, valid.long())
    assert per_doc_valid.tolist() == [39, 4, 18, 2]  # doc 2: 45..48 and 60..73
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(n)
    for _ in range(200):
        anchors, adoc = B.sample_anchors(lm, seq, 6, 16, g)
        assert torch.all(anchors[1:] > anchors[:-1])  # sorted, distinct
        assert valid[anchors].all()
        assert torch.equal(adoc, doc.doc_of_token[anchors])
        counts = torch.bincount(adoc, minlength=4)
        assert counts.tolist() == [6, 4, 6, 2]  # min(budget, candidates) in every document
        hits[anchors] += 1
    # Uniform without replacement: each candidate of doc 0 is drawn with p = 6/39.
    d0 = hits[:39]
    assert (d0 > 0).all() and abs(d0.mean().item() / 200 - 6 / 39) < 1e-6
    assert d0.max().item() / 200 < 0.3 and d0.min().item() / 200 > 0.05
    assert hits[~valid].sum() == 0


def test_sample_anchors_reproducible_with_generator():
    lm = torch.ones(64, dtype=torch.uint8)
    seq = torch.tensor([64])
    a = B.sample_anchors(lm, seq, 5, 4, torch.Generator().manual_seed(9))[0]
    b = B.sample_anchors(lm, seq, 5, 4, torch.Generator().manual_seed(9))[0]
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- masks


def reference_mask(seq_lens, anchors, bs, layer_type, window, valid):
    """Independent loop implementation of the spec, for cross-checking."""
    n = sum(seq_lens)
    doc_of = []
    for d, s in enumerate(seq_lens):
        doc_of += [d] * s
    nq = len(anchors) * bs
    m = torch.zeros(nq, n + nq, dtype=torch.bool)
    for j, a in enumerate(anchors):
        if not valid[j]:
            continue
        for s in range(bs):
            q, p = j * bs + s, a + s
            for c in range(n):
                if doc_of[c] == doc_of[a] and c < a and (layer_type == "full_attention" or p - c < window):
                    m[q, c] = True
            for s2 in range(bs):
                if layer_type == "full_attention" or (s2 <= s and s - s2 < window):
                    m[q, n + j * bs + s2] = True
    return m


def layout_for(seq_lens, anchors, bs, valid=None):
    seq = torch.tensor(seq_lens)
    n = sum(seq_lens)
    a = torch.tensor(anchors)
    doc = B.document_index(seq, n)
    bv = None if valid is None else torch.tensor(valid)
    return B.build_block_layout(seq, a, doc.doc_of_token[a], bs, bv, n=n)


def test_mask_semantics_hand_built():
    # Two documents [0..5] [6..9]; block size 3; anchors 2 and 4 (doc 0) and 7 (doc 1).
    lay = layout_for([6, 4], [2, 4, 7], 3)
    n = 10
    full = M.dense_attention_mask(lay, "full_attention", 2048)
    slide = M.dense_attention_mask(lay, "sliding_attention", 3)
    # Block 0 (anchor 2): context 0,1 only -- not 2 itself (strict), not later, not doc 1.
    assert full[0, :n].nonzero().squeeze(1).tolist() == [0, 1]
    # Full layers: the whole own block, every slot, nothing of the other blocks.
    assert full[0, n:].tolist() == [True, True, True, False, False, False, False, False, False]
    assert full[2, n:].tolist() == [True, True, True, False, False, False, False, False, False]
    # Block 2 (anchor 7, doc 1 starts at 6): context 6 only.
    assert full[6, :n].nonzero().squeeze(1).tolist() == [6]
    # Sliding (window 3): slot s of block 1 (anchor 4) at position 4+s sees context > 4+s-3.
    assert slide[3, :n].nonzero().squeeze(1).tolist() == [2, 3]  # pos 4
    assert slide[4, :n].nonzero().squeeze(1).tolist() == [3]  # pos 5
    assert slide[5, :n].nonzero().squeeze(1).tolist() == []  # pos 6: window covers 4..6, all >= anchor
    # ... and its own block causally.
    assert slide[3, n:].tolist() == [False, False, False, True, False, False, False, False, False]
    assert slide[5, n:].tolist() == [False, False, False, True, True, True, False, False, False]
    for lt, w, m in (("full_attention", 2048, full), ("sliding_attention", 3, slide)):
        assert torch.equal(m, reference_mask([6, 4], [2, 4, 7], 3, lt, w, [True] * 3))


def test_mask_window_inside_block_and_invalid_blocks():
    lay = layout_for([20, 12], [3, 9, 10, 21, 25], 5, valid=[True, False, True, True, True])
    for lt, w in (("full_attention", 2048), ("sliding_attention", 2), ("sliding_attention", 7)):
        m = M.dense_attention_mask(lay, lt, w)
        assert torch.equal(m, reference_mask([20, 12], [3, 9, 10, 21, 25], 5, lt, w, [1, 0, 1, 1, 1]))
        assert not m[5:10].any()  # the invalid block sees nothing
        assert not m[:, 32 + 5 : 32 + 10].any()  # ... and nobody sees it


def block_mask_tiles(bm):
    """(partial, full) bool [q_tiles, kv_tiles] from a BlockMask's index lists."""

    def dense(num, idx):
        num, idx = num[0, 0], idx[0, 0]
        out = torch.zeros(idx.shape, dtype=torch.bool)
        for t in range(num.numel()):
            out[t, idx[t, : num[t]].long()] = True
        return out

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    return dense(bm.kv_num_blocks, bm.kv_indices), full


@pytest.mark.parametrize("tile", [4, (8, 4), 16])
def test_flex_block_mask_tiles_cover_mask_exactly(tile):
    """Every visible (q, kv) lies in a listed tile; every 'full' tile is entirely visible."""
    g = torch.Generator().manual_seed(1)
    seq = [37, 9, 50]
    lm = torch.ones(96, dtype=torch.uint8)
    anchors, _ = B.sample_anchors(lm, torch.tensor(seq), 12, 4, g)
    lay = layout_for(seq, anchors.tolist(), 4, valid=(torch.rand(anchors.numel(), generator=g) > 0.2).tolist())
    qb, kb = (tile, tile) if isinstance(tile, int) else tile
    saw_full = False
    for lt, w in (("full_attention", 2048), ("sliding_attention", 9)):
        dense = M.dense_attention_mask(lay, lt, w)
        bm = M.flex_block_mask(lay, lt, w, tile)
        partial, full = block_mask_tiles(bm)
        assert not (partial & full).any()
        tq, tkv = partial.shape
        pad = torch.zeros(tq * qb, tkv * kb, dtype=torch.bool)
        pad[: dense.shape[0], : dense.shape[1]] = dense
        occupied = pad.view(tq, qb, tkv, kb).any(dim=3).any(dim=1)
        assert not (occupied & ~(partial | full)).any()
        all_true = pad.view(tq, qb, tkv, kb).all(dim=3).all(dim=1)
        assert not (full & ~all_true).any()
        saw_full |= bool(full.any())
        # mask_mod reproduces the dense rule on the real index range.
        q = torch.arange(dense.shape[0])[:, None]
        kv = torch.arange(dense.shape[1])[None, :]
        assert torch.equal(bm.mask_mod(0, 0, q, kv), dense)
    assert saw_full or tile == 16


# --------------------------------------------------------------------------- labels & weights


def test_block_labels_worked_example():
    # One document of 8 tokens, loss_mask 0 at position 5; anchors 1 and 5; block size 4; gamma 2.
    tokens = torch.arange(100, 108)
    lm = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.uint8)
    anchors = torch.tensor([1, 5])
    lab = B.block_labels(tokens, lm, anchors, torch.tensor([8, 8]), 4, gamma=2.0)
    # block 0: slots predict positions 2,3,4 (all supervised): weights 1, e^-1/2, e^-1
    # block 1: slots predict 6, 7 (supervised) and 8 (outside the document)
    e = math.exp
    expected = torch.tensor([[0, 1, e(-0.5), e(-1.0)], [0, 1, e(-0.5), 0]], dtype=torch.float32)
    torch.testing.assert_close(lab.weights, expected)
    assert lab.valid.tolist() == [[False, True, True, True], [False, True, True, False]]
    assert lab.labels[0, 1:].tolist() == [102, 103, 104] and lab.labels[1, 1:3].tolist() == [106, 107]
    # Unsupervised label inside the block: anchor 3 predicts 4 (ok), 5 (loss_mask 0), 6 (ok).
    lab2 = B.block_labels(tokens, lm, torch.tensor([3]), torch.tensor([8]), 4, gamma=2.0)
    torch.testing.assert_close(lab2.weights, torch.tensor([[0, 1, 0, e(-1.0)]]))


# --------------------------------------------------------------------------- chunked loss


def reference_loss(hidden, w_head, labels, weights, target_hidden=None, kl_weight=0.0):
    logits = (hidden @ w_head.T).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    total = (ce * weights).sum()
    if target_hidden is not None:  # the teacher distribution is a constant
        t_logp = F.log_softmax((target_hidden @ w_head.T).float().detach(), -1)
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, -1))).sum(-1)
        total = total + kl_weight * (kl * weights).sum()
    return total


def loss_case(seed: int, rows: int, hidden: int, vocab: int, with_kl: bool):
    """Random hidden states, head, labels, row weights and (with KL) the target's hidden states of one loss case."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, hidden, generator=g)
    w_head = torch.randn(vocab, hidden, generator=g)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.rand(rows, generator=g)
    th = torch.randn(rows, hidden, generator=g) if with_kl else None
    return base, w_head, labels, weights, th


@pytest.mark.parametrize("with_kl", [False, True])
def test_chunked_loss_matches_unchunked_values_and_gradients(with_kl):
    base, w_head, labels, weights, th = loss_case(0, 37, 16, 50, with_kl)
    kl_w = 0.7 if with_kl else 0.0

    ref_h = base.clone().requires_grad_(True)
    ref_w = w_head.clone().requires_grad_(True)
    ref = reference_loss(ref_h, ref_w, labels, weights, th, kl_w)
    ref.backward()
    for chunk in (1, 7, 16, 1000):
        hh = base.clone().requires_grad_(True)
        ww = w_head.clone().requires_grad_(True)
        res = L.chunked_lm_loss(hh, ww, labels, weights, chunk, target_hidden=th, kl_weight=kl_w)
        res.loss_sum.backward()
        torch.testing.assert_close(res.loss_sum, ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(hh.grad, ref_h.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ww.grad, ref_w.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.ce_sum + kl_w * res.kl_sum, ref.detach(), rtol=1e-5, atol=1e-4)
        assert torch.equal(res.pred, (base @ w_head.T).argmax(-1))


def test_chunked_loss_frozen_head_gets_no_grad():
    hidden = torch.randn(5, 8, requires_grad=True)
    head = torch.randn(11, 8)  # requires_grad False, like the target's LM head
    res = L.chunked_lm_loss(hidden, head, torch.arange(5), torch.ones(5), 2)
    res.loss_sum.backward()
    assert hidden.grad is not None and head.grad is None


# --------------------------------------------------------------------------- compute_loss


def manual_loss(model, views, anchors, gamma, kl_weight=0.0, weights_of=None):
    """Recompute compute_loss's numbers for given anchors with plain (unchunked) ops.

    ``weights_of(ce [N, bs], valid [N, bs])``: the slot weights instead of block_labels' decay."""
    bs = model.config.block_size
    k = model.config.num_context_planes
    n = views.token_ids.numel()
    doc = B.document_index(views.seq_lens, n)
    adoc = doc.doc_of_token[anchors]
    lab = B.block_labels(views.token_ids, views.loss_mask, anchors, doc.doc_end[adoc], bs, gamma)
    lay = B.build_block_layout(views.seq_lens, anchors, adoc, bs, lab.valid.any(1), n=n)
    masks = M.build_attention_masks(lay, model.config.layer_types, model.config.sliding_window, "sdpa")
    hidden = model(
        L.concat_context(views.planes[:k]),
        lay.context_position_ids,
        model.block_input_ids(views.token_ids[anchors]),
        lay.block_position_ids,
        masks,
    )
    logits = model.compute_logits(hidden).float().view(len(anchors), bs, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.labels.reshape(-1), reduction="none")
    if weights_of is not None:
        lab = lab._replace(weights=weights_of(ce.view_as(lab.valid), lab.valid))
    total = (ce * lab.weights.reshape(-1)).sum()
    if kl_weight:
        th = views.planes[k][(lab.label_pos - 1).clamp(min=0)]
        t_logp = F.log_softmax(model.compute_logits(th).float(), -1)
        kl = (t_logp.exp() * (t_logp - F.log_softmax(logits, -1))).sum(-1)
        total = total + kl_weight * (kl * lab.weights).sum()
    correct = ((logits.argmax(-1) == lab.labels) & lab.valid).float().sum(0)
    return total, lab.weights.sum(), correct, lab.valid.float().sum(0)


def test_compute_loss_worked_example():
    model, dc = tiny_model(["sliding_attention", "full_attention"], block_size=4, num_anchors=3)
    lm = [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] + [1, 1, 1, 0, 1, 1, 1, 1] + [0, 1, 1, 1, 1, 1]
    views = packed_views([12, 8, 6], loss_mask=lm)
    tc = TrainingConfig(loss_gamma=7.0, ce_chunk_tokens=16)
    out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(5))
    anchors, adoc = B.sample_anchors(views.loss_mask, views.seq_lens, 3, 4, torch.Generator().manual_seed(5))
    assert torch.bincount(adoc).tolist() == [3, 3, 3]
    assert out.num_blocks == 9 and out.num_query_tokens == 36
    total, wsum, correct, count = manual_loss(model, views, anchors, 7.0)
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.weight_sum, wsum)
    assert torch.equal(out.count_per_pos, count) and torch.equal(out.correct_per_pos, correct)
    assert out.count_per_pos[0] == 0 and out.kl_sum == 0
    # Hand check of the weights for the last document: tokens 20..25, loss_mask [0,1,1,1,1,1],
    # candidates 21..24 (25 has no successor in the document) -> 3 of 4 are drawn.
    assert set(anchors[adoc == 2].tolist()) <= {21, 22, 23, 24}
    a = anchors[adoc == 2]
    exp_w = sum(math.exp(-(s - 1) / 7.0) for ai in a.tolist() for s in range(1, 4) if ai + s <= 25)
    lab = B.block_labels(views.token_ids, views.loss_mask, a, torch.full_like(a, 26), 4, 7.0)
    assert abs(lab.weights.sum().item() - exp_w) < 1e-5
    out.loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.trainable_parameters())


def test_compute_loss_chunking_does_not_change_result():
    model, dc = tiny_model(["sliding_attention", "full_attention"])
    views = packed_views([15, 17])
    outs = []
    for chunk in (16, 4096):
        model.zero_grad()
        out = L.compute_loss(model, views, dc, TrainingConfig(ce_chunk_tokens=chunk), torch.Generator().manual_seed(2))
        out.loss_sum.backward()
        outs.append((out.loss_sum.detach(), model.fc.weight.grad.clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-6)


def test_compute_loss_kl_term_alignment():
    model, dc = tiny_model(["full_attention"], block_size=4, num_anchors=4)
    views = packed_views([14, 10], planes=4)  # 3 context planes + the target's last hidden state
    tc = TrainingConfig(kl_weight=0.5)
    out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(0))
    anchors, _ = B.sample_anchors(views.loss_mask, views.seq_lens, 4, 4, torch.Generator().manual_seed(0))
    total, _, _, _ = manual_loss(model, views, anchors, tc.loss_gamma, kl_weight=0.5)
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-4)
    assert out.kl_sum > 0
    torch.testing.assert_close(out.loss_sum.detach(), out.ce_sum + 0.5 * out.kl_sum, rtol=1e-6, atol=1e-5)
    # The extra plane is ignored without KL; demanded with it.
    no_kl = L.compute_loss(model, views, dc, TrainingConfig(), torch.Generator().manual_seed(0))
    torch.testing.assert_close(no_kl.loss_sum, out.ce_sum)
    with pytest.raises(ValueError, match="last hidden"):
        L.compute_loss(model, packed_views([14, 10], planes=3), dc, tc)


def test_compute_loss_nothing_to_learn():
    model, dc = tiny_model(["full_attention"])
    views = packed_views([6, 6], loss_mask=[0, 1, 0, 1, 0, 1] * 2)  # never two supervised in a row
    out = L.compute_loss(model, views, dc, TrainingConfig())
    assert out.num_blocks == 0 and out.weight_sum == 0 and out.count_per_pos.sum() == 0
    out.loss_sum.backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in model.trainable_parameters())


def test_compute_loss_noise_uses_generator():
    model, dc = tiny_model(["full_attention"], noise_std=0.5)
    views = packed_views([20])
    a = L.compute_loss(model, views, dc, TrainingConfig(), torch.Generator().manual_seed(4)).loss_sum
    b = L.compute_loss(model, views, dc, TrainingConfig(), torch.Generator().manual_seed(4)).loss_sum
    assert torch.equal(a, b)


def test_tiny_model_loss_decreases():
    model, dc = tiny_model(["sliding_attention", "full_attention"], block_size=4, num_anchors=6)
    views = packed_views([24, 16])
    tc = TrainingConfig()
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    losses, acc = [], []
    for step in range(30):
        out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(step % 3))
        loss = out.loss_sum / out.weight_sum
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        acc.append((out.correct_per_pos.sum() / out.count_per_pos.sum()).item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert max(acc[-3:]) > acc[0]


# --------------------------------------------------------------------------- metrics


def test_expected_acceptance_length():
    assert L.expected_acceptance_length([0.3, 1.0, 0.5, 0.5]) == pytest.approx(1 + 1 + 0.5 + 0.25)
    assert L.expected_acceptance_length(torch.tensor([0.0, 0.0, 1.0])) == pytest.approx(1.0)
    assert L.expected_acceptance_length([0.0] + [1.0] * 15) == pytest.approx(16.0)
    assert L.expected_acceptance_length([0.0, 0.5, float("nan"), 1.0]) == pytest.approx(1.5)
    acc = L.accuracy_per_pos(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 4.0, 4.0]))
    assert acc.tolist() == [0.0, 0.75, 0.25]


# --------------------------------------------------------------------------- CUDA (flex compiled)


@pytest.mark.gpu  # compiled flex_attention
def test_cuda_flex_matches_sdpa_loss_and_gradients():
    """On GPU the compiled flex kernel honours the analytic tile lists: same loss and gradients as SDPA."""
    dev = torch.device("cuda")
    cfg = DrafterModelConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=48,
        block_size=16,
        vocab_size=512,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=4096,
        target_layer_ids=[1, 2],
        mask_token_id=511,
    )
    dc = DrafterConfig(num_layers=3, layer_types=cfg.layer_types, sliding_window=48, block_size=16, num_anchors=24)
    g = torch.Generator().manual_seed(0)
    emb, head = torch.randn(512, 128, generator=g) * 0.5, torch.randn(512, 128, generator=g) * 0.05
    models = {b: DFlashDrafter(cfg, emb, head, attention=b).to(dev) for b in ("flex", "sdpa")}
    models["sdpa"].load_state_dict(models["flex"].state_dict())
    tc = TrainingConfig(ce_chunk_tokens=512)
    for seq_lens in ([700, 300, 1100, 200], [1500, 77, 900]):
        views = packed_views(seq_lens, planes=2)
        parts = (views.planes.repeat(1, 1, 2), views.token_ids, views.loss_mask, views.seq_lens)
        views = SlotViews(*(t.to(dev) for t in parts))
        results = {}
        for b, m in models.items():
            m.zero_grad()
            out = L.compute_loss(m, views, dc, tc, torch.Generator(dev).manual_seed(1))
            out.loss_sum.backward()
            results[b] = (out, {k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad})
        (of, gf), (os_, gs) = results["flex"], results["sdpa"]
        assert of.num_blocks == os_.num_blocks > 0
        torch.testing.assert_close(of.loss_sum, os_.loss_sum, rtol=1e-4, atol=1e-3)
        for k in gf:
            torch.testing.assert_close(gf[k], gs[k], rtol=2e-3, atol=2e-4, msg=k)
    m = models["flex"].to(torch.bfloat16)
    m.zero_grad()
    out = L.compute_loss(m, views, dc, tc, torch.Generator(dev).manual_seed(2))
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and all(torch.isfinite(p.grad).all() for p in m.trainable_parameters())


def test_max_anchors_per_batch_caps_a_batch_of_many_short_documents():
    from dflash_ipc.drafter.loss.blocks import sample_anchors

    seq_lens = torch.tensor([20] * 30, dtype=torch.int32)
    loss_mask = torch.ones(600, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    full, doc_full = sample_anchors(loss_mask, seq_lens, 8, 4, g)
    assert full.numel() == 30 * 8
    g = torch.Generator().manual_seed(0)
    capped, doc = sample_anchors(loss_mask, seq_lens, 8, 4, g, max_per_batch=50)
    assert capped.numel() == 50
    assert torch.all(capped[1:] > capped[:-1])  # sorted, distinct
    assert set(capped.tolist()) <= set(full.tolist())  # a subset of the per-document draw
    assert torch.equal(doc, capped // 20)


def test_a_batch_split_by_documents_gives_the_same_token_weighted_gradient():
    """What data parallelism relies on: a packed batch split into two halves (by document) on
    two drafters gives, after the token-weighted reduction (sum of loss sums / sum of weights),
    exactly the gradient of the whole batch on one drafter. It holds because a block never sees
    another document and the loss is a weighted sum, not a per-batch mean."""
    model, dc = tiny_model(["sliding_attention", "full_attention"], num_anchors=64)
    tc = TrainingConfig()
    lens = [9, 14, 7, 12]
    full = packed_views(lens, seed=3)

    def grads(parts):
        model.zero_grad()
        outs = [L.compute_loss(model, v, dc, tc) for v in parts]  # num_anchors >= candidates: no sampling noise
        weight = sum(o.weight_sum for o in outs)
        (sum(o.loss_sum for o in outs) / weight).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, outs

    g_full, (o_full,) = grads([full])
    g_split, (o_a, o_b) = grads(split_by_documents(full, lens, 2))
    assert o_a.weight_sum != o_b.weight_sum  # unequal halves: a plain mean of means would differ
    torch.testing.assert_close(o_a.weight_sum + o_b.weight_sum, o_full.weight_sum)
    assert g_full.keys() == g_split.keys() and g_full
    for n in g_full:
        torch.testing.assert_close(g_split[n], g_full[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("dpace", [False, True])
def test_frozen_head_gradient_taken_in_forward_matches_reference(with_kl, dpace):
    """The frozen head's path (each chunk's gradient taken while its logits exist, scaled by the row weights in
    backward) against plain autograd through the whole logits, also when the row weights come after the last
    chunk (D-PACE) and with the KL term."""
    base, w_head, labels, weights, th = loss_case(1, 41, 16, 60, with_kl)
    kl_w = 0.4 if with_kl else 0.0

    def reweight(ce):
        return torch.exp(-ce) + 0.5  # depends on the draft's own CE, a constant to the gradient

    ref_h = base.clone().requires_grad_(True)
    ref_weights = reweight(F.cross_entropy(base @ w_head.T, labels, reduction="none")) if dpace else weights
    ref = reference_loss(ref_h, w_head, labels, ref_weights, th, kl_w)
    (ref * 3.0).backward()  # a scale on the loss reaches the gradient
    for chunk in (1, 9, 1000):
        hh = base.clone().requires_grad_(True)
        res = L.chunked_lm_loss(hh, w_head, labels, weights, chunk, target_hidden=th, kl_weight=kl_w, reweight=reweight if dpace else None)
        (res.loss_sum * 3.0).backward()
        torch.testing.assert_close(res.loss_sum, ref.detach(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(hh.grad, ref_h.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.row_weights, ref_weights.float(), rtol=1e-6, atol=1e-6)


def test_frozen_head_bf16_gradient_within_rounding_of_fp32():
    """bf16 hidden and head, the frozen path: the gradient within bf16 rounding of the fp32 reference."""
    g = torch.Generator().manual_seed(2)
    r, h, v = 64, 32, 500
    base = torch.randn(r, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (r,), generator=g)
    weights = torch.rand(r, generator=g)
    ref_h = base.clone().requires_grad_(True)
    reference_loss(ref_h, w_head, labels, weights, None, 0.0).backward()
    hh = base.to(torch.bfloat16).requires_grad_(True)
    L.chunked_lm_loss(hh, w_head.to(torch.bfloat16), labels, weights, 16).loss_sum.backward()
    assert hh.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hh.grad.float(), ref_h.grad, rtol=0.05, atol=0.02)


def test_no_gradient_wanted_builds_no_graph():
    hidden = torch.randn(6, 8, requires_grad=True)
    with torch.no_grad():
        res = L.chunked_lm_loss(hidden, torch.randn(11, 8), torch.arange(6), torch.ones(6), 4)
    assert res.loss_sum.grad_fn is None
