"""What a run's data was, in a form a checkpoint keeps: which batches its ledger's ids are.

A ledger names batches by plan position ``(epoch, shard, index)``; those ids mean the same samples
only while the data, its tokenization and the plan are the same. The fingerprint holds:

* ``files``: each entry of ``data.paths`` with its size, modification time and content digest (to
  name what changed; a file only touched, same bytes, changes nothing below),
* ``tokens_sha256``: the tokenized corpus (token ids, loss mask, sample boundaries): the content
  trained on, whatever rendered it,
* ``plan_sha256``: every planned batch (its id and its samples' indices) of every epoch and shard,
* ``digest``: of the two digests above. Two fingerprints describe the same batches iff their
  ``digest`` is equal.

The probe computes it (``runtime/probe.py``, into ``plan.json``); every checkpoint keeps the one
its ledger was written under (``meta.json`` ``extra.data``); ``up --resume`` compares them before
any process starts (``runtime/resume_check.py``). No torch import here: the supervisor compares.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

FINGERPRINT_FORMAT = "dflash-ipc-data/1"


def file_entries(paths: Sequence[str], builtin_samples: int, digests: Sequence[str | None] = ()) -> list[dict[str, Any]]:
    """Each data source with what names a change of it: size, mtime and, given ``digests`` (the token
    cache's, one per path), its content's BLAKE2b; a built-in corpus: its sample count."""
    out: list[dict[str, Any]] = []
    for i, p in enumerate(paths):
        if p.startswith("builtin:"):
            out.append({"path": p, "samples": builtin_samples})
            continue
        try:
            st = Path(p).expanduser().stat()
            entry = {"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        except OSError:
            entry = {"path": p, "size": None, "mtime_ns": None}
        if i < len(digests) and digests[i] is not None:
            entry["blake2b"] = digests[i]
        out.append(entry)
    return out


def tokens_digest(tokens: Any, loss_mask: Any, offsets: Any) -> str:
    """sha256 of a tokenized corpus (CPU tensors: token ids, loss mask, sample offsets)."""
    h = hashlib.sha256()
    for t in (offsets, tokens, loss_mask):
        h.update(str(t.dtype).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def plan_digest(batches: Iterable[tuple[Sequence[int], Sequence[int]]]) -> str:
    """sha256 of a plan given as (batch id, sample indices) in plan order, every epoch and shard."""
    h = hashlib.sha256()
    for bid, samples in batches:
        h.update(json.dumps([list(bid), list(samples)], separators=(",", ":")).encode())
    return h.hexdigest()


def make_fingerprint(
    files: list[dict[str, Any]], samples: int, n_tokens: int, tokens_sha256: str, batches_per_shard: list[int], plan_sha256: str
) -> dict[str, Any]:
    digest = hashlib.sha256(f"{tokens_sha256}:{plan_sha256}".encode()).hexdigest()
    return {
        "format": FINGERPRINT_FORMAT,
        "files": files,
        "samples": samples,
        "tokens": n_tokens,
        "tokens_sha256": tokens_sha256,
        "batches_per_shard": list(batches_per_shard),
        "plan_sha256": plan_sha256,
        "digest": digest,
    }


def same_data(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Both fingerprints describe the same batches (a missing one: a checkpoint from before they existed, not compared)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return True
    return a.get("digest") == b.get("digest")


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the checkpoint's data (``old``) and this run's (``new``), most telling first."""
    out: list[str] = []
    old_files = {f.get("path"): f for f in old.get("files", []) if isinstance(f, dict)}
    new_files = {f.get("path"): f for f in new.get("files", []) if isinstance(f, dict)}
    for path, f in new_files.items():
        was = old_files.get(path)
        if was is None:
            out.append(f"{path}: not in the checkpoint's data")
            continue
        for key, unit in (("size", " bytes"), ("samples", " samples")):
            if was.get(key) != f.get(key):
                out.append(f"{path}: {was.get(key)}{unit} then, {f.get(key)}{unit} now")
                break
        else:
            if was.get("mtime_ns") != f.get("mtime_ns"):
                out.append(f"{path}: modified since (same size)")
            elif was.get("blake2b") and f.get("blake2b") and was["blake2b"] != f["blake2b"]:
                out.append(f"{path}: its content changed (same size and modification time)")
    out += [f"{path}: in the checkpoint's data, not now" for path in old_files if path not in new_files]
    for key, what in (("samples", "samples"), ("tokens", "tokens")):
        if old.get(key) != new.get(key):
            out.append(f"{old.get(key)} {what} then, {new.get(key)} now")
    if old.get("tokens_sha256") != new.get("tokens_sha256") and not out:
        out.append("the tokenized content differs (same files and counts: the tokenizer or the rendering changed)")
    old_b, new_b = old.get("batches_per_shard"), new.get("batches_per_shard")
    if old_b != new_b:
        out.append(f"the plan: {sum(old_b or [])} batches {old_b} per target shard then, {sum(new_b or [])} {new_b} now")
    elif old.get("plan_sha256") != new.get("plan_sha256"):
        out.append("the plan puts other samples in the same batch ids")
    return out
