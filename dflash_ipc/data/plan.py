"""Epoch batch plans: length buckets, a padded-token budget, interleaved buckets, sharding.

* A sample of length ``L`` goes to the first bucket whose edge is ``>= L``
  (``data.bucket_edges``; the last edge is ``data.max_seq_len``).
* Every batch draws from one bucket. Within a bucket the samples are shuffled, then cut
  greedily into batches with ``batch_size * longest_in_batch <= data.token_budget`` (the
  target forward is right-padded to the longest sample) and ``batch_size <= data.max_batch_size``.
* The batches of all buckets are then shuffled together, so shapes are interleaved across
  the epoch (never sorted, never locked to one shape).
* Batch ``j`` of that global order goes to shard ``j % num_shards`` as its batch
  ``j // num_shards``: every batch goes to exactly one target rank, and its id
  ``BatchId(epoch, shard, index)`` is stable.

With ``data.weights`` (a mix of sources, :mod:`dflash_ipc.data.mix`) the epoch's samples are first
drawn by weight from the sources, then planned as above.

Everything is a pure function of ``(lengths, sources, cfg, seed, epoch)``: every rank computes the
same plan without communicating.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.config import DataConfig
from dflash_ipc.data.mix import epoch_samples, mix_report


@dataclass(frozen=True, order=True)
class BatchId:
    epoch: int
    shard: int
    index: int

    def to_wire(self) -> list[int]:
        return [self.epoch, self.shard, self.index]

    @classmethod
    def from_wire(cls, wire: Sequence[int]) -> BatchId:
        if len(wire) != 3:
            raise ValueError(f"a batch id on the wire is [epoch, shard, index], got {list(wire)!r}")
        return cls(int(wire[0]), int(wire[1]), int(wire[2]))

    @classmethod
    def parse(cls, text: str) -> BatchId:
        """Inverse of ``str()``: ``"e0-s1-b17"``."""
        try:
            e, s, b = text.split("-")
            assert e[0] == "e" and s[0] == "s" and b[0] == "b"
            return cls(int(e[1:]), int(s[1:]), int(b[1:]))
        except Exception:  # noqa: BLE001
            raise ValueError(f"not a batch id: {text!r} (expected like 'e0-s1-b17')") from None

    def __str__(self) -> str:
        return f"e{self.epoch}-s{self.shard}-b{self.index}"


@dataclass(frozen=True)
class PlannedBatch:
    id: BatchId
    bucket: int
    sample_indices: tuple[int, ...]
    n_tokens: int  # real tokens (sum of sample lengths)
    padded_len: int  # longest sample of the batch: the padded forward is [batch_size, padded_len]

    @property
    def batch_size(self) -> int:
        return len(self.sample_indices)

    @property
    def padded_tokens(self) -> int:
        return self.batch_size * self.padded_len


def _as_list(lengths: Any) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        return [int(x) for x in lengths.tolist()]
    return [int(x) for x in lengths]


def bucket_of(length: int, edges: Sequence[int]) -> int:
    """Index of the first bucket whose edge is >= ``length``."""
    b = bisect.bisect_left(edges, length)
    if b >= len(edges) or length < 1:
        raise ValueError(f"sample length {length} does not fit the bucket edges {list(edges)}")
    return b


def _epoch_rng(seed: int, epoch: int, what: str) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random: stable across runs and machines.
    return random.Random(f"dflash-ipc/plan/{what}/{seed}/{epoch}")


def _global_plan(lens: list[int], cfg: DataConfig, seed: int, epoch: int, sources: Any = None) -> list[tuple[int, list[int], int, int]]:
    """All batches of the epoch in their global (interleaved) order: (bucket, indices, n_tokens, padded_len)."""
    edges = list(cfg.bucket_edges)
    buckets: list[list[int]] = [[] for _ in edges]
    drawn = epoch_samples(sources, cfg.weights, seed, epoch) if cfg.weights and sources is not None else range(len(lens))
    for i in drawn:
        buckets[bucket_of(lens[i], edges)].append(i)
    rng = _epoch_rng(seed, epoch, "samples")
    batches: list[tuple[int, list[int], int, int]] = []
    for b, members in enumerate(buckets):
        rng.shuffle(members)
        cur: list[int] = []
        cur_max = 0
        cur_tok = 0
        for i in members:
            n = lens[i]
            new_max = max(cur_max, n)
            if cur and ((len(cur) + 1) * new_max > cfg.token_budget or len(cur) >= cfg.max_batch_size):
                batches.append((b, cur, cur_tok, cur_max))
                cur, cur_max, cur_tok = [], 0, 0
                new_max = n
            cur.append(i)
            cur_max = new_max
            cur_tok += n
        if cur:
            batches.append((b, cur, cur_tok, cur_max))
    _epoch_rng(seed, epoch, "batches").shuffle(batches)
    return batches


def plan_epoch(
    lengths: Any, cfg: DataConfig, seed: int, epoch: int, num_shards: int, shard: int, sources: Any = None
) -> list[PlannedBatch]:
    """The batches of ``epoch`` that target rank ``shard`` (of ``num_shards``) runs, in order.
    ``sources``: each sample's index in ``data.paths`` (``Corpus.sources``), for the mix of ``data.weights``;
    None plans every sample once (held-out data, a corpus without a mix)."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    lens = _as_list(lengths)
    if any(n > cfg.token_budget for n in lens):
        raise ValueError(f"a sample is longer than data.token_budget ({cfg.token_budget})")
    out = []
    for j, (b, idx, ntok, plen) in enumerate(_global_plan(lens, cfg, seed, epoch, sources)):
        if j % num_shards == shard:
            out.append(PlannedBatch(BatchId(epoch, shard, j // num_shards), b, tuple(idx), ntok, plen))
    return out


def _pct(x: float) -> float:
    return round(100.0 * x, 2)


def plan_stats(lengths: Any, cfg: DataConfig, seed: int, num_shards: int = 1, epoch: int = 0, sources: Any = None) -> dict[str, Any]:
    """Figures of the epoch plan (all shards together), and of the same data planned with a
    single bucket (no bucketing) under the same budget, for comparison; with a mix, the mix
    realised in every epoch (records and tokens per source)."""
    lens = _as_list(lengths)
    shards = [plan_epoch(lens, cfg, seed, epoch, num_shards, s, sources) for s in range(num_shards)]
    order = sorted((b for sh in shards for b in sh), key=lambda b: (b.id.index, b.id.shard))  # global order
    edges = list(cfg.bucket_edges)

    def waste(batches) -> float:
        padded = sum(b.padded_tokens for b in batches)
        return _pct((padded - sum(b.n_tokens for b in batches)) / padded) if padded else 0.0

    flat_cfg = dataclasses.replace(cfg, bucket_edges=[cfg.max_seq_len])
    flat = plan_epoch(lens, flat_cfg, seed, epoch, 1, 0, sources)
    toks = [b.n_tokens for b in order]
    buckets = [b.bucket for b in order]
    switches = sum(1 for a, b in zip(buckets, buckets[1:]) if a != b)
    per_bucket = []
    for k, edge in enumerate(edges):
        bb = [b for b in order if b.bucket == k]
        per_bucket.append(
            {
                "edge": edge,
                "samples": sum(b.batch_size for b in bb),
                "batches": len(bb),
                "mean_batch_size": round(sum(b.batch_size for b in bb) / len(bb), 2) if bb else 0.0,
            }
        )
    return {
        "n_samples": len(lens),
        "n_tokens": sum(lens),
        "n_batches": len(order),
        "n_batches_per_shard": [len(s) for s in shards],
        "tokens_per_batch_p50": statistics.median(toks) if toks else 0,
        "tokens_per_batch_min": min(toks, default=0),
        "tokens_per_batch_max": max(toks, default=0),
        "padded_tokens_per_batch_max": max((b.padded_tokens for b in order), default=0),
        "token_budget": cfg.token_budget,
        "padding_waste_pct": waste(order),
        "padding_waste_pct_unbucketed": waste(flat),
        "n_batches_unbucketed": len(flat),
        "single_bucket_batches": sum(1 for b in order if len({bucket_of(lens[i], edges) for i in b.sample_indices}) == 1),
        "bucket_switch_rate": round(switches / (len(order) - 1), 4) if len(order) > 1 else 0.0,
        "first_buckets": buckets[:20],
        "buckets": per_bucket,
        **({"mix": mix_report(lens, sources, cfg.paths, cfg.weights, seed, cfg.num_epochs)} if cfg.weights and sources is not None else {}),
    }


#: head sizes `plan` reports the coverage of, besides the configured one
DRAFT_VOCAB_SIZES = (1024, 4096, 8192, 16384, 32768)


def plan_command(config_path: str | Path, cache_dir: str | Path | None = None, sets: Sequence[str] = ()) -> dict[str, Any]:
    """``dflash-ipc plan``: load the config (``sets``: its ``--set`` items), then :func:`plan_report`."""
    from dflash_ipc.config import load_config

    return plan_report(load_config(config_path, sets=sets), config_path, cache_dir=cache_dir)


def plan_report(cfg: Any, config_path: str | Path, tok: Any = None, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """:func:`plan_stats` of ``cfg``'s corpus with what the corpus held, tokenized by ``tok`` (None: the config's
    tokenizer, loaded here; a caller that holds it already passes it).

    The tokenized corpus is cached in ``cache_dir``, else ``data.cache_dir``, else the run's
    ``data`` directory when ``run.run_dir`` is set, else a temporary directory.
    """
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.draft_vocab import coverage_by_size
    from dflash_ipc.data.tokenizer import config_tokenizer

    num_shards = len(cfg.topology.targets)
    tok = tok if tok is not None else config_tokenizer(cfg)

    def run(cdir: Path) -> dict[str, Any]:
        corpus = load_corpus(cfg.data, tok, cdir)
        stats = plan_stats(corpus.lengths, cfg.data, cfg.run.seed, num_shards=num_shards, sources=corpus.sources)
        r = corpus.report
        vocab = max(len(tok), int(corpus.tokens.max()) + 1 if corpus.tokens.numel() else 1)
        sizes = sorted({n for n in DRAFT_VOCAB_SIZES if n < vocab} | ({cfg.drafter.draft_vocab_size} - {0}))
        coverage = {str(n): round(c, 4) for n, c in coverage_by_size(corpus.tokens, corpus.loss_mask, vocab, sizes).items()}
        return {
            "config": str(config_path),
            "num_shards": num_shards,
            "seed": cfg.run.seed,
            "data": {
                "samples": r.samples,
                "tokens": r.tokens,
                "supervised_tokens": r.supervised_tokens,
                "num_bad_lines": r.num_bad_lines,
                "dropped_no_supervision": r.dropped_no_supervision,
                "truncated": r.truncated,
                "loaded_from_cache": r.loaded_from_cache,
                "cache_path": r.cache_path,
                # share of the supervised tokens the N most frequent ones cover (drafter.draft_vocab_size = N)
                "draft_vocab_coverage": coverage,
            },
            **stats,
        }

    chosen = cache_dir or cfg.data.cache_dir or (Path(cfg.run.run_dir) / "data" if cfg.run.run_dir else None)
    if chosen:
        return run(Path(chosen))
    with tempfile.TemporaryDirectory(prefix="dflash-plan-") as tmp:
        return run(Path(tmp))
