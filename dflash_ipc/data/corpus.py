"""Training data: JSONL chat/text files and the offline ``builtin:stdlib-docs`` corpus
(:mod:`dflash_ipc.data.builtin_corpus`), tokenized once into flat tensors and cached.

Input lines (one JSON object per line)::

    {"conversations": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"messages": [...]}                      # same as "conversations"
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}  # ShareGPT
    {"text": "..."}                          # plain text: every token supervised

Parquet files and ``datasets`` saved folders hold the same records as rows (:mod:`dflash_ipc.data.readers`).

Chats are cut into supervised and unsupervised pieces by :mod:`dflash_ipc.data.chat_pieces` (the loss
mask rule, and a final assistant turn that carries the target's ``token_ids``).

Sequences are truncated to ``data.max_seq_len``; sequences without two consecutive
supervised tokens are dropped (counted in the report). A record's text is cut to
``data.max_seq_len * MAX_CHARS_PER_TOKEN`` characters *before* it is tokenized, so a huge line
costs no more than a long one (a 19 MB line took 3.6 GB to tokenize whole). Bad lines
(invalid UTF-8 or JSON, JSON nested too deeply to parse, wrong fields) are skipped and
reported as ``file:line: reason``, or refused with :class:`DataError` when
``on_bad_line = "error"``.

The result is cached in ``cache_dir`` (:mod:`dflash_ipc.data.token_cache`: keyed by the input files'
content, private to the user).
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.config import DataConfig
from dflash_ipc.data.builtin_corpus import BUILTIN_STDLIB_DOCS, builtin_conversations
from dflash_ipc.data.chat_pieces import Piece, chat_pieces
from dflash_ipc.data.chat_render import closing_texts
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.readers import is_table_source, iter_table_records
from dflash_ipc.data.records import VOCAB_FIELD, BadRecord, answer_token_ids, parse_record
from dflash_ipc.data.token_cache import cache_file_name, cache_key, open_cache_dir, read_cached, write_cache
from dflash_ipc.data.tokenizer import stop_token_ids, vocab_identity

log = logging.getLogger("dflash_ipc.data.corpus")

MAX_REPORTED_BAD_LINES = 1000
_CHUNK = 256  # records tokenized per batched tokenizer call
_CHUNK_CHARS = 1 << 20  # ... or fewer, once their text reaches this many characters (tokenizing costs ~200 B/char)
# Characters kept per token of data.max_seq_len before tokenizing. Text averages 3-5 characters
# per token (prose, code); 32 leaves a wide margin, so a record cut here still fills max_seq_len
# tokens and truncation keeps exactly what it kept from the whole text. Only a record averaging
# more than 32 characters per token (long runs of one character) can end up shorter.
MAX_CHARS_PER_TOKEN = 32


# --------------------------------------------------------------------------- report / corpus


@dataclass
class DataReport:
    sources: list[str] = field(default_factory=list)
    lines_read: int = 0
    records: int = 0  # well-formed lines / built-in conversations
    samples: int = 0  # kept sequences
    num_bad_lines: int = 0
    bad_lines: list[str] = field(default_factory=list)  # "file:line: reason", first MAX_REPORTED_BAD_LINES
    dropped_no_supervision: int = 0
    truncated: int = 0  # kept sequences cut to max_seq_len
    tokens: int = 0
    supervised_tokens: int = 0
    loaded_from_cache: bool = False
    cache_path: str = ""
    source_digests: list[str | None] = field(default_factory=list)  # each data.paths entry's content (token_cache)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        src = "cache " + self.cache_path if self.loaded_from_cache else ", ".join(self.sources)
        return (
            f"{self.samples} samples, {self.tokens} tokens ({self.supervised_tokens} supervised) from {src}; "
            f"{self.lines_read} lines read, {self.num_bad_lines} bad lines skipped, "
            f"{self.dropped_no_supervision} dropped without supervision, {self.truncated} truncated"
        )


class Corpus:
    """Tokenized samples stored flat: ``tokens[offsets[i]:offsets[i+1]]`` is sample ``i``, read from
    ``data.paths[sources[i]]``."""

    def __init__(self, tokens, loss_mask, offsets, report: DataReport, sources: torch.Tensor | None = None):
        if tokens.shape != loss_mask.shape or offsets.ndim != 1 or int(offsets[-1]) != tokens.numel():
            raise ValueError("inconsistent corpus tensors")
        self.sources = sources if sources is not None else torch.zeros(offsets.numel() - 1, dtype=torch.int32)
        if self.sources.shape != (offsets.numel() - 1,):
            raise ValueError("inconsistent corpus tensors: one source per sample")
        self.tokens = tokens  # int32 [N]
        self.loss_mask = loss_mask  # uint8 [N]
        self.offsets = offsets  # int64 [num_samples + 1]
        self.lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
        self.report = report

    @property
    def num_samples(self) -> int:
        return int(self.lengths.numel())

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids int64 [L], loss_mask uint8 [L])`` of sample ``i``."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range (corpus has {self.num_samples})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].to(torch.int64), self.loss_mask[a:b].clone()

    def collate(self, indices: list[int] | tuple[int, ...], pad_token_id: int, padded_len: int | None = None):
        """Right-padded ``(input_ids int64 [B, T], loss_mask uint8 [B, T], lengths int64 [B])``;
        ``T`` = ``padded_len`` or the longest sample. Padding carries loss mask 0."""
        lens = [int(self.lengths[i]) for i in indices]
        t = padded_len if padded_len is not None else max(lens)
        if t < max(lens):
            raise ValueError(f"padded_len {t} is shorter than the longest sample ({max(lens)})")
        ids = torch.full((len(indices), t), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(indices), t), dtype=torch.uint8)
        for row, i in enumerate(indices):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            ids[row, : b - a] = self.tokens[a:b]
            mask[row, : b - a] = self.loss_mask[a:b]
        return ids, mask, torch.tensor(lens, dtype=torch.int64)


# --------------------------------------------------------------------------- tokenization


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    out = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
    return out["input_ids"]


class _Builder:
    def __init__(self, cfg: DataConfig, tokenizer, report: DataReport):
        self.cfg = cfg
        self.tok = tokenizer
        self.report = report
        self.closings = closing_texts(tokenizer, stop_token_ids(tokenizer))  # the tokens that close a turn the target ends
        self.vocab_size = len(tokenizer)
        self.vocab: str | None = None  # vocab_identity, computed at the first record that stores ids
        self.pending: list[tuple[str, list[Piece], bool, int]] = []  # (where, pieces, cut before tokenizing, source)
        self.source = 0  # index in data.paths of the records being added
        self.pending_chars = 0
        self.max_chars = cfg.max_seq_len * MAX_CHARS_PER_TOKEN
        self.tok_buf = array("i")  # int32 token ids of all kept samples, flat
        self.mask_buf = array("B")  # uint8 loss mask, flat
        self.lengths: list[int] = []
        self.sources: list[int] = []

    def bad(self, where: str, reason: str) -> None:
        msg = f"{where}: {reason}"
        if self.cfg.on_bad_line == "error":
            raise DataError(f'{msg} (data.on_bad_line = "error"; fix the line or set on_bad_line = "skip")')
        r = self.report
        r.num_bad_lines += 1
        if len(r.bad_lines) < MAX_REPORTED_BAD_LINES:
            r.bad_lines.append(msg)
        if r.num_bad_lines <= 20:
            log.warning("skipping bad data line %s", msg)

    def add(self, where: str, obj: Any) -> None:
        try:
            kind, value = parse_record(obj)
            if kind == "chat":
                cut_at_end = obj.get("finish") == "length"
                ids = answer_token_ids(value, self.vocab_size)
                if ids is not None:
                    self.check_vocab(obj)
                pieces = chat_pieces(value, self.tok, self.closings, cut_at_end, answer_ids=ids)
            else:
                pieces = [(value, True)]
        except BadRecord as e:
            self.bad(where, str(e))
            return
        except RecursionError:
            self.bad(where, "nested too deeply")
            return
        self.report.records += 1
        pieces, cut = _clip_pieces(pieces, self.max_chars)
        self.pending.append((where, pieces, cut, self.source))
        self.pending_chars += sum(len(t) for t, _ in pieces if isinstance(t, str))
        if len(self.pending) >= _CHUNK or self.pending_chars >= _CHUNK_CHARS:
            self.flush()

    def check_vocab(self, obj: dict) -> None:
        stamp = obj.get(VOCAB_FIELD)
        if stamp is None:
            return
        if self.vocab is None:
            self.vocab = vocab_identity(self.tok)
        if stamp != self.vocab:
            raise BadRecord(
                f'its token ids belong to another vocabulary ("{VOCAB_FIELD}" {str(stamp)[:23]}, this tokenizer\'s {self.vocab[:23]}): '
                "regenerate it with gen-data for this target, or drop token_ids to use the text"
            )

    def _encode_pending(self) -> list[list[list[int]] | None]:
        """Each pending record's text pieces tokenized, None for a record the tokenizer refuses: one
        batched call, or record by record when the batch is refused, so one bad line costs only itself."""
        texts = [[t for t, _ in pieces if isinstance(t, str)] for _, pieces, _, _ in self.pending]
        try:
            flat = iter(_encode_batch(self.tok, [t for ts in texts for t in ts]))
            return [[next(flat) for _ in ts] for ts in texts]
        except Exception:  # noqa: BLE001 - tokenizers raise TypeError, ValueError, ... for input they cannot take
            pass
        out: list[list[list[int]] | None] = []
        for (where, _, _, _), ts in zip(self.pending, texts):
            try:
                out.append(_encode_batch(self.tok, ts))
            except Exception as e:  # noqa: BLE001
                self.report.records -= 1
                self.bad(where, f"the tokenizer cannot take it ({type(e).__name__}: {str(e)[:200]})")
                out.append(None)
        return out

    def flush(self) -> None:
        if not self.pending:
            return
        max_len = self.cfg.max_seq_len
        for (_, pieces, cut_before, source), ids in zip(self.pending, self._encode_pending()):
            if ids is None:
                continue
            seq: list[int] = []
            mask: list[int] = []
            k = 0
            for piece, sup in pieces:
                if isinstance(piece, str):
                    part = ids[k]
                    k += 1
                else:
                    part = piece
                seq.extend(part)
                mask.extend([1 if sup else 0] * len(part))
            cut = cut_before or len(seq) > max_len
            seq, mask = seq[:max_len], mask[:max_len]
            if not any(a and b for a, b in zip(mask, mask[1:])):
                self.report.dropped_no_supervision += 1
                continue
            self.report.truncated += int(cut)
            self.tok_buf.extend(seq)
            self.mask_buf.extend(mask)
            self.lengths.append(len(seq))
            self.sources.append(source)
        self.pending.clear()
        self.pending_chars = 0

    def finish(self) -> Corpus:
        self.flush()
        if self.lengths:
            tokens = torch.frombuffer(self.tok_buf, dtype=torch.int32).clone()
            mask = torch.frombuffer(self.mask_buf, dtype=torch.uint8).clone()
        else:
            tokens = torch.zeros(0, dtype=torch.int32)
            mask = torch.zeros(0, dtype=torch.uint8)
        self.tok_buf, self.mask_buf = array("i"), array("B")
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        if self.lengths:
            offsets[1:] = torch.cumsum(torch.tensor(self.lengths, dtype=torch.int64), 0)
        r = self.report
        r.samples = len(self.lengths)
        r.tokens = int(tokens.numel())
        r.supervised_tokens = int(mask.sum()) if mask.numel() else 0
        return Corpus(tokens, mask, offsets, r, torch.tensor(self.sources, dtype=torch.int32))


def _piece_chars(piece: str | list[int]) -> int:
    """A piece's size against the character cut: a stored token id counts as MAX_CHARS_PER_TOKEN characters."""
    return len(piece) if isinstance(piece, str) else len(piece) * MAX_CHARS_PER_TOKEN


