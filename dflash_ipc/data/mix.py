"""The data mix: several sources (``data.paths``) drawn by weight (``data.weights``) each epoch.

Without weights every sample is planned once per epoch (the plan of :mod:`dflash_ipc.data.plan`).
With weights ``w`` the epoch holds as many samples as the corpus (``N``), source ``s`` contributing
``N * w_s / sum(w)`` of them (largest remainders, so the quotas sum to ``N`` exactly). A source's
quota is drawn *without replacement* from a shuffle of its samples made for this (seed, epoch, source);
a quota larger than the source repeats it, each repetition a fresh shuffle (whole passes, then part of
one), so no sample is drawn twice before every sample of its source was drawn once. A weight of 0 leaves
a source out of training (it is still tokenized). Everything is a pure function of
``(sources, weights, seed, epoch)``: every rank computes the same epoch, and batch ids stay stable
(resume repeats no consumed batch and skips none).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dflash_ipc.data.errors import DataError

__all__ = ["epoch_samples", "mix_line", "mix_report", "source_quotas"]


def _as_list(values: Any) -> list[int]:
    return [int(x) for x in (values.tolist() if hasattr(values, "tolist") else values)]


def source_quotas(counts: Sequence[int], weights: Sequence[float], total: int) -> list[int]:
    """Samples per source in an epoch of ``total``: ``total * w / sum(w)`` by largest remainders."""
    w_sum = float(sum(weights))
    exact = [total * w / w_sum for w in weights]
    quotas = [int(x) for x in exact]
    for k in sorted(range(len(exact)), key=lambda k: (quotas[k] - exact[k], k))[: total - sum(quotas)]:
        quotas[k] += 1
    for k, (q, n) in enumerate(zip(quotas, counts)):
        if q > 0 and n == 0:
            raise DataError(
                f"data.weights[{k}] = {weights[k]} but data.paths[{k}] gave no usable samples: set its weight to 0 or fix the path"
            )
    return quotas


def epoch_samples(sources: Any, weights: Sequence[float], seed: int, epoch: int) -> list[int]:
    """Corpus indices of the epoch's samples (a sample may appear more than once), grouped by source."""
    src = _as_list(sources)
    members: list[list[int]] = [[] for _ in weights]
    for i, s in enumerate(src):
        members[s].append(i)
    quotas = source_quotas([len(m) for m in members], weights, len(src))
    out: list[int] = []
    for s, (pool, quota) in enumerate(zip(members, quotas)):
        rng = random.Random(f"dflash-ipc/mix/{seed}/{epoch}/{s}")
        while quota > 0:
            order = list(pool)
            rng.shuffle(order)
            out.extend(order[:quota])
            quota -= min(quota, len(order))
    return out


def mix_report(lengths: Any, sources: Any, paths: Sequence[str], weights: Sequence[float], seed: int, epochs: int) -> list[dict]:
    """Per epoch and source: weight, records and tokens drawn, distinct records, and passes over the source."""
    lens, src = _as_list(lengths), _as_list(sources)
    counts = [src.count(s) for s in range(len(paths))]
    out = []
    for epoch in range(epochs):
        drawn = epoch_samples(src, weights, seed, epoch)
        total_tokens = sum(lens[i] for i in drawn) or 1
        per = []
        for s, path in enumerate(paths):
            mine = [i for i in drawn if src[i] == s]
            tokens = sum(lens[i] for i in mine)
            per.append(
                {
                    "source": path,
                    "weight": weights[s],
                    "available": counts[s],
                    "records": len(mine),
                    "distinct": len(set(mine)),
                    "passes": round(len(mine) / counts[s], 3) if counts[s] else 0.0,
                    "tokens": tokens,
                    "records_pct": round(100 * len(mine) / max(len(drawn), 1), 2),
                    "tokens_pct": round(100 * tokens / total_tokens, 2),
                }
            )
        out.append({"epoch": epoch, "records": len(drawn), "sources": per})
    return out


def mix_line(report: list[dict], max_epochs: int = 3) -> str:
    """The realised mix in one line for the ``up`` log."""
    parts = []
    for e in report[:max_epochs]:
        srcs = ", ".join(
            f"{s['source']} {s['records']} rec ({s['records_pct']} %) {s['tokens']} tok ({s['tokens_pct']} %)" for s in e["sources"]
        )
        parts.append(f"epoch {e['epoch']}: {srcs}")
    more = f"; ... {len(report) - max_epochs} more epochs alike" if len(report) > max_epochs else ""
    return "mix " + "; ".join(parts) + more
