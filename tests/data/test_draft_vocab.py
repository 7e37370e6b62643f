"""The drafter's draft vocabulary (``drafter.draft_vocab_size``, dflash_ipc/data/draft_vocab.py): the choice
from the data, the run directory's copy, the head and loss over its rows, the export, eval over it,
and a real in-process run from the probe's plan to the export."""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest
import torch
from click.testing import CliRunner
from drafter.test_dflash_loss import V, manual_loss, packed_views, tiny_model

from dflash_ipc.config import ConfigError, TrainingConfig, config_from_dict
from dflash_ipc.data.draft_vocab import (
    DRAFT_VOCAB_FILE,
    EXPORT_FILE,
    choose_draft_vocab,
    coverage_by_size,
    ensure_draft_vocab,
    read_draft_vocab,
)
from dflash_ipc.drafter.export.layout import export_drafter, load_exported_drafter, read_export
from dflash_ipc.drafter.loss import blocks as B
from dflash_ipc.drafter.loss import objective as L
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter

# --------------------------------------------------------------------------- the choice


def test_the_most_frequent_supervised_tokens_ties_to_the_lower_id_and_the_coverage():
    #               supervised: 7 x3, 2 x2, 5 x2, 9 x1; unsupervised 4 x5 (never counted)
    tokens = torch.tensor([7, 7, 7, 2, 2, 5, 5, 9, 4, 4, 4, 4, 4], dtype=torch.int32)
    mask = torch.tensor([1] * 8 + [0] * 5, dtype=torch.uint8)
    v = choose_draft_vocab(tokens, mask, vocab_size=10, size=3)
    assert v.token_ids == (2, 5, 7)  # 7, then the tie 2/5 both fit
    assert v.coverage == pytest.approx(7 / 8) and v.supervised_tokens == 8
    assert choose_draft_vocab(tokens, mask, 10, 2).token_ids == (2, 7)  # the tie goes to the lower id
    # fewer distinct supervised tokens than asked: filled with the lowest unused ids, coverage 1
    filled = choose_draft_vocab(tokens, mask, 10, 6)
    assert filled.token_ids == (0, 1, 2, 5, 7, 9) and filled.coverage == 1.0
    assert coverage_by_size(tokens, mask, 10, [2, 3, 6]) == {n: choose_draft_vocab(tokens, mask, 10, n).coverage for n in (2, 3, 6)}
    for bad in (0, 11):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            choose_draft_vocab(tokens, mask, 10, bad)


def test_the_run_keeps_its_vocabulary_privately_and_refuses_another_size(tmp_path):
    a = torch.tensor([1, 1, 2, 3], dtype=torch.int32)
    ones = torch.ones(4, dtype=torch.uint8)
    first = ensure_draft_vocab(tmp_path, a, ones, 8, 2)
    f = tmp_path / DRAFT_VOCAB_FILE
    assert first.token_ids == (1, 2) and stat.S_IMODE(f.stat().st_mode) == 0o600
    # other data on a resume: the run keeps the head it trained
    again = ensure_draft_vocab(tmp_path, torch.tensor([5, 5, 6, 6], dtype=torch.int32), ones, 8, 2)
    assert again == first == read_draft_vocab(f)
    with pytest.raises(ValueError, match="drafter.draft_vocab_size.*holds 2 tokens"):
        ensure_draft_vocab(tmp_path, a, ones, 8, 3)
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not a draft vocabulary"):
        read_draft_vocab(f)


def test_the_config_refuses_a_negative_size_and_kl_over_a_draft_vocabulary():
    assert config_from_dict({"drafter": {"draft_vocab_size": 64}}).drafter.draft_vocab_size == 64
    with pytest.raises(ConfigError, match=r"c\.toml: drafter\.draft_vocab_size: must be >= 0"):
        config_from_dict({"drafter": {"draft_vocab_size": -1}}, "c.toml")
    kl = {"drafter": {"draft_vocab_size": 64}, "target": {"capture_last_hidden": True}, "training": {"kl_weight": 1.0}}
    with pytest.raises(ConfigError, match=r"training\.kl_weight: .*drafter\.draft_vocab_size = 0"):
        config_from_dict(kl, "c.toml")


def test_a_size_over_the_targets_vocabulary_is_refused_before_any_process_starts(tmp_path):
    from runtime.test_probe import tiny_cfg

    from dflash_ipc.runtime.preflight import check_machine

    cfg = tiny_cfg(tmp_path, **{"drafter.draft_vocab_size": 5000})
    with pytest.raises(ConfigError) as ei:
        check_machine(cfg)
    assert (ei.value.source, ei.value.key) == (cfg.source, "drafter.draft_vocab_size") and "at most 1024" in str(ei.value)