def _clip_pieces(pieces: list[Piece], max_chars: int) -> tuple[list[Piece], bool]:
    """The pieces cut to their first ``max_chars`` characters in all; and whether anything was cut."""
    if sum(_piece_chars(t) for t, _ in pieces) <= max_chars:
        return pieces, False
    out, left = [], max_chars
    for piece, sup in pieces:
        if left <= 0:
            break
        out.append((piece[:left] if isinstance(piece, str) else piece[: -(-left // MAX_CHARS_PER_TOKEN)], sup))
        left -= _piece_chars(piece)
    return out, True


def _read_jsonl(builder: _Builder, path: Path, label: str) -> None:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{label}: file not found (data.paths)") from None
    except OSError as e:
        raise DataError(f"{label}: cannot read: {e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            builder.report.lines_read += 1
            where = f"{label}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                builder.bad(where, f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                builder.bad(where, "empty line")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                builder.bad(where, f"invalid JSON: {e.msg} (column {e.colno})")
                continue
            except RecursionError:
                builder.bad(where, f"JSON nested too deeply to parse (over ~{sys.getrecursionlimit()} levels)")
                continue
            builder.add(where, obj)


# --------------------------------------------------------------------------- cache + entry point


def _cache_payload(corpus: Corpus) -> dict[str, Any]:
    report = corpus.report.to_dict()
    report["loaded_from_cache"] = False
    return {"tokens": corpus.tokens, "loss_mask": corpus.loss_mask, "offsets": corpus.offsets, "sources": corpus.sources, "report": report}


def _from_payload(d: dict[str, Any], path: Path) -> Corpus | None:
    try:
        report = DataReport(**d["report"])
        return Corpus(d["tokens"], d["loss_mask"], d["offsets"], report, d["sources"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a broken cache is rebuilt
        log.warning("ignoring unreadable data cache %s: %s", path, e)
        return None


def load_corpus(cfg: DataConfig, tokenizer, cache_dir: Path | None) -> Corpus:
    """Tokenize ``cfg.paths`` (or load the cached result from ``cache_dir``, :mod:`.token_cache`; None: no cache)."""
    key, digests = cache_key(cfg, tokenizer)
    if cache_dir is None:
        corpus = _tokenize(cfg, tokenizer, digests)
    else:
        cache_path = Path(cache_dir) / cache_file_name(key)
        with open_cache_dir(Path(cache_dir)) as dir_fd:
            cached = read_cached(dir_fd, cache_path, key)
            corpus = _from_payload(cached, cache_path) if cached is not None else None
            if corpus is not None:
                r = corpus.report
                r.loaded_from_cache = True
                r.cache_path = str(cache_path)
                if cfg.on_bad_line == "error" and r.num_bad_lines:
                    raise DataError(f'{r.bad_lines[0]} (data.on_bad_line = "error"; fix the line or set on_bad_line = "skip")')
            else:
                corpus = _tokenize(cfg, tokenizer, digests)
                write_cache(dir_fd, cache_path, key, _cache_payload(corpus))
                corpus.report.cache_path = str(cache_path)
    log.info("data: %s", corpus.report.summary())
    return corpus


def _tokenize(cfg: DataConfig, tokenizer, digests: list[str | None]) -> Corpus:
    report = DataReport(sources=list(cfg.paths), source_digests=list(digests))
    builder = _Builder(cfg, tokenizer, report)
    for i, p in enumerate(cfg.paths):
        builder.source = i
        if p.startswith("builtin:"):
            if p != BUILTIN_STDLIB_DOCS:
                raise DataError(f"data.paths[{i}]: unknown built-in corpus {p!r}; use {BUILTIN_STDLIB_DOCS!r}")
            for j, conv in enumerate(builtin_conversations(cfg.builtin_samples, cfg.max_seq_len)):
                report.lines_read += 1
                builder.add(f"{p}:{j + 1}", conv)
        elif is_table_source(p):
            for where, rec in iter_table_records(p):
                report.lines_read += 1
                builder.add(where, rec)
        else:
            _read_jsonl(builder, Path(p), p)
    corpus = builder.finish()
    if report.num_bad_lines > 20:
        log.warning("... %d bad data lines in total", report.num_bad_lines)
    if corpus.num_samples == 0:
        raise DataError(f"{', '.join(cfg.paths)}: no usable samples ({report.summary()})")
    return corpus
