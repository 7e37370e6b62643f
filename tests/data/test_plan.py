"""Epoch batch plans: one bucket per batch, interleaved buckets, budget, sharding, stats."""

from __future__ import annotations

import bisect
import dataclasses
import random
from pathlib import Path

import pytest
import torch

from dflash_ipc.config import DataConfig, load_config
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.plan import BatchId, PlannedBatch, bucket_of, plan_command, plan_epoch, plan_stats
from dflash_ipc.data.tokenizer import build_builtin_tokenizer

REPO = Path(__file__).resolve().parents[2]
CFG = DataConfig()  # edges [256, 512, 1024, 2048], budget 16384, max_batch_size 64


def synthetic_lengths(n: int = 3000, seed: int = 7, max_len: int = 2048) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([min(max_len, max(2, int(2 ** rng.uniform(3, 11.2)))) for _ in range(n)])


@pytest.fixture(scope="module")
def builtin_lengths(tmp_path_factory) -> torch.Tensor:
    corpus = load_corpus(CFG, build_builtin_tokenizer(), tmp_path_factory.mktemp("data"))
    return corpus.lengths


def sig(batches: list[PlannedBatch]) -> list[tuple]:
    return [(str(b.id), b.bucket, b.sample_indices, b.n_tokens, b.padded_len) for b in batches]


