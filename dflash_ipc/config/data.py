"""Where training data comes from and how it is batched: ``[data]`` (files, the mix, batching),
``[synth]`` (prompts the target writes itself, read by ``dflash-ipc gen-data --prompts synth:N``) and
``[chat_template]`` (the keyword arguments every chat-template rendering gets).

``[chat_template]`` kwargs, e.g. ``kwargs = { enable_thinking = false }`` for Qwen3-family templates,
reach every place that renders a chat with the tokenizer's template, through
:func:`dflash_ipc.data.tokenizer.config_tokenizer`: gen-data's prompts, the training corpus (the
rendered text decides the loss mask: template text is never supervised), the supervisor's data
plan, and eval's prompts. The export records them (``chat_template_kwargs`` in
``export/drafter/config.json``) and eval refuses a drafter whose recorded kwargs differ from the
config's: a drafter trained with thinking on and served with it off sees other prompts than it
learned (a known cause of collapsed acceptance).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_ipc.config.fields import MAX_SEED, require

__all__ = [
    "BUILTIN_CORPORA",
    "MAX_BUILTIN_SAMPLES",
    "MAX_EPOCHS",
    "RESERVED_KWARGS",
    "ChatTemplateConfig",
    "DataConfig",
    "SynthConfig",
    "check_mix_weights",
]

# The corpora a "builtin:" path may name (dflash_ipc.data.builtin_corpus builds them).
BUILTIN_CORPORA = ("builtin:stdlib-docs",)
# The built-in corpus is for trying the pipeline offline; real data comes from files. Its samples are built in
# memory before training starts: 100000 take about a minute; 10**12 would never finish.
MAX_BUILTIN_SAMPLES = 100_000
# Every epoch's plan is drawn before the run starts (the probe counts the batches of all of them).
MAX_EPOCHS = 1000


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=lambda: ["builtin:stdlib-docs"])
    """Training data: chat-record files (JSONL, .jsonl.gz, Parquet, a saved Hugging Face dataset folder), or
    "builtin:stdlib-docs" for the bundled offline corpus."""
    on_bad_line: Literal["skip", "error"] = "skip"
    """A malformed record: "skip" it (counted and reported with FILE:LINE) or refuse the file ("error")."""
    max_seq_len: int = 2048
    """Longest sequence in tokens; longer conversations are cut to it."""
    bucket_edges: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    """Length buckets (strictly increasing, the last = ``max_seq_len``): a batch holds sequences of one bucket."""
    token_budget: int = 16384
    """Tokens per batch (padding included), at least ``max_seq_len``; sizes each ring slot."""
    max_batch_size: int = 64
    """Most sequences in one batch."""
    num_epochs: int = 1
    """Passes over the data (with ``weights``: how many epochs' worth the mix draws), 1..1000."""
    cache_dir: str = ""
    """Where the tokenized corpus is cached, keyed by the data's content; empty: ``RUN_DIR/data``. Made 0700 (files
    0600); a directory of another user, or one other users can write, is refused."""
    builtin_samples: int = 2000
    """Size of the built-in corpus (conversations), 1..100000; only with a "builtin:" path."""
    holdout_paths: list[str] = field(default_factory=list)
    """Held-out chat data (gen-data's ``OUT.holdout.jsonl``), never trained on: ``training.holdout_every`` measures
    tau_holdout on it."""
    weights: list[float] = field(default_factory=list)
    """The mix: one weight >= 0 per ``paths`` entry, each path's share of the batches; empty: every sample once an
    epoch."""

    def __post_init__(self) -> None:
        require(len(self.paths) >= 1, "paths", 'needs at least one JSONL path or "builtin:stdlib-docs"')
        require(self.max_seq_len >= 8, "max_seq_len", "must be >= 8 tokens")
        require(len(self.bucket_edges) >= 1, "bucket_edges", "needs at least one edge")
        require(
            all(b > a for a, b in zip(self.bucket_edges, self.bucket_edges[1:])),
            "bucket_edges",
            f"must be strictly increasing (got {self.bucket_edges})",
        )
        require(self.bucket_edges[0] >= 2, "bucket_edges", "edges must be >= 2 tokens")
        require(
            self.bucket_edges[-1] == self.max_seq_len,
            "bucket_edges",
            f"the last edge must equal data.max_seq_len ({self.max_seq_len}); got {self.bucket_edges[-1]}",
        )
        require(
            self.token_budget >= self.max_seq_len,
            "token_budget",
            f"must be >= data.max_seq_len ({self.max_seq_len}) so the longest sequence fits one batch",
        )
        require(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        require(1 <= self.num_epochs <= MAX_EPOCHS, "num_epochs", f"must be >= 1 and at most {MAX_EPOCHS} (got {self.num_epochs})")
        require(
            1 <= self.builtin_samples <= MAX_BUILTIN_SAMPLES,
            "builtin_samples",
            f"must be >= 1 and at most {MAX_BUILTIN_SAMPLES} (got {self.builtin_samples}): the built-in corpus is for trying "
            "the pipeline; train on files for more",
        )
        for key, paths in (("paths", self.paths), ("holdout_paths", self.holdout_paths)):
            for i, p in enumerate(paths):
                require(
                    not p.startswith("builtin:") or p in BUILTIN_CORPORA,
                    f"{key}[{i}]",
                    f"{p!r} is no built-in corpus; the built-in ones: {', '.join(BUILTIN_CORPORA)}",
                )
        check_mix_weights(self.paths, self.weights)


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


@dataclass
class SynthConfig:
    """Sampling of user requests from the chat template's pre-query prefix (Magpie, arXiv 2406.08464)."""

    temperature: float = 1.0
    """Sampling temperature of the requests (> 0)."""
    top_p: float = 0.95
    """Nucleus of the request sampling, in (0, 1]."""
    max_prompt_tokens: int = 192
    """A request still running at this many tokens is "unfinished"."""
    drop_unfinished: bool = True
    """Drop requests that never reached the end-of-turn token."""
    min_chars: int = 12
    """Shortest kept request, in characters (stripped)."""
    max_chars: int = 2000
    """Longest kept request, in characters (stripped)."""
    system_prompts: list[str] = field(default_factory=list)
    """Steering: each sampling batch renders the next of these system prompts (round robin) before the user turn;
    "{topic}" in one is filled from ``topics`` in turn. Empty: the template's own default."""
    topics: list[str] = field(default_factory=list)
    """Topics filled into the "{topic}" of ``system_prompts``, in turn."""
    seed: int = 0
    """Seed of the request sampling, 0 .. 2**32 - 1."""
    near_dup_threshold: float = 0.7
    """Near-duplicates: a request whose word 3-gram Jaccard similarity to a kept one is at least this is dropped
    (1: exact duplicates only)."""
    num_perm: int = 64
    """MinHash permutations that find near-duplicate candidates."""
    lsh_bands: int = 16
    """LSH bands over the MinHash (must divide ``num_perm``)."""
    min_distinct_3gram_ratio: float = 0.5
    """Degenerate repetition: a request of >= 12 words whose distinct word 3-grams / all are below this is dropped."""
    max_char_run: int = 24
    """A request with a run of one character longer than this is dropped."""
    max_draws_per_prompt: float = 4.0
    """Give up after this many samples per request asked for."""
    max_seconds: float = 0.0
    """Stop sampling after this long (a time budget; the run resumes later); 0: no limit."""
    multi_turn_fraction: float = 0.0
    """Share of answered requests for which the target also writes a next user turn and answers it (0: single turn)."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.temperature) and self.temperature > 0, "temperature", "must be > 0 (synthesis samples)")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (got {self.top_p})")
        require(self.max_prompt_tokens >= 4, "max_prompt_tokens", "must be >= 4")
        require(0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, 2**32 - 1] (got {self.seed})")
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


# Names ``apply_chat_template`` takes itself or passes to every template: a kwarg of the same name
# would silently replace the conversation, the generation prompt or a special token.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
    }
)


@dataclass
class ChatTemplateConfig:
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the tokenizer's chat template (template variables), e.g. ``{ enable_thinking = false }``;
    every rendering gets them: gen-data, training, the plan, eval, and the export records them."""

    def __post_init__(self) -> None:
        for key, value in self.kwargs.items():
            require(key.isidentifier(), "kwargs", f"{key!r} is not a template variable name (letters, digits, _)")
            require(key not in RESERVED_KWARGS, "kwargs", f"{key!r} is set by apply_chat_template itself; remove it")
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                require(False, "kwargs", f"{key} = {value!r}: only strings, numbers, booleans, arrays and tables")