# --------------------------------------------------------------------------- the head and the loss


def reduced_twin(model: DFlashDrafter, ids: list[int]) -> DFlashDrafter:
    """The same drafter (same trainable weights, same frozen heads) whose head keeps ``ids`` only."""
    cfg = dataclasses.replace(model.config, draft_vocab_size=len(ids))
    twin = DFlashDrafter(cfg, model.embed_weight, model.lm_head_weight, "sdpa", draft_token_ids=torch.tensor(ids))
    twin.load_state_dict(model.state_dict())
    return twin


def _anchors(views, n, bs, seed):
    return B.sample_anchors(views.loss_mask, views.seq_lens, n, bs, torch.Generator().manual_seed(seed))


def test_a_head_over_the_labels_trains_as_softmax_over_its_rows_and_never_drafts_outside():
    model, dc = tiny_model(["sliding_attention", "full_attention"], block_size=4, num_anchors=4)
    views = packed_views([14, 11])
    labels = sorted(set(views.token_ids.tolist()))
    extra = [i for i in range(V) if i not in labels][:20]
    twin = reduced_twin(model, sorted(labels + extra))
    tc = TrainingConfig(loss_gamma=7.0, ce_chunk_tokens=16)
    out = L.compute_loss(twin, views, dc, tc, torch.Generator().manual_seed(3))
    full = L.compute_loss(model, views, dc, tc, torch.Generator().manual_seed(3))
    # every label is in the head: compute_logits' -inf outside makes the plain recomputation the
    # softmax over the head's rows
    total, wsum, correct, count = manual_loss(twin, views, _anchors(views, 4, 4, 3)[0], 7.0)
    torch.testing.assert_close(out.loss_sum, total, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.weight_sum, wsum)
    assert torch.equal(out.correct_per_pos, correct) and torch.equal(out.count_per_pos, count)
    # fewer rows than the whole vocabulary: each label is likelier, and never less often the argmax
    assert out.ce_sum < full.ce_sum and bool((out.correct_per_pos >= full.correct_per_pos).all())
    torch.testing.assert_close(out.weight_sum, full.weight_sum)
    logits = twin.compute_logits(torch.randn(5, model.config.hidden_size))
    outside = torch.ones(V, dtype=torch.bool)
    outside[twin.draft_token_ids] = False
    assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    out.loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in twin.trainable_parameters())


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_labels_outside_the_head_carry_no_loss_and_count_as_misses(weighting):
    model, dc = tiny_model(["full_attention"], block_size=4, num_anchors=5)
    views = packed_views([13, 12])
    present = set(views.token_ids.tolist())
    absent = [i for i in range(V) if i not in present]
    tc = TrainingConfig(ce_chunk_tokens=16, loss_weighting=weighting)
    none_in = L.compute_loss(reduced_twin(model, absent[:32]), views, dc, tc, torch.Generator().manual_seed(1))
    assert none_in.weight_sum == 0 or weighting == "dpace"  # dpace's "blocks" normaliser counts blocks
    assert none_in.loss_sum.item() == 0 and none_in.ce_sum.item() == 0
    assert none_in.correct_per_pos.sum() == 0 and none_in.count_per_pos.sum() > 0  # every slot a miss
    assert none_in.accept_len_sum == none_in.accept_blocks  # eval's rule: 1 token per block
    # half the labels in the head: the loss is that of the in-head rows only
    keep = sorted(present)[::2]
    half = L.compute_loss(reduced_twin(model, keep), views, dc, tc, torch.Generator().manual_seed(1))
    anchors, adoc = _anchors(views, 5, 4, 1)
    doc = B.document_index(views.seq_lens, views.token_ids.numel())
    lab = B.block_labels(views.token_ids, views.loss_mask, anchors, doc.doc_end[adoc], 4, tc.loss_gamma)
    in_head = lab.valid & torch.isin(lab.labels, torch.tensor(keep))
    assert 0 < int(in_head.sum()) < int(lab.valid.sum())
    if weighting == "decay":
        torch.testing.assert_close(half.weight_sum, (lab.weights * in_head).sum())
    assert half.correct_per_pos.sum() <= in_head.sum()


# --------------------------------------------------------------------------- export and eval


