"""The data mix (data.weights): quotas per source, drawing without replacement then whole repeated passes,
determinism per (seed, epoch), the plan over a mixed corpus (every drawn sample in exactly one batch of
one shard), the realised mix in `plan --json` and the `up` log, and the refusal of bad weights."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, DataConfig, load_config
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.mix import epoch_samples, mix_report, source_quotas
from dflash_ipc.data.plan import plan_epoch
from dflash_ipc.data.tokenizer import load_tokenizer
from dflash_ipc.runtime.probe import plan_data

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"


def test_quotas_are_largest_remainders_summing_to_the_epoch():
    assert source_quotas([30, 70], [0.7, 0.3], 100) == [70, 30]
    assert source_quotas([5, 5, 5], [1, 1, 1], 10) == [4, 3, 3]
    assert sum(source_quotas([9, 9, 9], [0.2, 0.5, 0.3], 17)) == 17
    with pytest.raises(DataError, match=r"data\.weights\[1\]"):
        source_quotas([10, 0], [0.5, 0.5], 10)
    assert source_quotas([10, 0], [1.0, 0.0], 10) == [10, 0]


def test_epoch_samples_draw_without_replacement_then_repeat_whole_passes():
    sources = [0] * 30 + [1] * 70
    drawn = epoch_samples(sources, [0.7, 0.3], seed=1, epoch=0)
    assert len(drawn) == 100
    small = Counter(i for i in drawn if i < 30)
    big = Counter(i for i in drawn if i >= 30)
    assert sum(small.values()) == 70 and sum(big.values()) == 30
    assert set(small) == set(range(30)) and set(small.values()) <= {2, 3}  # two whole passes, then part of a third
    assert max(big.values()) == 1  # 30 of 70, none twice
    assert drawn == epoch_samples(sources, [0.7, 0.3], seed=1, epoch=0)  # pure function of (seed, epoch)
    assert set(drawn) != set(epoch_samples(sources, [0.7, 0.3], seed=1, epoch=1))
    assert all(i < 30 for i in epoch_samples(sources, [1, 0], seed=1, epoch=0))


def test_bad_weights_are_refused_naming_the_key(tmp_path):
    cfg = tmp_path / "c.toml"
    for weights, why in (("[1.0]", "one weight per path"), ("[0, 0]", "sum to 0"), ("[1, -1]", ">= 0"), ('["a", 1]', "number")):
        cfg.write_text(
            TINY.read_text().replace('paths = ["builtin:stdlib-docs"]', f'paths = ["builtin:stdlib-docs", "x.jsonl"]\nweights = {weights}')
        )
        with pytest.raises(ConfigError, match=rf"data\.weights.*{why}"):
            load_config(cfg)
    with pytest.raises(ValueError, match="one weight per path"):
        DataConfig(paths=["a.jsonl"], weights=[0.5, 0.5])


def _mixed_config(tmp_path: Path, weights: str = "[0.3, 0.7]", epochs: int = 2) -> Path:
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"role": "user", "content": f"Recipe {i}?"}, {"role": "assistant", "content": f"Cook {i} eggs."}]}
            )
            + "\n"
            for i in range(40)
        )
    )
    cfg = tmp_path / "mix.toml"
    text = TINY.read_text().replace('paths = ["builtin:stdlib-docs"]', f'paths = ["builtin:stdlib-docs", "{chats}"]\nweights = {weights}')
    cfg.write_text(text.replace("builtin_samples = 800", "builtin_samples = 60").replace("num_epochs = 1", f"num_epochs = {epochs}"))
    return cfg


def test_plan_over_a_mixed_corpus_covers_each_drawn_sample_once_and_reports_the_mix(tmp_path):
    cfg = load_config(_mixed_config(tmp_path))
    corpus = load_corpus(cfg.data, load_tokenizer("builtin"), tmp_path / "cache")
    src = corpus.sources.tolist()
    assert src == sorted(src) and set(src) == {0, 1} and src.count(1) == 40
    n = corpus.num_samples
    for epoch in range(2):
        drawn = epoch_samples(corpus.sources, cfg.data.weights, cfg.run.seed, epoch)
        planned = [
            i
            for s in range(2)
            for b in plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, epoch, 2, s, corpus.sources)
            for i in b.sample_indices
        ]
        assert Counter(planned) == Counter(drawn)  # every drawn sample in exactly one batch of one shard
        assert sum(1 for i in drawn if src[i] == 1) == round(0.7 * n)
    report = mix_report(corpus.lengths, corpus.sources, cfg.data.paths, cfg.data.weights, cfg.run.seed, 2)
    assert [e["records"] for e in report] == [n, n]
    for e in report:
        synth = e["sources"][1]
        assert synth["records"] == round(0.7 * n) and synth["distinct"] == 40 and synth["passes"] == round(round(0.7 * n) / 40, 3)
        assert sum(s["tokens"] for s in e["sources"]) == sum(
            int(corpus.lengths[i]) for i in epoch_samples(src, [0.3, 0.7], cfg.run.seed, e["epoch"])
        )
    # without sources (held-out data) the plan is every sample once
    assert sorted(i for b in plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, 0, 1, 0) for i in b.sample_indices) == list(range(n))


def test_plan_json_and_the_up_summary_state_the_realised_mix(tmp_path):
    path = _mixed_config(tmp_path)
    r = CliRunner().invoke(main, ["plan", "--config", str(path), "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output.strip().splitlines()[-1])
    assert [e["epoch"] for e in stats["mix"]] == [0, 1]
    assert stats["mix"][0]["records"] == stats["n_samples"]
    assert [s["weight"] for s in stats["mix"][0]["sources"]] == [0.3, 0.7]
    plan = plan_data(load_config(path), tmp_path / "run", 2)
    assert "mix epoch 0: builtin:stdlib-docs" in plan.summary and "epoch 1:" in plan.summary
