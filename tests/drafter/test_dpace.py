"""D-PACE loss weighting (``training.loss_weighting = "dpace"``, arXiv 2605.18810).

Slot weights from the drafter's own probability of each label: the definition on hand-made blocks
and as the derivative of the expected accepted length; compute_loss against a plain recomputation
(weights and normalisers); stop-gradient; anchor chunks and two gloo ranks equal one forward on one
rank (tests/drafter/test_anchor_chunks.py, over every weighting); the default ("decay") path untouched by
the new keys; the config refusing bad values.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_anchor_chunks import DPACE, DPACE_W, LAYERS, LENS, TC, chunked
from test_dflash_loss import manual_loss, packed_views, tiny_model

from dflash_ipc.config import ConfigError, TrainingConfig, config_from_dict
from dflash_ipc.drafter.loss import blocks as B
from dflash_ipc.drafter.loss import objective as L


def loop_dpace(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """The definition, slot by slot: w_s = sum over valid m >= s of prod_{i <= m} q~_i (q~ = 1 off-label)."""
    w = torch.zeros(valid.shape, dtype=torch.float64)
    for j in range(valid.shape[0]):
        for s in range(valid.shape[1]):
            if not valid[j, s]:
                continue
            for m in range(s, valid.shape[1]):
                if valid[j, m]:
                    w[j, s] += math.prod((1 - alpha) * float(confidence[j, i]) + alpha if valid[j, i] else 1.0 for i in range(m + 1))
    return w


def test_dpace_weights_hand_made_blocks():
    # Block 0: every draft slot labelled; block 1: slot 2 unsupervised (passes through);
    # block 2: the document ends after slot 1. Slot 0 is the anchor (never labelled).
    q = torch.tensor([[0.9, 0.6, 0.2, 1.0], [0.9, 0.2, 0.7, 0.6], [0.3, 0.0, 0.5, 0.5]])
    valid = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 1], [0, 1, 0, 0]], dtype=torch.bool)
    w = L.dpace_weights(q, valid, alpha=0.5)
    # q~ = 0.8, 0.6, 1.0 -> reach 0.8, 0.48, 0.48 -> suffix sums 1.76, 0.96, 0.48
    # q~ = 0.6, (1), 0.8 -> reach 0.6, -, 0.48 -> 1.08, 0, 0.48;  q~ = 0.5 -> 0.5
    expected = torch.tensor([[0, 1.76, 0.96, 0.48], [0, 1.08, 0, 0.48], [0, 0.5, 0, 0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.double(), loop_dpace(q, valid, 0.5), rtol=0, atol=1e-6)
    # alpha = 1: confidence no longer matters; slot s weighs the number of labelled slots from s on
    ones = L.dpace_weights(torch.rand(3, 4), valid, alpha=1.0)
    assert torch.equal(ones, torch.tensor([[0, 3.0, 2, 1], [0, 2, 0, 1], [0, 1, 0, 0]]))


def test_dpace_weights_are_the_gradient_of_the_expected_accepted_length():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(6, 8, generator=g)
    valid = torch.rand(6, 8, generator=g) > 0.2
    valid[:, 0] = False
    for alpha in (0.05, 0.5):
        log_q = ((1 - alpha) * q + alpha).log().requires_grad_(True)
        reach = torch.cumprod(torch.where(valid, log_q.exp(), 1.0), dim=1)
        (reach * valid).sum().backward()  # expected accepted draft length, summed over the blocks
        torch.testing.assert_close(L.dpace_weights(q, valid, alpha), log_q.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(L.dpace_weights(q, valid, alpha).double(), loop_dpace(q, valid, alpha), rtol=1e-5, atol=1e-6)


def _dpace_of(alpha: float, *, detach: bool = True):
    def weights_of(ce: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        q = torch.exp(-(ce.detach() if detach else ce))
        smooth = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
        reach = torch.cumprod(smooth, dim=1) * valid
        return reach.flip(1).cumsum(1).flip(1) * valid

    return weights_of


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_compute_loss_dpace_matches_a_plain_recomputation(kl_weight):
    model, dc = tiny_model(LAYERS, num_anchors=6)
    lm = [0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1] + [1, 1, 1, 1, 1, 1, 1, 1]  # a hole mid-document
    views = packed_views([12, 8], planes=4, loss_mask=lm, seed=2)
    anchors, _ = B.sample_anchors(views.loss_mask, views.seq_lens, 6, 4, torch.Generator().manual_seed(4))
    for tc in (DPACE, DPACE_W):
        tc = dataclasses.replace(tc, kl_weight=kl_weight, dpace_alpha=0.3)
        model.zero_grad()
        out = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(4))
        out.loss_sum.backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        total, wsum, _, _ = manual_loss(model, views, anchors, tc.loss_gamma, kl_weight, weights_of=_dpace_of(0.3))
        total.backward()
        torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-5)
        expected_w = wsum if tc.dpace_normalizer == "weights" else torch.tensor(float(out.num_blocks))
        torch.testing.assert_close(out.weight_sum, expected_w, rtol=1e-5, atol=1e-6)
        assert out.num_blocks == anchors.numel() == 12
        for n, grad in got.items():  # stop-gradient: the weights are constants to backward
            torch.testing.assert_close(grad, model.get_parameter(n).grad, rtol=1e-4, atol=1e-6, msg=n)


def test_dpace_weights_receive_no_gradient():
    """Letting the gradient flow through the weights would give a different update: the test can tell."""
    model, dc = tiny_model(LAYERS, num_anchors=6)
    views = packed_views([12, 8], seed=2)
    anchors, _ = B.sample_anchors(views.loss_mask, views.seq_lens, 6, 4, torch.Generator().manual_seed(4))
    out = L.compute_loss(model, views, dc, DPACE, torch.Generator().manual_seed(4))
    out.loss_sum.backward()
    ours = model.fc.weight.grad.clone()
    for detach in (True, False):
        model.zero_grad()
        manual_loss(model, views, anchors, 7.0, weights_of=_dpace_of(DPACE.dpace_alpha, detach=detach))[0].backward()
        same = torch.allclose(ours, model.fc.weight.grad, rtol=1e-4, atol=1e-6)
        assert same == detach


def test_dpace_weighting_differs_from_decay():
    model, dc = tiny_model(LAYERS, num_anchors=64)
    views = packed_views(LENS, seed=3)
    decay = L.compute_loss(model, views, dc, TC, torch.Generator().manual_seed(1))
    dpace = L.compute_loss(model, views, dc, DPACE, torch.Generator().manual_seed(1))
    assert decay.num_blocks == dpace.num_blocks and torch.equal(decay.count_per_pos, dpace.count_per_pos)
    assert not torch.allclose(decay.loss_sum / decay.weight_sum, dpace.loss_sum / dpace.weight_sum)


def test_default_decay_path_ignores_the_dpace_keys():
    assert TrainingConfig().loss_weighting == "decay"
    model, dc = tiny_model(LAYERS, num_anchors=64)
    views = packed_views(LENS, seed=3)
    outs = []
    for tc in (TC, dataclasses.replace(TC, dpace_alpha=0.9, dpace_normalizer="weights")):
        model.zero_grad()
        out = L.compute_loss(model, views, chunked(dc, 5), tc, torch.Generator().manual_seed(1))
        out.loss_sum.backward()
        outs.append((out.loss_sum.detach(), out.weight_sum, out.ce_sum, model.fc.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_config_refuses_bad_dpace_values():
    cfg = config_from_dict({"training": {"loss_weighting": "dpace", "dpace_alpha": 0.25, "dpace_normalizer": "weights"}})
    assert (cfg.training.loss_weighting, cfg.training.dpace_alpha, cfg.training.dpace_normalizer) == ("dpace", 0.25, "weights")
    with pytest.raises(ConfigError, match=r"training\.loss_weighting.*'decay'.*'dpace'"):
        config_from_dict({"training": {"loss_weighting": "d-pace"}})
    with pytest.raises(ConfigError, match=r"training\.dpace_alpha: must be in \(0, 1\]"):
        config_from_dict({"training": {"dpace_alpha": 0.0}})
    with pytest.raises(ConfigError, match=r"training\.dpace_normalizer"):
        config_from_dict({"training": {"dpace_normalizer": "tokens"}})
