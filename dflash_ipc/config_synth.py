"""Config of where training data comes from beyond ``data.paths``: prompt synthesis by the target
(the ``[synth]`` section, read by ``dflash-ipc gen-data --prompts synth:N``) and the check of the
data mix (``data.weights``). Kept apart from :mod:`dflash_ipc.config` (one field wires each in)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash_ipc.config_fields import require


@dataclass
class SynthConfig:
    # Sampling of user requests from the chat template's pre-query prefix (Magpie, arXiv 2406.08464).
    temperature: float = 1.0
    top_p: float = 0.95
    max_prompt_tokens: int = 192  # a sample still running at this many tokens is "unfinished"
    drop_unfinished: bool = True  # drop samples that never reached the end-of-turn token
    min_chars: int = 12
    max_chars: int = 2000
    # Steering: each sampling batch renders the next system prompt of this list (round robin) before the
    # user turn; empty: the template's own default. "{topic}" in one is filled from `topics` in turn.
    system_prompts: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    seed: int = 0
    # Near-duplicates: word 3-gram shingles, MinHash (num_perm hashes in bands of rows) for candidates,
    # then the exact Jaccard similarity; a prompt at or above the threshold to a kept one is dropped.
    near_dup_threshold: float = 0.7
    num_perm: int = 64
    lsh_bands: int = 16
    # Degenerate repetition: distinct word 3-grams / all, below this (texts of >= 12 words) is dropped;
    # as is a run of one character longer than max_char_run.
    min_distinct_3gram_ratio: float = 0.5
    max_char_run: int = 24
    max_draws_per_prompt: float = 4.0  # give up after this many samples per prompt asked for
    max_seconds: float = 0.0  # stop sampling after this long (a time budget; the run resumes later); 0: no limit
    # Multi-turn: the target also writes a next user turn after its own answer, then answers it;
    # the fraction of answered prompts that get one (0: single-turn only).
    multi_turn_fraction: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature > 0, "temperature", "must be > 0 (synthesis samples)")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (got {self.top_p})")
        require(self.max_prompt_tokens >= 4, "max_prompt_tokens", "must be >= 4")
        require(self.min_chars >= 1, "min_chars", "must be >= 1")
        require(self.max_chars > self.min_chars, "max_chars", f"must be > synth.min_chars ({self.min_chars})")
        require(0 < self.near_dup_threshold <= 1, "near_dup_threshold", "must be in (0, 1] (1: exact duplicates only)")
        require(self.num_perm >= 1, "num_perm", "must be >= 1")
        require(
            1 <= self.lsh_bands <= self.num_perm and self.num_perm % self.lsh_bands == 0,
            "lsh_bands",
            f"must divide synth.num_perm ({self.num_perm})",
        )
        require(0 <= self.min_distinct_3gram_ratio <= 1, "min_distinct_3gram_ratio", "must be in [0, 1]")
        require(self.max_char_run >= 2, "max_char_run", "must be >= 2")
        require(self.max_draws_per_prompt >= 1, "max_draws_per_prompt", "must be >= 1")
        require(math.isfinite(self.max_seconds) and self.max_seconds >= 0, "max_seconds", "must be >= 0 (0: no time limit)")
        require(0 <= self.multi_turn_fraction <= 1, "multi_turn_fraction", "must be in [0, 1]")
        require(
            not self.topics or any("{topic}" in s for s in self.system_prompts),
            "topics",
            'needs a synth.system_prompts entry with "{topic}" in it, where each topic goes',
        )


def check_mix_weights(paths: list[str], weights: list[float]) -> None:
    """``data.weights``: empty (every sample once per epoch), or one weight >= 0 per ``data.paths`` entry, sum > 0."""
    if not weights:
        return
    require(
        len(weights) == len(paths),
        "weights",
        f"has {len(weights)} entries for {len(paths)} data.paths: give one weight per path, in the same order",
    )
    bad = [w for w in weights if not (math.isfinite(w) and w >= 0)]
    require(not bad, "weights", f"must be finite and >= 0 (got {bad[0] if bad else ''})")
    require(sum(weights) > 0, "weights", "sum to 0: give at least one path a weight > 0")
