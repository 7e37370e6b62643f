"""A checkpoint's files checked end to end before anything is resumed from them (no torch here).

``meta.json`` is the checkpoint's manifest, written last: besides the step, sizes and config it
holds the sha256 of every payload file (``sha256``, each taken as the file was written), the
number of ledgered batches (``num_batches``) and of batches its steps trained (``extra.batches_trained``,
counted apart from the ids: a ledger missing an id, or emptied, disagrees), the data fingerprint the ledger's ids belong to
(``extra.data``, :mod:`dflash_ipc.data.fingerprint`) and a sha256 of its own other keys
(``meta_sha256``). :func:`verify_files` checks all of them and the ledger against them, so a
flipped byte anywhere (tensor data, the RNG state in trainer.pt, a ledger id removed and padded
back to the same size) is named, not trained on. What needs the tensors' values (non-finite or
absurd weights and moments) is checked where torch loads them (``drafter/checkpoint/store.py``).

Three readers use these rules, so they pick the same checkpoint: ``up --resume`` before any
process starts (``runtime/resume_check.py``: the cheap checks at the door, the digests, the plan
and the data after the probe), the drafter that loads it, and the targets that skip its ledger
(:func:`resume_ledger`). A checkpoint written before digests existed has none to check; its
sizes, meta and ledger count still are.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ipc.data.fingerprint import same_data
from dflash_ipc.drafter.checkpoint.layout import (
    CKPT_FORMAT,
    LATEST_FILE,
    LEDGER_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    STEP_DIR_RE,
    TRAINER_FILE,
    read_latest_pointer,
)
from dflash_ipc.rundir import bounded_json
from dflash_ipc.rundir.ledger import BatchLedger

DIGESTS_KEY = "sha256"
#: meta.json's ``extra`` key: the batches the steps trained since the ledger began, counted step by step apart
#: from their ids (all-reduced with each step's figures): the ledger must hold exactly as many.
BATCHES_TRAINED_KEY = "batches_trained"
META_DIGEST_KEY = "meta_sha256"
PLAN_FILE = "plan.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory that must not be resumed from; the message says which file and why."""


class NoUsableCheckpoint(CheckpointError):
    """Checkpoints exist but none passes: ``--resume`` refuses rather than start again from step 0."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's keys other than its own digest, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of the step directory ``path``, its format, step and own digest checked."""
    m = STEP_DIR_RE.match(path.name)
    if not m:
        raise CheckpointError(f"{path}: not a step-NNNNNN directory")
    try:
        meta = bounded_json.read(path / META_FILE)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {META_FILE} missing (incomplete checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: {META_FILE} unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{path}: unsupported format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    if META_DIGEST_KEY in meta and meta[META_DIGEST_KEY] != meta_digest(meta):
        raise CheckpointError(f"{path}: {META_FILE} does not match its own sha256 (damaged or edited)")
    if meta.get("step") != int(m.group(1)):
        raise CheckpointError(f"{path}: meta.json says step {meta.get('step')!r}, directory says {int(m.group(1))}")
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path}: meta.json has no file list")
    return meta


def payload_files(meta: dict[str, Any]) -> tuple[str, ...]:
    return (MODEL_FILE, TRAINER_FILE, LEDGER_FILE, *((OPTIM_FILE,) if OPTIM_FILE in meta["files"] else ()))


def verify_files(path: Path, *, digests: bool = True) -> tuple[dict[str, Any], BatchLedger]:
    """meta.json, every payload file's size and (``digests``) sha256, and the ledger against the
    manifest; returns (meta, ledger) or raises :class:`CheckpointError` naming the file."""
    meta = read_meta(path)
    files, recorded = meta["files"], meta.get(DIGESTS_KEY)
    for fname in payload_files(meta):
        fp = path / fname
        if not fp.is_file():
            raise CheckpointError(f"{path}: {fname} missing")
        size = fp.stat().st_size
        if size != files.get(fname):
            raise CheckpointError(f"{path}: {fname} is {size} bytes, meta.json recorded {files.get(fname)}")
        if digests and isinstance(recorded, dict) and recorded.get(fname) != sha256_file(fp):
            raise CheckpointError(f"{path}: {fname} does not match the sha256 meta.json recorded (damaged since it was written)")
    try:
        wire = bounded_json.read(path / LEDGER_FILE)
        ledger = BatchLedger.from_wire(wire)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {LEDGER_FILE} unreadable: {e}") from None
    listed = len(wire["ids"]) if isinstance(wire, dict) else len(wire)
    if listed != len(ledger):
        raise CheckpointError(f"{path}: {LEDGER_FILE} lists {listed} ids but only {len(ledger)} distinct ones")
    if "num_batches" in meta and meta["num_batches"] != len(ledger):
        raise CheckpointError(f"{path}: {LEDGER_FILE} holds {len(ledger)} batches, meta.json recorded {meta['num_batches']}")
    trained = meta["extra"].get(BATCHES_TRAINED_KEY) if isinstance(meta.get("extra"), dict) else None
    if trained is not None and trained != len(ledger):  # absent: a checkpoint written before the steps counted them
        raise CheckpointError(f"{path}: {LEDGER_FILE} holds {len(ledger)} batches, but its steps trained {trained!r}")
    return meta, ledger


