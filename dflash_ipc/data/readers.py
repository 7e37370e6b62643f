"""Record sources beyond JSONL: Parquet files and Hugging Face ``datasets`` saved folders,
plus the prompt view of records that ``gen-data`` and ``eval`` use.

A data path is read by its form:

* ``*.parquet`` (or a folder of ``*.parquet`` files): rows through ``pyarrow``;
* a folder written by ``datasets.Dataset.save_to_disk`` (it holds ``dataset_info.json`` or
  ``state.json``; a ``DatasetDict`` folder holds ``dataset_dict.json``, whose ``train`` split
  is read): rows through ``datasets.load_from_disk``;
* anything else: JSONL (read by :mod:`dflash_ipc.data.corpus`).

Rows are the same records as JSONL lines (``conversations`` / ``messages`` / ``text``).
Both libraries are optional imports: a missing one is a :class:`~dflash_ipc.data.corpus.DataError`
that says what to install.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_ipc.data.builtin_corpus import BUILTIN_STDLIB_DOCS, builtin_conversations
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.records import BadRecord, parse_record

__all__ = ["is_table_source", "iter_records", "iter_table_records", "prompt_messages", "record_id"]


def _data_error(msg: str) -> Exception:
    return DataError(msg)


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def is_table_source(path: str) -> bool:
    """Whether ``path`` is read by :func:`iter_table_records` (Parquet or a saved dataset)."""
    p = Path(path)
    return p.suffix == ".parquet" or (p.is_dir() and (_is_saved_dataset(p) or any(p.glob("*.parquet"))))


_END = object()


def _next(it: Iterator, where: str) -> Any:
    """The next item of a reader's iterator (``_END`` at its end); a reader failing mid-file is a
    DataError naming the file and the row (pyarrow's "Corrupt snappy compressed data." names neither)."""
    try:
        return next(it, _END)
    except Exception as e:  # noqa: BLE001 - pyarrow and datasets raise OSError, ArrowInvalid, ... for damaged data
        raise _data_error(f"{where}: cannot read the data ({type(e).__name__}: {e})") from None


def _parquet_rows(files: list[Path], label: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise _data_error(f"{label}: reading Parquet needs pyarrow; pip install pyarrow") from None
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except FileNotFoundError:
            raise _data_error(f"{f}: file not found (data.paths)") from None
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise _data_error(f"{f}: not a readable Parquet file: {e}") from None
        row = 0
        batches = pf.iter_batches(batch_size=1024)
        while (batch := _next(batches, f"{f} (the rows from {row + 1})")) is not _END:
            for rec in batch.to_pylist():
                row += 1
                yield f"{f}:row {row}", rec


def _dataset_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise _data_error(f"{path}: reading a saved Hugging Face dataset needs `datasets`; pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001
        raise _data_error(f"{path}: datasets.load_from_disk failed: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise _data_error(f"{path}: a DatasetDict without a 'train' split ({sorted(ds)}); point data.paths at one split's folder")
        ds = ds["train"]
    rows = iter(ds)
    i = 1
    while (rec := _next(rows, f"{path}:row {i}")) is not _END:
        yield f"{path}:row {i}", rec
        i += 1


def iter_table_records(path: str) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every row of a Parquet file/folder or a saved dataset folder."""
    p = Path(path)
    if _is_saved_dataset(p):
        yield from _dataset_rows(p)
    elif p.is_dir():
        yield from _parquet_rows(sorted(p.glob("*.parquet")), path)
    else:
        yield from _parquet_rows([p], path)


def _jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - opened apart from the with, so an OSError names the path
    except OSError as e:
        raise _data_error(f"{path}: cannot read: {e}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # a bad line, not the end of the file
                yield f"{path}:{lineno}", _Unparsable(f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                rec = _Unparsable(f"invalid JSON: {e.msg}")
            except RecursionError:
                rec = _Unparsable("JSON nested too deeply")
            yield f"{path}:{lineno}", rec


class _Unparsable:
    def __init__(self, reason: str):
        self.reason = reason


def iter_records(paths: list[str], builtin_samples: int = 2000, max_seq_len: int = 2048) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` over data paths of any supported form, built-in corpus included.
    A JSONL line that is not JSON comes as an unparsable record (``prompt_messages`` -> None)."""
    for p in paths:
        if p.startswith("builtin:"):
            if p != BUILTIN_STDLIB_DOCS:
                raise _data_error(f"data.paths: unknown built-in corpus {p!r}; use {BUILTIN_STDLIB_DOCS!r}")
            for j, conv in enumerate(builtin_conversations(builtin_samples, max_seq_len)):
                yield f"{p}:{j + 1}", conv
        elif is_table_source(p):
            yield from iter_table_records(p)
        else:
            yield from _jsonl_records(p)


def record_id(where: str, record: Any) -> str:
    """The record's own ``id`` field when it has one, else its place (``file:line``)."""
    if isinstance(record, dict) and isinstance(record.get("id"), (str, int)) and not isinstance(record.get("id"), bool):
        return str(record["id"])
    return where


def prompt_messages(record: Any) -> list[dict] | None:
    """The prompt of a chat record: its messages up to and including the *first* user turn
    (a leading system message is kept). None for text records and malformed ones."""
    if isinstance(record, _Unparsable):
        return None
    try:
        kind, value = parse_record(record)
    except BadRecord:
        return None
    if kind != "chat":
        return None
    for j, m in enumerate(value):
        if m["role"] == "user":
            return [{"role": x["role"], "content": x["content"]} for x in value[: j + 1]]
    return None
