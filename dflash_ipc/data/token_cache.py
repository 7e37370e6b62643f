"""The token cache: a tokenized corpus saved once, served again only for the same bytes, and only
from a directory no other user can write.

``CACHE_DIR/tokens-<key>.pt`` (flat int32 token ids, uint8 loss mask, int64 offsets, the sources and
the report) is keyed by the input files' content (a BLAKE2b digest of every byte, each file of a
Parquet or saved-dataset folder), their path, size and mtime, the tokenizer identity,
``max_seq_len`` and, for the built-in corpus, ``builtin_samples`` and the Python version: an edit
that keeps a file's size and mtime is a new key, never served "from cache".

The directory (``data.cache_dir``, else ``RUN_DIR/data``) may sit outside the run's private
directory, so it is trusted only as this user's own: created 0700 with any missing parents (files
0600) whatever the umask, and opened once, its owner and mode checked on the descriptor, every
file read and written relative to it, never through a link. A directory or cache file of another
user, or one other users can write, is refused by name (:class:`~dflash_ipc.rundir.fsutil.NotPrivate`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_ipc.config import DataConfig
from dflash_ipc.data.tokenizer import tokenizer_identity
from dflash_ipc.rundir.fsutil import NotPrivate, check_own_private, make_private_dirs, write_atomic_at

log = logging.getLogger("dflash_ipc.data.corpus")

# 2: records cut to max_seq_len * MAX_CHARS_PER_TOKEN characters before tokenizing; 3: stored answer ids,
# finish "length"; 4: each sample's source (its data.paths index, for the mix); 5: keyed by the sources' content;
# 6: the answer laid out as the target generated it (chat_pieces), every stop token closes a turn
CACHE_FORMAT = 6
_READ_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """BLAKE2b (32 bytes) of the file's bytes, read once in 1 MiB chunks."""
    h = hashlib.blake2b(digest_size=32)
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def source_digest(path: Path) -> str | None:
    """The content digest of a data source: a file's, or a folder's over every file's name and digest
    (None: unreadable, left to the reader to name)."""
    try:
        if path.is_dir():
            h = hashlib.blake2b(digest_size=32)
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                h.update(f"{f.relative_to(path)}\0{file_digest(f)}\n".encode())
            return h.hexdigest()
        return file_digest(path)
    except OSError:
        return None


def _source_stamp(path: Path, digest: str | None) -> list:
    """What a cached corpus of ``path`` depends on: its content, and its size and mtime (for a folder those
    of every file in it)."""
    try:
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file())
            return [str(path.resolve()), digest, [[str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns] for f in files]]
        st = path.stat()
        return [str(path.resolve()), digest, st.st_size, st.st_mtime_ns]
    except OSError:
        return [str(path), None, None, None]


def cache_key(cfg: DataConfig, tokenizer) -> tuple[str, list[str | None]]:
    """The cache key of ``cfg``'s corpus, and each ``data.paths`` entry's content digest (None: built in)."""
    sources, digests = [], []
    for p in cfg.paths:
        if p.startswith("builtin:"):
            sources.append([p, cfg.builtin_samples, sys.version])
            digests.append(None)
        else:
            digest = source_digest(Path(p))
            sources.append(_source_stamp(Path(p), digest))
            digests.append(digest)
    blob = json.dumps(
        {"format": CACHE_FORMAT, "sources": sources, "tokenizer": tokenizer_identity(tokenizer), "max_seq_len": cfg.max_seq_len},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest(), digests


def cache_file_name(key: str) -> str:
    return f"tokens-{key[:24]}.pt"


@contextlib.contextmanager
def open_cache_dir(path: Path) -> Iterator[int]:
    """A descriptor of the cache directory ``path``: made 0700 (with its missing parents) when missing,
    refused when it is not this user's own or other users can write it."""
    if not path.exists():
        make_private_dirs(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_own_private(path, os.fstat(fd), "the token cache (data.cache_dir)", fix="use a directory of your own (mode 0700)")
        yield fd
    finally:
        os.close(fd)


def read_cached(dir_fd: int, path: Path, key: str) -> dict[str, Any] | None:
    """The saved payload at ``path`` (in ``dir_fd``) if it holds ``key``; None when missing, unreadable or
    another key. A file of another user, or one other users can write, is refused (NotPrivate)."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)  # a FIFO: no wait
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotPrivate(path, "the token cache file is a symbolic link", f"remove it (rm {path})") from None
        raise
    with os.fdopen(fd, "rb") as f:
        check_own_private(path, os.fstat(fd), "the token cache file", fix=f"remove it (rm {path})")
        try:
            d = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a broken cache is rebuilt
            log.warning("ignoring unreadable data cache %s: %s", path, e)
            return None
    if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT or d.get("key") != key:
        return None
    return d


class TokenCacheDiskFull(OSError):
    """The tokenized data does not fit where its cache goes: one line with the sizes and what to change."""

    def __init__(self, path: Path, need: int, free: int):
        super().__init__(
            errno.ENOSPC,
            f"no space left on {path.parent} for the token cache: need ~{need / 2**20:.1f} MiB, {free / 2**20:.2f} MiB free; "
            f"free space there, or point data.cache_dir at a larger disk",
        )


def write_cache(dir_fd: int, path: Path, key: str, payload: dict[str, Any]) -> None:
    """Save ``payload`` (tensors and plain values) under ``key`` at ``path`` in ``dir_fd``: a new 0600 file
    renamed into place; a disk too small is :class:`TokenCacheDiskFull` with nothing left behind."""
    need = sum(v.numel() * v.element_size() for v in payload.values() if isinstance(v, torch.Tensor)) + (64 << 10)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise TokenCacheDiskFull(path, need, free)
    try:
        write_atomic_at(dir_fd, path, lambda f: torch.save({"format": CACHE_FORMAT, "key": key, **payload}, f))
    except (OSError, RuntimeError) as e:  # torch.save on a full disk: a RuntimeError ("unexpected pos")
        free = shutil.disk_usage(path.parent).free
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < need:
            raise TokenCacheDiskFull(path, need, free) from None
        raise