def test_batch_id():
    b = BatchId(0, 1, 17)
    assert str(b) == "e0-s1-b17"
    assert BatchId.from_wire(b.to_wire()) == b and b.to_wire() == [0, 1, 17]
    assert BatchId.parse("e0-s1-b17") == b
    assert {b: 1}[BatchId(0, 1, 17)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.index = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        BatchId.parse("batch-3")


def test_bucket_of():
    edges = [256, 512, 1024, 2048]
    assert [bucket_of(n, edges) for n in (1, 256, 257, 512, 513, 2048)] == [0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError):
        bucket_of(2049, edges)


def test_plan_deterministic_and_epochs_differ():
    lens = synthetic_lengths()
    a = plan_epoch(lens, CFG, seed=3, epoch=0, num_shards=1, shard=0)
    assert sig(a) == sig(plan_epoch(lens.tolist(), CFG, seed=3, epoch=0, num_shards=1, shard=0))
    b = plan_epoch(lens, CFG, seed=3, epoch=1, num_shards=1, shard=0)
    c = plan_epoch(lens, CFG, seed=4, epoch=0, num_shards=1, shard=0)
    assert [x.sample_indices for x in a] != [x.sample_indices for x in b]
    assert [x.sample_indices for x in a] != [x.sample_indices for x in c]
    assert all(x.id.epoch == 1 for x in b)
    # the same samples in every epoch, each exactly once
    for plan in (a, b, c):
        flat = [i for x in plan for i in x.sample_indices]
        assert sorted(flat) == list(range(len(lens)))


def test_every_batch_one_bucket_within_budget():
    lens = synthetic_lengths()
    edges = CFG.bucket_edges
    plan = plan_epoch(lens, CFG, seed=0, epoch=0, num_shards=1, shard=0)
    for b in plan:
        ls = [int(lens[i]) for i in b.sample_indices]
        assert {bisect.bisect_left(edges, n) for n in ls} == {b.bucket}
        assert b.padded_len == max(ls) and b.n_tokens == sum(ls)
        assert b.batch_size * b.padded_len <= CFG.token_budget and b.padded_tokens <= CFG.token_budget
        assert 1 <= b.batch_size <= CFG.max_batch_size
    # interleaved, not sorted or locked to a shape
    buckets = [b.bucket for b in plan]
    assert buckets != sorted(buckets) and buckets != sorted(buckets, reverse=True)
    assert len(set(buckets[:10])) > 1
    tight = dataclasses.replace(CFG, max_batch_size=4)
    assert max(b.batch_size for b in plan_epoch(lens, tight, 0, 0, 1, 0)) == 4


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_sharding_covers_every_batch_once(num_shards):
    lens = synthetic_lengths(1000)
    whole = plan_epoch(lens, CFG, seed=1, epoch=2, num_shards=1, shard=0)
    shards = [plan_epoch(lens, CFG, seed=1, epoch=2, num_shards=num_shards, shard=s) for s in range(num_shards)]
    union = [b for sh in shards for b in sh]
    assert sorted(b.sample_indices for b in union) == sorted(b.sample_indices for b in whole)
    samples = [i for b in union for i in b.sample_indices]
    assert len(samples) == len(set(samples)) == len(lens)
    ids = [b.id for b in union]
    assert len(set(ids)) == len(ids)
    for s, sh in enumerate(shards):
        assert [b.id for b in sh] == [BatchId(2, s, k) for k in range(len(sh))]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # the global order interleaves the shards: batch j of the whole plan is shard j % n, index j // n
    for j, b in enumerate(whole):
        assert shards[j % num_shards][j // num_shards].sample_indices == b.sample_indices
    with pytest.raises(ValueError):
        plan_epoch(lens, CFG, 0, 0, num_shards, num_shards)


def test_plan_stats_on_builtin_corpus(builtin_lengths):
    s = plan_stats(builtin_lengths, CFG, seed=0)
    assert s["n_samples"] == CFG.builtin_samples
    assert s["single_bucket_batches"] == s["n_batches"] > 0
    assert s["bucket_switch_rate"] > 0.3
    assert s["padding_waste_pct"] < s["padding_waste_pct_unbucketed"]
    assert s["tokens_per_batch_min"] <= s["tokens_per_batch_p50"] <= s["tokens_per_batch_max"] <= CFG.token_budget
    assert s["padded_tokens_per_batch_max"] <= CFG.token_budget
    assert len(s["first_buckets"]) == 20 and len(set(s["first_buckets"])) > 1
    assert all(b["batches"] > 0 for b in s["buckets"])  # every bucket gets samples
    assert sum(b["samples"] for b in s["buckets"]) == s["n_samples"]
    assert s == plan_stats(builtin_lengths, CFG, seed=0)
    s4 = plan_stats(builtin_lengths, CFG, seed=0, num_shards=4)
    assert s4["n_batches"] == s["n_batches"] and sum(s4["n_batches_per_shard"]) == s["n_batches"]


def test_plan_command(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        "[run]\nname = 'p'\nseed = 5\n[topology]\ntargets = ['cpu', 'cpu']\n"
        f"[data]\nbuiltin_samples = 300\ncache_dir = '{tmp_path / 'cache'}'\n[drafter]\ndraft_vocab_size = 256\n"
    )
    out = plan_command(cfg)
    assert out["num_shards"] == 2 and out["seed"] == 5 and out["n_samples"] == 300
    assert out["single_bucket_batches"] == out["n_batches"]
    assert not out["data"]["loaded_from_cache"]
    # the built-in tokenizer has 1,024 ids: only the configured size is below it; the most frequent quarter of
    # the ids covers far more than a quarter of what the answers say
    assert list(out["data"]["draft_vocab_coverage"]) == ["256"] and 0.5 < out["data"]["draft_vocab_coverage"]["256"] < 1
    again = plan_command(cfg)
    assert again["data"]["loaded_from_cache"] and again["first_buckets"] == out["first_buckets"]


def test_plan_27b_config():
    path = REPO / "configs" / "plan-27b.toml"
    cfg = load_config(path)
    assert cfg.data.token_budget == 49152 and cfg.data.max_seq_len == 8192
    assert cfg.data.paths == ["builtin:stdlib-docs"] and cfg.data.builtin_samples == 6000
    # its buckets, budget and sequence length on a quarter of its samples (tokenizing all 6,000 costs ~10 CPU-s);
    # every bucket still gets batches
    out = plan_command(path, sets=["data.builtin_samples=1500"])
    assert out["single_bucket_batches"] == out["n_batches"]
    assert out["bucket_switch_rate"] > 0.3
    assert out["padding_waste_pct"] < out["padding_waste_pct_unbucketed"]
    assert out["padded_tokens_per_batch_max"] <= 49152
    assert all(b["batches"] > 0 for b in out["buckets"])  # long samples reach the top buckets
    assert out["tokens_per_batch_max"] > 8192
