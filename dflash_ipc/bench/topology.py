"""Topology advice: the target:drafter split of N GPUs that maximises trained tokens/s.

A :class:`Profile` holds the two measured per-GPU rates: one target GPU forwards
``target_tokens_per_s`` (its forward rate on real batches), one drafter GPU trains on
``drafter_tokens_per_s`` while busy (its step rate x tokens per batch, waiting excluded). With
``t`` targets and ``d = N - t`` drafters (data parallel, lockstep) the pipeline runs at::

    tokens/s = min(t * target_tokens_per_s, d * drafter_tokens_per_s)

and the faster side idles ``1 - tokens/s / its own capacity`` of the time. The model assumes
linear scaling on both sides: targets are independent, and the drafters' gradient all-reduce
overlaps backward (a drafter step that grows with ``d`` shows up in a profile measured at
that ``d``). Pure arithmetic, no torch: ``bench pipeline`` writes a profile, ``dflash-ipc plan
--topology N --profile FILE`` reads one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    target_tokens_per_s: float  # one target GPU, forward only, real tokens
    drafter_tokens_per_s: float  # one drafter GPU while busy (no waiting)
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("target_tokens_per_s", "drafter_tokens_per_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"profile: {key} must be a positive number (got {value!r})")

    @classmethod
    def from_step_times(cls, tokens_per_batch: int, target_batch_s: float, drafter_step_s: float, source: str = "") -> Profile:
        """From one target forward and one drafter step over a batch of ``tokens_per_batch`` tokens."""
        if tokens_per_batch < 1 or not (target_batch_s > 0) or not (drafter_step_s > 0):
            raise ValueError("profile: tokens_per_batch, target_batch_s and drafter_step_s must be positive")
        return cls(tokens_per_batch / target_batch_s, tokens_per_batch / drafter_step_s, source)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "") -> Profile:
        """``{target_tokens_per_s, drafter_tokens_per_s}``, or ``{tokens_per_batch, target_batch_s,
        drafter_step_s}``, either at the top level or under ``"profile"`` (a saved ``bench pipeline`` result)."""
        if isinstance(raw.get("profile"), dict):
            raw = raw["profile"]
        if "target_tokens_per_s" in raw and "drafter_tokens_per_s" in raw:
            return cls(raw["target_tokens_per_s"], raw["drafter_tokens_per_s"], raw.get("source", source))
        if all(k in raw for k in ("tokens_per_batch", "target_batch_s", "drafter_step_s")):
            return cls.from_step_times(raw["tokens_per_batch"], raw["target_batch_s"], raw["drafter_step_s"], raw.get("source", source))
        raise ValueError(
            "profile: expected target_tokens_per_s and drafter_tokens_per_s, or tokens_per_batch, target_batch_s "
            f"and drafter_step_s (found keys {sorted(raw)})"
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read a profile: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a profile is a JSON object")
        return cls.from_dict(raw, source=str(path))


@dataclass(frozen=True)
class Split:
    targets: int
    drafters: int
    tokens_per_s: float
    bound_by: str  # "target" | "drafter" | "balanced"
    target_idle_pct: float
    drafter_idle_pct: float


def evaluate(profile: Profile, targets: int, drafters: int) -> Split:
    t_cap = targets * profile.target_tokens_per_s
    d_cap = drafters * profile.drafter_tokens_per_s
    rate = min(t_cap, d_cap)
    bound = "balanced" if math.isclose(t_cap, d_cap, rel_tol=1e-9) else ("target" if t_cap < d_cap else "drafter")
    return Split(targets, drafters, rate, bound, 100.0 * (1 - rate / t_cap), 100.0 * (1 - rate / d_cap))


def splits(profile: Profile, n_gpus: int) -> list[Split]:
    """Every split with at least one target and one drafter, fewest targets first."""
    if n_gpus < 2:
        raise ValueError(f"a pipeline needs at least 2 GPUs (one target, one drafter); got {n_gpus}")
    return [evaluate(profile, t, n_gpus - t) for t in range(1, n_gpus)]


def best_split(profile: Profile, n_gpus: int) -> Split:
    """The split with the most tokens/s; among equals, the one whose GPUs idle least in total."""

    def rank(s: Split) -> tuple[float, float]:
        return round(s.tokens_per_s, 6), -(s.target_idle_pct * s.targets + s.drafter_idle_pct * s.drafters)

    return max(splits(profile, n_gpus), key=rank)


def advice(profile: Profile, n_gpus: int) -> dict:
    """JSON-ready: the best split and the table of all splits."""
    best = best_split(profile, n_gpus)
    return {"n_gpus": n_gpus, "profile": asdict(profile), "best": asdict(best), "splits": [asdict(s) for s in splits(profile, n_gpus)]}


def format_table(profile: Profile, n_gpus: int) -> str:
    best = best_split(profile, n_gpus)
    lines = [
        f"{n_gpus} GPUs; one target {profile.target_tokens_per_s:,.0f} tok/s, one drafter {profile.drafter_tokens_per_s:,.0f} tok/s busy",
        f"{'targets+drafters':>17} {'tokens/s':>10} {'bound by':>9} {'target idle':>12} {'drafter idle':>13}",
    ]
    for s in splits(profile, n_gpus):
        mark = "  <- best" if s == best else ""
        lines.append(
            f"{f'{s.targets}+{s.drafters}':>17} {s.tokens_per_s:>10,.0f} {s.bound_by:>9} {s.target_idle_pct:>11.1f}% "
            f"{s.drafter_idle_pct:>12.1f}%{mark}"
        )
    return "\n".join(lines)
