"""The drafter's output vocabulary: the target's most frequent answer tokens (``drafter.draft_vocab_size``).

The drafter predicts with the target's frozen LM head. Over a 49k-151k vocabulary that head and its
cross-entropy are the largest part of a drafter step, while a few thousand tokens make up almost all
of what the target writes (EAGLE-3's draft vocabulary, FR-Spec's frequency-ranked head). With
``drafter.draft_vocab_size = N`` the drafter's head keeps the ``N`` rows of the target's most
frequent supervised tokens in the training data; a draft can then only propose those tokens, so
a label outside them is a miss (acceptance counts it as one) and carries no loss.

Who writes and reads it::

    up -> probe: corpus tokenized -> RUN_DIR/draft_vocab.json   (kept as it is when it exists: a resumed
                                                                 run drafts over the same tokens)
    drafter (every rank, every node) reads RUN_DIR/draft_vocab.json -> the head's rows
    export: lm_head.weight (the rows) + d2t (row + d2t[row] = target id) + draft_vocab_size -> eval, vLLM

Each node's probe chooses from the same data with the same rule (count, then id), so nodes agree
without sending the list around.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ipc.rundir.fsutil import write_text_atomic

DRAFT_VOCAB_FILE = "draft_vocab.json"
#: the draft rows of exports written before they travelled as lm_head + d2t (still read by eval)
EXPORT_FILE = "draft_vocab.safetensors"
EXPORT_TENSOR = "draft_token_ids"


@dataclass(frozen=True)
class DraftVocab:
    """``token_ids``: ascending target token ids, the drafter head's rows in order."""

    token_ids: tuple[int, ...]
    vocab_size: int  # the target's
    coverage: float  # share of the supervised training tokens inside token_ids
    supervised_tokens: int

    def __post_init__(self) -> None:
        ids = self.token_ids
        if not ids:
            raise ValueError("a draft vocabulary needs at least one token")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError("draft vocabulary token ids must be strictly ascending")
        if ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"draft vocabulary token ids must lie in the target's vocabulary [0, {self.vocab_size})")

    @property
    def size(self) -> int:
        return len(self.token_ids)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(list(self.token_ids)).encode()).hexdigest()[:16]

    def tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.token_ids, dtype=torch.int64, device=device)

    def describe(self) -> str:
        return (
            f"draft vocabulary: {self.size} of {self.vocab_size} tokens, {100 * self.coverage:.2f} % of the "
            f"{self.supervised_tokens} supervised tokens (digest {self.digest()})"
        )

    def to_json(self) -> dict:
        return {
            "vocab_size": self.vocab_size,
            "coverage": self.coverage,
            "supervised_tokens": self.supervised_tokens,
            "token_ids": list(self.token_ids),
        }


def choose_draft_vocab(tokens: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int, size: int) -> DraftVocab:
    """The ``size`` most frequent supervised tokens (ties: the lower id first). When the data holds
    fewer distinct supervised tokens, the rest are filled with the lowest unused ids, so the head has
    the configured size whatever the data (a resumed run and its export agree on the shape)."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"drafter.draft_vocab_size must be between 1 and the target's vocabulary ({vocab_size}); got {size}")
    order, counts, total = _ranked(tokens, loss_mask, vocab_size)
    chosen = order[:size]
    covered = int(counts[chosen].sum())
    return DraftVocab(tuple(sorted(int(i) for i in chosen)), vocab_size, covered / total if total else 0.0, total)


def coverage_by_size(tokens: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int, sizes: list[int]) -> dict[int, float]:
    """:func:`choose_draft_vocab`'s coverage at each size, from one count and one ranking."""
    order, counts, total = _ranked(tokens, loss_mask, vocab_size)
    covered = torch.cumsum(counts[order], 0)
    return {n: int(covered[n - 1]) / total if total else 0.0 for n in sizes}


def _ranked(tokens: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids by descending count, ties by ascending id; counts per id; supervised tokens)."""
    supervised = tokens[loss_mask.bool()].to(torch.int64)
    if supervised.numel() and (int(supervised.min()) < 0 or int(supervised.max()) >= vocab_size):
        raise ValueError(f"supervised token ids outside the target's vocabulary [0, {vocab_size})")
    counts = torch.bincount(supervised, minlength=vocab_size)
    # stable sort on -count keeps ascending ids among equal counts
    return torch.sort(-counts, stable=True).indices, counts, int(supervised.numel())


def write_draft_vocab(path: Path, vocab: DraftVocab) -> None:
    """Atomically and durably (a resumed run reads it back), private to the user (mkstemp's 0600)."""
    write_text_atomic(path, json.dumps(vocab.to_json()) + "\n", durable=True)


def read_draft_vocab(path: Path) -> DraftVocab:
    try:
        d = json.loads(path.read_text())
        return DraftVocab(tuple(int(i) for i in d["token_ids"]), int(d["vocab_size"]), float(d["coverage"]), int(d["supervised_tokens"]))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: not found; drafter.draft_vocab_size > 0 drafts over the vocabulary `up` chooses from the data "
            "into the run directory before any process starts"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a draft vocabulary ({type(e).__name__}: {e}); remove it to choose again from the data") from None


def ensure_draft_vocab(run_dir: Path, tokens: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int, size: int) -> DraftVocab:
    """The run's draft vocabulary: the one already in ``run_dir`` (a resumed run keeps its head), else
    chosen from the data now and written there. A kept one of another size is refused."""
    path = run_dir / DRAFT_VOCAB_FILE
    if path.exists():
        vocab = read_draft_vocab(path)
        if vocab.size != size or vocab.vocab_size != vocab_size:
            raise ValueError(
                f"drafter.draft_vocab_size: {path} holds {vocab.size} tokens of a {vocab.vocab_size}-token vocabulary, "
                f"the config asks for {size} of {vocab_size}; a run keeps its draft vocabulary (use another run directory)"
            )
        return vocab
    vocab = choose_draft_vocab(tokens, loss_mask, vocab_size, size)
    write_draft_vocab(path, vocab)
    return vocab