def test_the_export_carries_its_rows_and_eval_drafts_over_them_losslessly(tmp_path):
    from eval.test_eval import TINY
    from safetensors import safe_open

    from dflash_ipc.cli import main
    from dflash_ipc.config import load_config
    from dflash_ipc.data.draft_vocab import DraftVocab
    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.drafter.model.build import drafter_for_target
    from dflash_ipc.target_spec.heads import target_head_weights
    from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids, text_config

    cfg = load_config(TINY, {"drafter.draft_vocab_size": 200})
    tok = load_tokenizer(cfg.target.tokenizer)
    hf = load_hf_config(cfg.target, vocab_size=len(tok))
    vocab = int(text_config(hf).vocab_size)
    layer_ids = resolve_layer_ids(cfg.target, int(text_config(hf).num_hidden_layers))
    with pytest.raises(ValueError, match="draft_vocab.json"):
        drafter_for_target(cfg, hf, layer_ids, vocab - 1, "cpu")
    ids = tuple(range(0, 400, 2))
    model = drafter_for_target(cfg, hf, layer_ids, vocab - 1, "cpu", DraftVocab(ids, vocab, 0.5, 10))
    out = export_drafter(model, tmp_path / "d")
    with safe_open(str(out / "model.safetensors"), "pt") as st:  # vLLM's EAGLE-3 layout: row + d2t[row] = target id
        assert (torch.arange(200) + st.get_tensor("d2t")).tolist() == list(ids)
        torch.testing.assert_close(st.get_tensor("lm_head.weight"), model.lm_head_weight)
    assert not (out / EXPORT_FILE).exists()
    conf = json.loads((out / "config.json").read_text())
    assert conf["dflash_config"]["draft_vocab_size"] == conf["draft_vocab_size"] == 200
    assert read_export(out).draft_vocab_size == 200
    back = load_exported_drafter(out, *target_head_weights(cfg.target, hf, "cpu", torch.float32))
    assert back.draft_token_ids.tolist() == list(ids)
    torch.testing.assert_close(back.lm_head_weight, model.lm_head_weight)
    r = CliRunner().invoke(
        main, ["eval", "--config", str(TINY), "--drafter", str(out), "--n", "2", "--max-new", "12", "--json", "--workers", "1"]
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["lossless"] is True and rep["prompts"] == 2
    # a full-vocabulary export into the same directory leaves no stale rows behind
    whole = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, draft_vocab_size=0))
    export_drafter(drafter_for_target(whole, hf, layer_ids, vocab - 1, "cpu"), out)
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        assert "d2t" not in st.keys() and read_export(out).draft_vocab_size == 0
    # an older export's rows file is still read
    from safetensors.torch import save_file

    old_layout = export_drafter(model, tmp_path / "old", client="sglang")  # no d2t: then config says the whole head
    conf = json.loads((old_layout / "config.json").read_text())
    conf["dflash_config"]["draft_vocab_size"] = 200
    (old_layout / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="no d2t"):  # rows named nowhere: refused by name before any model is built
        read_export(old_layout)
    save_file({"draft_token_ids": torch.tensor(ids)}, str(old_layout / EXPORT_FILE))
    assert load_exported_drafter(old_layout, *target_head_weights(cfg.target, hf, "cpu", torch.float32)).draft_token_ids.tolist() == list(
        ids
    )


# --------------------------------------------------------------------------- a real run, in one process


def test_the_probe_chooses_the_rows_and_a_run_trains_scores_and_exports_over_them(tmp_path):
    from conftest import holdout_file
    from loop_harness import InprocRun, small_config

    from dflash_ipc.runtime.probe import plan_data

    holdout = holdout_file(tmp_path, 120)
    cfg = small_config(
        tmp_path,
        targets=1,
        drafter={"draft_vocab_size": 96},
        data={"holdout_paths": [str(holdout)]},
        training={"holdout_every": 3, "holdout_batches": 1, "max_steps": 6},
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    plan = plan_data(cfg, run_dir, 1)
    assert "draft vocabulary: 96 of" in plan.summary
    chosen = read_draft_vocab(run_dir / DRAFT_VOCAB_FILE)
    assert chosen.size == 96 and 0.5 < chosen.coverage < 1.0
    run = InprocRun(cfg, run_dir)
    try:
        run.run()
        assert run.drafter_core.model.draft_token_ids.tolist() == list(chosen.token_ids)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r][-1] == 6
        assert any(r.get("tau_holdout_blocks", 0) > 0 for r in rows)
        (done,) = run.drafter_io.to_supervisor
        back = read_export(done.drafter.export)
        assert back.draft_vocab_size == 96
    finally:
        run.close()
