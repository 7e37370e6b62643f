"""``dflash-ipc bench drafter-serve`` on the CPU at tiny shapes: every (batch, head) cell timed against the
whole head, the two reduced routes (argmax over the draft rows + ``d2t``; logits scattered into the whole
vocabulary) drafting the same tokens, and its shape options checked before any model is built."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dflash_ipc.cli import main

TINY = [
    "hidden_size=32", "intermediate_size=64", "num_layers=2", "num_heads=4", "num_kv_heads=2", "head_dim=8",
    "vocab_size=512", "draft_vocab_size=96", "num_target_layers=6", "capture_layers=3", "block_size=4",
    "ctx=12", "new_ctx=3",
]  # fmt: skip


def _run(*extra: str):
    args = ["bench", "drafter-serve", "--device", "cpu", "--batches", "1,3", "--steps", "2", "--warmup", "1"]
    for item in TINY:
        args += ["--shape", item]
    return CliRunner().invoke(main, [*args, *extra])


def test_every_batch_and_head_is_timed_and_the_reduced_routes_draft_the_same_tokens():
    r = _run("--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.output.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["shape"]["vocab_size"] == 512 and result["shape"]["draft_vocab_size"] == 96
    cells = [(row["batch"], row["head"]) for row in result["rows"]]
    assert cells == [(b, h) for b in (1, 3) for h in ("whole", "reduced", "reduced-scatter")]
    assert all(row["ms"] > 0 for row in result["rows"])
    assert [row["vs_whole"] for row in result["rows"] if row["head"] == "whole"] == [1.0, 1.0]
    assert result["reduced_routes_agree"] is True


def test_the_table_says_whether_the_reduced_routes_agree():
    r = _run()
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len([x for x in lines if x.startswith("batch")]) == 6
    assert lines[-1] == "reduced and reduced-scatter drafted the same tokens"


def test_a_bad_shape_is_refused_naming_the_option():
    r = CliRunner().invoke(main, ["bench", "drafter-serve", "--device", "cpu", "--shape", "widht=8"])
    assert r.exit_code == 2 and "--shape" in r.output and "hidden_size" in r.output
    same = ["--shape", "vocab_size=64", "--shape", "draft_vocab_size=64"]
    r = CliRunner().invoke(main, ["bench", "drafter-serve", "--device", "cpu", *same])
    assert r.exit_code == 2 and "draft_vocab_size must be in (0, vocab_size = 64)" in r.output
