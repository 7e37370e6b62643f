"""Held-out τ by simulated decoding (drafter/training/holdout.py): the chaining rule on hand-made acceptance
lengths, and the proof that it equals `dflash-ipc eval`'s τ on the target's own greedy answers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dflash_ipc.config import ConfigError, config_from_dict, load_config
from dflash_ipc.drafter.training.holdout import answer_spans, chained_counts, chained_decode

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"


# --------------------------------------------------------------------------- the pure rule


def test_every_draft_accepted_gives_full_blocks_and_a_cut_last_step():
    # block 8: 7 drafts accepted per step; 20 answer tokens, the first from the prefill
    assert chained_decode([7] * 20) == (19, 3)  # 8 + 8 + 3 (cut at the answer's end)


def test_nothing_accepted_gives_tau_one():
    assert chained_decode([0] * 10) == (9, 9)


def test_partial_chain_lands_only_on_the_anchors_it_reaches():
    # a(0)=2 -> r1..r3; a(3)=0 -> r4; a(4)=4 -> r5..r8, no bonus after the answer's last token.
    # Positions the chain skips (1, 2, 5, ...) do not count, whatever their acceptance.
    acc = [2, 7, 7, 0, 4, 7, 7, 7, 0]
    assert chained_decode(acc) == (8, 3)
    assert chained_decode([2, 7, 7, 1, 4, 7, 7, 7, 0]) == (8, 3)  # a(3)=1 -> r4 r5; a(5)=7 -> r6..r8
    assert chained_decode([0, 7, 7, 7, 7, 7, 7, 7, 0]) == (8, 2)


def test_max_new_cuts_the_answer_as_eval_does():
    acc = [2, 7, 7, 0, 4, 7, 7, 7, 0]
    assert chained_decode(acc, max_new=7) == (6, 3)  # eval's 7 tokens: the prefill's + 6 from 3 steps
    assert chained_decode(acc, max_new=4) == (3, 1)
    assert chained_decode(acc, max_new=1) == (0, 0)  # the prefill's token only: no step
    assert chained_decode(acc, max_new=100) == chained_decode(acc) == chained_decode(acc, max_new=0)
    assert chained_decode([5]) == (0, 0)
    with pytest.raises(ValueError, match="max_new must be >= 0"):
        chained_decode(acc, max_new=-1)
    with pytest.raises(ValueError, match="no acceptance length at answer token 3"):
        chained_decode([2, 0, 0, -1, 0])


def test_answers_are_the_supervised_runs_of_each_document():
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.uint8)
    lens = torch.tensor([5, 6, 2, 3], dtype=torch.int32)
    assert answer_spans(mask, lens) == [(1, 4), (6, 10), (11, 13), (13, 16)]  # a run never crosses documents
    # every valid anchor (loss_mask[i] & loss_mask[i+1], same document) with its acceptance length (1 + accepted)
    anchors = torch.tensor([1, 2, 6, 7, 8, 11, 13, 14])
    lengths = torch.tensor([3, 1, 1, 3, 1, 2, 2, 2])
    # answer (1,4): a(1)=2 -> 2 tokens, 1 step; (6,10): a(6)=0, a(7)=2 cut to 2 -> 3 tokens, 2 steps;
    # (11,13): a(11)=1 cut to 1; (13,16): a(13)=1 -> 2 tokens, 1 step
    assert chained_counts(mask, lens, anchors, lengths) == (2 + 3 + 1 + 2, 1 + 2 + 1 + 1, 4)
    assert chained_counts(mask, lens, anchors, lengths, max_new=2) == (1 + 1 + 1 + 1, 1 + 1 + 1 + 1, 4)


def test_holdout_max_new_is_validated():
    raw = load_config(TINY).to_dict()
    raw["training"]["holdout_max_new"] = -1
    with pytest.raises(ConfigError, match=r"training\.holdout_max_new: must be >= 0 .*eval's --max-new"):
        config_from_dict(raw, "t.toml")
    raw["training"]["holdout_max_new"] = 128
    assert config_from_dict(raw, "t.toml").training.holdout_max_new == 128


# --------------------------------------------------------------------------- the proof: equal to eval


def _greedy_documents(cfg, tokenizer, prompts_file: Path, out: Path, max_new: int):
    """The prompts answered by `dflash-ipc gen-data` (greedy, fp32, one prompt per batch: no left
    padding) and read back by the corpus loader, as training's held-out data is: each document the
    prompt (unsupervised) and the answer's stored token ids (supervised; cut at max_new, so no
    ``<|im_end|>`` follows). Returns the documents and gen-data's records."""
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    from dflash_ipc.data.corpus import load_corpus

    args = ["--prompts", str(prompts_file), "--out", str(out), "--max-new", str(max_new), "--batch-size", "1"]
    r = CliRunner().invoke(main, ["gen-data", "--config", str(TINY), *args])
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in out.read_text().splitlines()]
    corpus = load_corpus(dataclasses.replace(cfg.data, paths=[str(out)]), tokenizer, None)
    assert corpus.report.num_bad_lines == 0
    docs = [tuple(t.tolist() for t in corpus.sample(i)) for i in range(corpus.num_samples)]
    return docs, records


