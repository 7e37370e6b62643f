"""Filters for synthesized user requests, and the diversity report of the prompts kept.

Each sampled request passes, in order (the first that fails names the reason it is dropped):

* ``unfinished``: sampling stopped at ``synth.max_prompt_tokens`` before the end-of-turn token
  (when ``synth.drop_unfinished``): a cut request has no real end;
* ``too_short`` / ``too_long``: its stripped text outside ``[synth.min_chars, synth.max_chars]``;
* ``leak``: template leakage, i.e. a special token of the tokenizer, a chat-template control string
  (``<|``, ``|>``, ``[INST]``, ``<s>``...) or a line opening with a role name (``assistant:``, ``### Response``):
  the model wrote a turn of the conversation instead of a request;
* ``degenerate``: degenerate repetition, i.e. fewer than ``synth.min_distinct_3gram_ratio`` of its word
  3-grams distinct (texts of 12 words or more), or one character repeated more than ``synth.max_char_run`` times;
* ``exact_dup``: the same text as a kept request after case folding and whitespace collapsing;
* ``near_dup``: word 3-gram shingles with Jaccard similarity >= ``synth.near_dup_threshold`` to a kept
  request. Candidates come from MinHash LSH (``synth.num_perm`` hashes in ``synth.lsh_bands`` bands),
  each checked by the exact Jaccard similarity, so LSH can only miss a near-duplicate, never invent one.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable

import torch

from dflash_ipc.config.data import SynthConfig

__all__ = ["DROP_REASONS", "PromptFilter", "diversity_report", "format_report", "normalize", "shingles"]

DROP_REASONS = ("unfinished", "too_short", "too_long", "leak", "degenerate", "exact_dup", "near_dup")
_CONTROL_STRINGS = ("<|", "|>", "[INST]", "[/INST]", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>")
_ROLE_LINE = re.compile(r"(?im)^\s*(?:#+\s*)?(?:user|assistant|system|human|gpt|response|instruction)\s*[:\]]")
_WORD = re.compile(r"\w+(?:'\w+)?")
_MERSENNE = (1 << 61) - 1
_MIN_WORDS_FOR_REPETITION = 12


def normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def words(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def shingles(text: str, n: int = 3) -> set[str]:
    """Word n-grams of the text; a text of fewer than n words is one shingle of all its words."""
    w = words(text)
    if len(w) < n:
        return {" ".join(w)}
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


def _shingle_hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big") % _MERSENNE


def _longest_char_run(text: str) -> int:
    best = run = 0
    prev = ""
    for ch in text:
        run = run + 1 if ch == prev and not ch.isspace() else 1
        prev = ch
        best = max(best, run)
    return best


class PromptFilter:
    """The filters above, with the index of kept requests (exact keys and MinHash LSH buckets)."""

    def __init__(self, cfg: SynthConfig, special_tokens: Iterable[str] = (), dedup: bool = True):
        self.cfg = cfg
        self.dedup = dedup  # False: no duplicate checks (follow-up turns, whose contexts differ)
        self.markers = sorted({t for t in special_tokens if t} | set(_CONTROL_STRINGS))
        self.dropped: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.kept = 0
        self._exact: set[str] = set()
        self._shingles: list[set[str]] = []
        self._buckets: dict[tuple[int, bytes], list[int]] = {}
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + 17)
        # universal hashing h(x) = (a x + b) mod p, p the Mersenne prime 2**61 - 1; products stay in int64
        # because the shingle hashes and a are reduced below 2**31 first
        self._a = torch.randint(1, 1 << 31, (cfg.num_perm,), generator=gen, dtype=torch.int64)
        self._b = torch.randint(0, 1 << 31, (cfg.num_perm,), generator=gen, dtype=torch.int64)

    def minhash(self, sh: set[str]) -> torch.Tensor:
        x = torch.tensor([_shingle_hash(s) % (1 << 31) for s in sorted(sh)], dtype=torch.int64)
        return ((x[:, None] * self._a[None, :] + self._b[None, :]) % _MERSENNE).min(dim=0).values

    def _bands(self, sig: torch.Tensor) -> list[tuple[int, bytes]]:
        rows = self.cfg.num_perm // self.cfg.lsh_bands
        return [(k, sig[k * rows : (k + 1) * rows].numpy().tobytes()) for k in range(self.cfg.lsh_bands)]

    def reason(self, text: str, finished: bool = True) -> str | None:
        """Why ``text`` is dropped (one of :data:`DROP_REASONS`), or None: it is kept and indexed."""
        why = self._check(text, finished)
        if why is None:
            self.kept += 1
        else:
            self.dropped[why] += 1
        return why

    def add_kept(self, text: str) -> None:
        """Index a request kept earlier (a resumed run), without filtering or counting it."""
        t = text.strip()
        self._index(normalize(t), shingles(t))

    def _index(self, key: str, sh: set[str], bands: list[tuple[int, bytes]] | None = None) -> None:
        self._exact.add(key)
        idx = len(self._shingles)
        self._shingles.append(sh)
        if bands is None and self.cfg.near_dup_threshold < 1:
            bands = self._bands(self.minhash(sh))
        for band in bands or ():
            self._buckets.setdefault(band, []).append(idx)

    def _check(self, text: str, finished: bool) -> str | None:
        c = self.cfg
        if not finished and c.drop_unfinished:
            return "unfinished"
        t = text.strip()
        if len(t) < c.min_chars:
            return "too_short"
        if len(t) > c.max_chars:
            return "too_long"
        if any(m in t for m in self.markers) or _ROLE_LINE.search(t):
            return "leak"
        w = words(t)
        if len(w) >= _MIN_WORDS_FOR_REPETITION:
            grams = [tuple(w[i : i + 3]) for i in range(len(w) - 2)]
            if len(set(grams)) / len(grams) < c.min_distinct_3gram_ratio:
                return "degenerate"
        if _longest_char_run(t) > c.max_char_run:
            return "degenerate"
        if not self.dedup:
            return None
        key = normalize(t)
        if key in self._exact:
            return "exact_dup"
        sh = shingles(t)
        bands = self._bands(self.minhash(sh)) if c.near_dup_threshold < 1 else []
        candidates = {j for band in bands for j in self._buckets.get(band, ())}
        for j in candidates:
            other = self._shingles[j]
            if len(sh & other) / len(sh | other) >= c.near_dup_threshold:
                return "near_dup"
        self._index(key, sh, bands)
        return None


_CHAR_EDGES = (25, 50, 100, 200, 400, 800, 1600)


def diversity_report(texts: list[str], dropped: dict[str, int], sampled: int) -> dict:
    """Figures of the kept requests: distinct n-gram ratios, length histogram, common first words, drops."""
    toks = [words(t) for t in texts]
    distinct = {}
    for n in (1, 2, 3):
        grams = [tuple(w[i : i + n]) for w in toks for i in range(len(w) - n + 1)]
        distinct[f"distinct_{n}"] = round(len(set(grams)) / len(grams), 4) if grams else 0.0
    hist: dict[str, int] = {}
    lo = 0
    for edge in (*_CHAR_EDGES, None):
        label = f"{lo}-{edge - 1}" if edge is not None else f">={lo}"
        hist[label] = sum(1 for t in texts if len(t) >= lo and (edge is None or len(t) < edge))
        lo = edge if edge is not None else lo
    lengths = sorted(len(t) for t in texts)
    first = Counter(w[0] for w in toks if w)
    return {
        "prompts": len(texts),
        "sampled": sampled,
        "kept_fraction": round(len(texts) / sampled, 4) if sampled else 0.0,
        "removed": {r: int(dropped.get(r, 0)) for r in DROP_REASONS},
        **distinct,
        "chars_mean": round(sum(lengths) / len(lengths), 1) if lengths else 0.0,
        "chars_median": lengths[len(lengths) // 2] if lengths else 0,
        "words_mean": round(sum(len(w) for w in toks) / len(toks), 1) if toks else 0.0,
        "chars_histogram": hist,
        "first_words": [[w, n] for w, n in first.most_common(20)],
    }


def format_report(r: dict) -> str:
    """A few lines for people."""
    removed = ", ".join(f"{k} {v}" for k, v in r["removed"].items() if v)
    firsts = ", ".join(f"{w} {n}" for w, n in r["first_words"][:10])
    return (
        f"synth: {r['prompts']} prompts kept of {r['sampled']} sampled ({100 * r['kept_fraction']:.1f} %); removed: {removed or 'none'}\n"
        f"synth: distinct 1/2/3-grams {r['distinct_1']:.3f} / {r['distinct_2']:.3f} / {r['distinct_3']:.3f}; "
        f"chars mean {r['chars_mean']}, median {r['chars_median']}; words mean {r['words_mean']}\n"
        f"synth: lengths (chars) {r['chars_histogram']}\n"
        f"synth: most common first words: {firsts}"
    )