def ledger_plan_problem(ledger: BatchLedger, plan: dict[str, Any]) -> str | None:
    """Why the ledger's ids cannot be batches of ``plan`` (plan.json), or None.

    An id is (epoch, shard, index): the shard must be one of the plan's, the index below that
    shard's batch count, and no shard can have consumed more batches than it plans."""
    per_shard = plan.get("n_batches_per_shard")
    if not isinstance(per_shard, list):
        return None
    consumed = Counter()
    for bid in ledger:
        if len(bid) != 3 or min(bid) < 0:
            return f"id {list(bid)} is no (epoch, shard, index)"
        _, shard, index = bid
        if shard >= len(per_shard) or index >= per_shard[shard]:
            return f"id {list(bid)} is outside the plan ({len(per_shard)} shards of {per_shard} batches)"
        consumed[shard] += 1
    over = [s for s, n in consumed.items() if n > per_shard[s]]
    if over:
        return f"shard {over[0]} has {consumed[over[0]]} ledgered batches, the plan has {per_shard[over[0]]}"
    return None


def ledger_applies(meta: dict[str, Any], plan: dict[str, Any] | None) -> bool:
    """The checkpoint's ledger names batches of ``plan``: it was written under the same data fingerprint."""
    extra = meta.get("extra")
    stored = extra.get("data") if isinstance(extra, dict) else None
    return plan is None or same_data(stored, plan.get("data_fingerprint"))


def read_plan(run_dir: Path) -> dict[str, Any] | None:
    try:
        plan = bounded_json.read(run_dir / PLAN_FILE)
    except (OSError, ValueError):
        return None
    return plan if isinstance(plan, dict) else None


def resume_ledger(checkpoint_dir: str | Path | None, run_dir: Path) -> BatchLedger:
    """The batches a resumed run skips: the checkpoint's ledger, or none after ``up --replan``
    re-planned changed data (its ids were positions in the old plan). A fresh run: none."""
    if not checkpoint_dir:
        return BatchLedger()
    meta, ledger = verify_files(Path(checkpoint_dir), digests=False)
    plan = read_plan(run_dir)
    if ledger_applies(meta, plan):
        return ledger
    if plan is not None and plan.get("replan"):
        return BatchLedger()
    raise CheckpointError(f"{checkpoint_dir}: written for other data than {run_dir / PLAN_FILE} plans; resume with `up --resume --replan`")


@dataclass
class ResumeChoice:
    """The checkpoint ``--resume`` continues from (None: no checkpoint, a fresh run) and why newer ones were passed over."""

    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    ledger: BatchLedger = field(default_factory=BatchLedger)
    notes: list[str] = field(default_factory=list)


def step_dirs(root: Path) -> list[Path]:
    """The step-* directories under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def choose_checkpoint(root: Path, *, digests: bool = True, plan: dict[str, Any] | None = None) -> ResumeChoice:
    """The newest checkpoint under ``root`` whose files verify (and, with ``plan``, whose ledger
    fits it when it was written for the same data). Raises :class:`NoUsableCheckpoint` when there
    are checkpoints and none passes: ``--resume`` never silently starts again from step 0."""
    notes: list[str] = []
    candidates = step_dirs(root)
    for path in candidates:
        try:
            meta, ledger = verify_files(path, digests=digests)
            problem = ledger_plan_problem(ledger, plan) if plan is not None and ledger_applies(meta, plan) else None
            if problem:
                raise CheckpointError(f"{path}: {LEDGER_FILE} does not fit the plan: {problem}")
        except CheckpointError as e:
            notes.append(f"skipped {e}")
            continue
        return ResumeChoice(path, meta, ledger, notes)
    pointer = read_latest_pointer(root)
    if candidates or pointer:
        why = "; ".join(notes) if notes else f"{root / LATEST_FILE} points at {pointer!r}, which does not exist"
        raise NoUsableCheckpoint(
            f"no usable checkpoint under {root}: {why}. Restore a checkpoint from a backup, or train in a new run directory"
        )
    return ResumeChoice(notes=notes)