def _held_out_views(cfg, docs):
    """The held-out batch as a target process ships it: the training target's captured planes, packed into a slot."""
    from dflash_ipc.target.core import slot_layout_for
    from dflash_ipc.target.model import build_target
    from dflash_ipc.target.packing import flat_batch_meta, pack_into_slot

    target = build_target(cfg.target, "cpu", vocab_size=1024)
    width = max(len(ids) for ids, _ in docs)
    ids = torch.zeros((len(docs), width), dtype=torch.int64)
    mask = torch.zeros((len(docs), width), dtype=torch.uint8)
    for i, (t, m) in enumerate(docs):
        ids[i, : len(t)], mask[i, : len(m)] = torch.tensor(t), torch.tensor(m, dtype=torch.uint8)
    lens = torch.tensor([len(t) for t, _ in docs])
    meta = flat_batch_meta(ids, mask, lens, pin=False)
    with torch.no_grad():  # as TargetCore.forward_next runs it: packed where the target is varlen
        planes = target.capture_packed(meta.token_ids, meta.lens()) if target.varlen else target.capture(ids)
    layout = slot_layout_for(cfg, target)
    slot = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    return pack_into_slot(layout, slot, planes, meta)


def test_simulated_holdout_tau_equals_eval_on_the_targets_greedy_answers(tmp_path):
    from dflash_ipc.data.builtin_corpus import builtin_conversations
    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.drafter.core import DrafterCore
    from dflash_ipc.drafter.training.distributed import DistInfo
    from dflash_ipc.eval.run import load_prompts, run_eval

    n, max_new = 4, 24
    source = tmp_path / "questions.jsonl"
    chats = builtin_conversations(n, 256)
    source.write_text("".join(json.dumps({"id": f"h{i}", **c}) + "\n" for i, c in enumerate(chats)))
    prompts_file = tmp_path / "gen.jsonl"  # gen-data's answers: the held-out data and eval's prompts
    cfg = load_config(
        TINY,
        {
            "topology.targets": ["cpu"],
            "topology.drafters": ["cpu"],
            "data.holdout_paths": [str(prompts_file)],
            "training.holdout_every": 1,
            "training.holdout_max_new": max_new,
            "training.warmup_steps": 2,
        },
    )
    tokenizer = load_tokenizer(cfg.target.tokenizer)
    docs, records = _greedy_documents(cfg, tokenizer, source, prompts_file, max_new)
    answers = [r["conversations"][-1]["token_ids"] for r in records]
    # no early stop: eval decodes max_new tokens of each; each document is the prompt eval feeds and the stored ids
    assert len(docs) == n and all(len(a) == max_new and r["finish"] == "length" for a, r in zip(answers, records))
    prompts = load_prompts(cfg, tokenizer, str(prompts_file), n)
    assert docs == [(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers)]
    # the text alone would not do: a random target's ids mostly re-tokenize to other ids
    retokenized = [tokenizer(r["conversations"][-1]["content"], add_special_tokens=False)["input_ids"] for r in records]
    print(f"answers whose text re-tokenizes to the generated ids: {sum(t == a for t, a in zip(retokenized, answers))}/{n}")
    views = _held_out_views(cfg, docs)

    # A drafter that accepts some drafts: a few steps on these very documents (the point is the
    # estimator, not generalization), through the drafter process's own core.
    (tmp_path / "run").mkdir(mode=0o700)
    core = DrafterCore(cfg, tmp_path / "run", DistInfo.single("cpu"), torch.device("cpu"), total_steps=30, resume=False)
    try:
        floor = core.evaluate_holdout(views, [0, 0, 0], 1)
        for step in range(30):
            core.train_step(views, [0, 0, step], 0.0, 0.0)
        rec = core.evaluate_holdout(views, [1, 0, 0], 1)
        export = core.export()
    finally:
        core.close()
    report = run_eval(cfg, str(export), prompts_path=str(prompts_file), n=n, max_new=max_new, target_device="cpu", drafter_device="cpu")

    assert report["lossless"] is True and report["prompts"] == n
    spec_tokens = report["tokens"] - n  # eval's tau leaves out each prompt's prefill token
    print(
        f"simulated: {rec['tau_holdout']} ({spec_tokens} tokens / {rec['tau_holdout_steps']} steps), "
        f"eval: {report['tau']} ({report['verify_steps']} steps, acceptance {report['acceptance_per_position']}), "
        f"uniform anchors: {rec['tau_holdout_uniform']}, untrained: {floor['tau_holdout']}"
    )
    assert report["acceptance_per_position"][0] > 0.2 and report["tau"] > 1.3  # drafts really are accepted
    # equal, not close: the same tokens in the same number of verification steps
    assert rec["tau_holdout_steps"] == report["verify_steps"]
    assert spec_tokens == n * (max_new - 1)  # both decode max_new tokens of each answer
    assert rec["tau_holdout"] == report["tau"]
    assert rec["tau_holdout_answers"] == n and rec["holdout_max_new"] == max_new
    # an anchor needs a supervised next token: 23 per cut answer (num_anchors 32 >= 23)
    assert rec["tau_holdout_blocks"] == rec["tau_holdout_uniform_blocks"] == n * (max_new - 1)
