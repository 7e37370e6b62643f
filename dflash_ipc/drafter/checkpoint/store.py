"""Crash-safe checkpoints and the ledger of consumed batches.

Layout under ``ckpt_root``::

    step-000123/
        model.safetensors   trainable drafter weights; a drafter's are its master weights (fp32),
                            streamed from the device, and resuming reads them from here
        optimizer.safetensors  the optimizer's per-parameter moments (AdamW exp_avg / exp_avg_sq),
                            streamed from the device (absent in checkpoints whose trainer.pt holds them)
        trainer.pt          {"trainer": trainer state (schedule, step, optimizer scalars; the master
                             weights and moments too in trainer-state format 1), "rng": RNG state(s)}
                            -- torch.save, loaded with weights_only=True
        ledger.json         ids of every batch consumed by an optimizer step
        meta.json           the manifest, written last: format, step, time, config hash, file sizes and
                            sha256s, num_batches, extra (the config, the data fingerprint), its own sha256
    latest                  "step-000123\\n", replaced atomically

Saving writes everything into ``.tmp-...`` in the same root, fsyncs each file and the
directory, renames it to ``step-NNNNNN`` (the commit point), fsyncs the root, then replaces
``latest``. A crash at any point leaves every earlier checkpoint intact; half-written
``.tmp-*`` directories are never considered and are removed by the next successful save.
Loading validates a candidate fully (meta, sizes, sha256s and the ledger: ``checkpoint.verify``; every
payload parses; the tensors' values, set, shapes and step counts: ``checkpoint.values``) and falls back
to the next newest good checkpoint, recording why in :attr:`Checkpoint.notes`; with ``strict``,
checkpoints that all fail raise :class:`NoUsableCheckpoint`.

A full disk is named, not left to the writers' own errors (torch.save says "enforce fail ...
unexpected pos", safetensors "IoError ... StorageFull"): a save checks the free space against
the payload's size first, and a write that fails with ENOSPC (or a wrapped one while the disk is
full) raises :class:`CheckpointDiskFull` "no space left on RUN_DIR (...) writing checkpoint step
N: need ~X"; the half-written ``.tmp-*`` is removed, earlier checkpoints are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file as _st_load_file

from dflash_ipc.drafter.checkpoint.layout import (  # noqa: F401 - the layout's names, re-exported for the modules that load checkpoints
    CKPT_FORMAT,
    LATEST_FILE,
    LEDGER_FILE,
    LEDGER_FORMAT,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    STEP_DIR_RE,
    TRAINER_FILE,
    read_latest_pointer,
    step_dir_name,
)
from dflash_ipc.drafter.checkpoint.safetensors_stream import write_safetensors
from dflash_ipc.drafter.checkpoint.values import WEIGHT_ABS_BOUND, ModelShapes, named_tensors, shape_problem, step_problem, value_problem
from dflash_ipc.drafter.checkpoint.verify import (  # noqa: F401 - the errors, re-exported for the modules that load checkpoints
    DIGESTS_KEY,
    META_DIGEST_KEY,
    CheckpointError,
    NoUsableCheckpoint,
    ledger_applies,
    ledger_plan_problem,
    meta_digest,
    sha256_file,
    verify_files,
)
from dflash_ipc.rundir.fence import Fence
from dflash_ipc.rundir.fsutil import LinkRefused
from dflash_ipc.rundir.ledger import BatchId, BatchLedger  # noqa: F401 - re-exported for the checkpoint's readers

log = logging.getLogger(__name__)


def cpu_snapshot(obj: Any) -> Any:
    """Deep copy with tensors cloned to CPU (an optimizer state_dict aliases live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_snapshot(v) for v in obj)
    return obj


# --------------------------------------------------------------------------- ledger


def gather_ledger(local_new_ids: Iterable[Sequence[int]], world: Any = None) -> list[BatchId]:
    """All ranks' newly consumed ids, sorted and de-duplicated. A collective on every rank.

    ``world`` is a :class:`dflash_ipc.drafter.training.distributed.DistInfo` (or None for a single process).
    """
    local = sorted({BatchLedger._norm(b) for b in local_new_ids})
    distributed = world is not None and getattr(world, "world_size", 1) > 1 and dist.is_available() and dist.is_initialized()
    if not distributed:
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [list(t) for t in local])
    out: set[BatchId] = set()
    for part in gathered:
        out.update(tuple(int(x) for x in b) for b in part)
    return sorted(out)


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Python, torch CPU and (if initialised) CUDA RNG states, in a weights_only-loadable form."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s states. They may arrive on a GPU (a checkpoint loaded with
    ``map_location`` = the drafter's device); torch takes RNG states only as CPU byte tensors."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    torch.set_rng_state(_cpu_bytes(state["torch"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda) != n:
            log.warning("checkpoint has CUDA RNG state for %d devices, this process sees %d; restoring the overlap", len(cuda), n)
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_cpu_bytes(s), i)


def _cpu_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.uint8)


# --------------------------------------------------------------------------- helpers


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_path(path)
    except OSError:  # some filesystems refuse fsync on directories
        pass


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:  # a new file (in a new directory): never through a link
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: Any) -> None:
    _write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _write_torch(path: Path, obj: Any) -> None:
    with open(path, "xb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write and fsync; returns the file's sha256, taken from the bytes as they were written."""
    hasher = hashlib.sha256()
    write_safetensors(path, tensors, metadata, hasher=hasher)  # streamed from the device: bounded host memory
    _fsync_path(path)
    return hasher.hexdigest()


def _replace_pointer(root: Path, name: str) -> None:
    tmp = root / f".{LATEST_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    _write_bytes(tmp, (name + "\n").encode())
    os.replace(tmp, root / LATEST_FILE)
    _fsync_dir(root)


def _remove_dir(path: Path) -> None:
    """Rename out of the step-* namespace first, so a crash mid-delete leaves nothing that looks valid."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = STEP_DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    out.sort(key=lambda t: t[0], reverse=True)
    return out


# --------------------------------------------------------------------------- disk full

# Ledger, meta, pickle framing and file-system blocks on top of the tensors' bytes.
_SAVE_OVERHEAD_BYTES = 1 << 20
# How torch.save (PyTorchStreamWriter) and safetensors report a failed write of a full disk.
_WRAPPED_WRITE_ERRORS = ("unexpected pos", "file write failed", "No space left", "StorageFull", "os error 28")


class CheckpointDiskFull(OSError):
    """The checkpoint did not fit on its file system; the previous checkpoint is intact."""

    def __init__(self, root: Path, step: int, need: int, free: int | None):
        run_dir = root.parent if root.name == "checkpoints" else root
        free_text = f", {_human_bytes(free)} free" if free is not None else ""
        super().__init__(
            errno.ENOSPC,
            f"no space left on RUN_DIR ({run_dir}) writing checkpoint step {step}: need ~{_human_bytes(need)} "
            f"({need} bytes){free_text}; the previous checkpoint is intact. Free space there, or lower "
            "training.keep_checkpoints",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside nested dicts/lists/tuples (what dominates a checkpoint)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def checkpoint_bytes_needed(
    model_state: dict[str, torch.Tensor], trainer_state: Any, ledger: BatchLedger, optimizer_tensors: dict[str, torch.Tensor] | None = None
) -> int:
    """An estimate of one checkpoint's size on disk."""
    tensors = _tensor_bytes(model_state) + _tensor_bytes(trainer_state) + _tensor_bytes(optimizer_tensors or {})
    return tensors + 32 * len(ledger) + _SAVE_OVERHEAD_BYTES


def _free_bytes(root: Path) -> int | None:
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


def _is_disk_full(exc: BaseException, free: int | None, need: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain, or a writer's wrapped error while the disk is full."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return free is not None and free < need and any(marker in text for marker in _WRAPPED_WRITE_ERRORS)


# --------------------------------------------------------------------------- save


def save_checkpoint(
    ckpt_root: Path | str,
    step: int,
    *,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    rng_state: Any,
    ledger: BatchLedger,
    extra: dict[str, Any] | None = None,
    config_hash: str = "",
    keep: int = 2,
    optimizer_tensors: dict[str, torch.Tensor] | None = None,
    fence: Fence | None = None,
) -> Path:
    """Write ``ckpt_root/step-NNNNNN`` atomically, point ``latest`` at it, keep the newest ``keep``.

    ``fence`` (:mod:`dflash_ipc.rundir.fence`): checked before anything is written, and held from
    the commit through ``latest`` and the retention's deletes: a process whose run directory a
    newer `up` owns writes and deletes nothing there (FencedOut).

    ``model_state`` and ``optimizer_tensors`` (written to optimizer.safetensors when given) may stay
    on their device: they are streamed through one bounded host buffer. ``trainer_state`` goes
    through torch.save, so it should hold only small things next to them.

    Call on one rank only (the others' RNG states can be passed in ``rng_state``, e.g. a list);
    one saver per ``ckpt_root``: a successful save removes every leftover ``.tmp-*`` there.
    Returns the final checkpoint directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep})")
    root = Path(ckpt_root)
    fence = fence or Fence.none()
    fence.check(f"checkpoint step {step}")
    if root.is_symlink():  # planted while the run trains (`up` refuses one at its start)
        raise LinkRefused(root)
    root.mkdir(parents=True, exist_ok=True)
    need = checkpoint_bytes_needed(model_state, trainer_state, ledger, optimizer_tensors)
    free = _free_bytes(root)
    if free is not None and free < need:
        raise CheckpointDiskFull(root, step, need, free)
    name = step_dir_name(step)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        digests = {MODEL_FILE: _write_safetensors(tmp / MODEL_FILE, model_state, {"format": CKPT_FORMAT, "step": str(step)})}
        payload_files = [MODEL_FILE, TRAINER_FILE, LEDGER_FILE]
        if optimizer_tensors is not None:
            digests[OPTIM_FILE] = _write_safetensors(tmp / OPTIM_FILE, optimizer_tensors, {"format": CKPT_FORMAT, "step": str(step)})
            payload_files.append(OPTIM_FILE)
        _write_torch(tmp / TRAINER_FILE, {"trainer": trainer_state, "rng": rng_state})
        digests[TRAINER_FILE] = sha256_file(tmp / TRAINER_FILE)  # small: read back
        _write_json(tmp / LEDGER_FILE, ledger.to_wire())
        digests[LEDGER_FILE] = sha256_file(tmp / LEDGER_FILE)
        now = time.time()
        meta = {
            "format": CKPT_FORMAT,
            "step": int(step),
            "time": now,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "config_hash": config_hash,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "num_batches": len(ledger),
            "files": {f: (tmp / f).stat().st_size for f in payload_files},
            DIGESTS_KEY: digests,
            "extra": extra or {},
        }
        meta[META_DIGEST_KEY] = meta_digest(json.loads(json.dumps(meta)))  # the digest of what a reader parses back
        _write_json(tmp / META_FILE, meta)  # written last, the manifest: its presence marks a complete payload
        _fsync_dir(tmp)
        with fence.guard(f"checkpoint step {step}"):
            _commit(root, tmp, final, name, need, keep, step)
    except BaseException as e:
        free = _free_bytes(root)  # before the cleanup gives the space back
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointDiskFull):
            raise
        if _is_disk_full(e, free, need):
            raise CheckpointDiskFull(root, step, need, free) from e
        raise
    return final


def _commit(root: Path, tmp: Path, final: Path, name: str, need: int, keep: int, step: int) -> None:
    """Rename the written ``tmp`` to ``final`` (the commit point), point ``latest`` at it, retain."""
    if final.exists():  # re-saving a step (e.g. after resuming there): move the old one away first
        _remove_dir(final)
    os.rename(tmp, final)  # commit point
    _fsync_dir(root)
    try:
        _replace_pointer(root, name)
    except OSError as e:  # the step directory is complete: loading finds it even without the pointer
        if _is_disk_full(e, _free_bytes(root), need):
            raise CheckpointDiskFull(root, step, need, _free_bytes(root)) from e
        raise
    _retain(root, step, keep)


def _retain(root: Path, step: int, keep: int) -> None:
    kept = 0
    for s, path in _list_step_dirs(root):
        if s > step:
            # Newer than what we just saved: left over from a timeline we did not resume from
            # (only possible if it was damaged); it would shadow the new checkpoint.
            log.warning("removing %s: newer than the checkpoint just written (step %d) and not resumed from", path, step)
            _remove_dir(path)
        elif kept < keep:
            kept += 1
        else:
            _remove_dir(path)
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".trash-", f".{LATEST_FILE}.tmp-")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
    _fsync_dir(root)


# --------------------------------------------------------------------------- load


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    trainer_state: dict[str, Any]
    rng_state: Any
    ledger: BatchLedger
    notes: list[str] = field(default_factory=list)  # why newer candidates were skipped, pointer issues
    optimizer_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer.safetensors, if written

    @property
    def extra(self) -> dict[str, Any]:
        return self.meta.get("extra", {})

    @property
    def config_hash(self) -> str:
        return self.meta.get("config_hash", "")


def load_checkpoint(
    path: Path | str, *, map_location: str | torch.device = "cpu", expected_shapes: ModelShapes | None = None
) -> Checkpoint:
    """Load and fully validate one checkpoint directory; raises :class:`CheckpointError` saying why.

    The files against meta.json's sizes and sha256s and the ledger against its count and the steps' record
    (:func:`~dflash_ipc.drafter.checkpoint.verify.verify_files`), then the tensors (``checkpoint.values``): every weight
    finite and within ``WEIGHT_ABS_BOUND``, every optimizer tensor within ``MAX_ABS_VALUE``, every
    ``exp_avg_sq`` >= 0, the trainer's step counts consistent, and with ``expected_shapes`` (the loading
    model's, ``DrafterTrainer.checkpoint_shapes``) exactly its tensors at its shapes."""
    path = Path(path)
    meta, ledger = verify_files(path)
    files = meta["files"]
    try:
        model_state = _st_load_file(str(path / MODEL_FILE), device=str(map_location))
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
        raise CheckpointError(f"{path}: {MODEL_FILE} unreadable: {e}") from None
    optimizer_tensors: dict[str, torch.Tensor] = {}
    if OPTIM_FILE in files:
        try:
            optimizer_tensors = _st_load_file(str(path / OPTIM_FILE), device=str(map_location))
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise CheckpointError(f"{path}: {OPTIM_FILE} unreadable: {e}") from None
    try:
        payload = torch.load(path / TRAINER_FILE, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: {TRAINER_FILE} unreadable: {e}") from None
    if not isinstance(payload, dict) or "trainer" not in payload:
        raise CheckpointError(f"{path}: {TRAINER_FILE} has no trainer state")
    checks = (
        (MODEL_FILE, lambda: value_problem(model_state, WEIGHT_ABS_BOUND)),
        (OPTIM_FILE, lambda: value_problem(optimizer_tensors)),
        (TRAINER_FILE, lambda: value_problem(named_tensors(payload["trainer"]))),
        (TRAINER_FILE, lambda: step_problem(payload["trainer"], int(meta["step"]))),
        (MODEL_FILE, lambda: shape_problem(model_state, optimizer_tensors, expected_shapes) if expected_shapes is not None else None),
    )
    for fname, check in checks:
        problem = check()
        if problem:
            raise CheckpointError(f"{path}: {fname}: {problem}")
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        meta=meta,
        model_state=model_state,
        trainer_state=payload["trainer"],
        rng_state=payload.get("rng"),
        ledger=ledger,
        optimizer_tensors=optimizer_tensors,
    )


def load_latest_checkpoint(
    ckpt_root: Path | str,
    *,
    map_location: str | torch.device = "cpu",
    expected_config_hash: str | None = None,
    plan: dict[str, Any] | None = None,
    strict: bool = False,
    expected_shapes: ModelShapes | None = None,
) -> Checkpoint | None:
    """The newest complete, valid checkpoint under ``ckpt_root``, or None if there is none.

    Candidates are the ``step-*`` directories, newest step first (a complete directory newer than
    ``latest`` exists only if a crash hit between its commit and the pointer update). Damaged
    candidates are skipped; the reasons land in ``Checkpoint.notes`` and the log. With ``plan``
    (plan.json), a ledger written for the same data must fit it; with ``expected_shapes``, the tensors the
    loading model's (:func:`load_checkpoint`). A config hash different from
    ``expected_config_hash`` is reported in ``notes`` but does not reject. ``strict``: checkpoints
    that exist but all fail raise :class:`NoUsableCheckpoint` instead of returning None.
    """
    root = Path(ckpt_root)
    notes: list[str] = []
    pointer = read_latest_pointer(root)
    candidates = _list_step_dirs(root)
    if pointer is not None and not any(p.name == pointer for _, p in candidates):
        notes.append(f"{root / LATEST_FILE} points at {pointer!r}, which does not exist")
    pointed = STEP_DIR_RE.match(pointer or "")
    for step, path in candidates:
        try:
            ckpt = load_checkpoint(path, map_location=map_location, expected_shapes=expected_shapes)
            problem = ledger_plan_problem(ckpt.ledger, plan) if plan is not None and ledger_applies(ckpt.meta, plan) else None
            if problem:
                raise CheckpointError(f"{path}: {LEDGER_FILE} does not fit the plan: {problem}")
        except CheckpointError as e:
            notes.append(f"skipped {e}")
            log.warning("checkpoint skipped: %s", e)
            continue
        if pointer is not None and path.name != pointer:
            if pointed is not None and step > int(pointed.group(1)):  # a crash between its commit and the pointer update
                notes.append(f"{LATEST_FILE} says {pointer!r}; using the newer complete checkpoint {path.name}")
            else:
                notes.append(
                    f"{LATEST_FILE} says {pointer!r}, which is missing or damaged; falling back to the older complete checkpoint "
                    f"{path.name}: the steps after it are trained again"
                )
        if expected_config_hash is not None and ckpt.config_hash != expected_config_hash:
            notes.append(f"{path.name} was written with config hash {ckpt.config_hash!r}, the current config is {expected_config_hash!r}")
        ckpt.notes = notes
        for n in notes:
            log.info("checkpoint: %s", n)
        return ckpt
    if notes:
        log.warning("no usable checkpoint under %s: %s", root, "; ".join(notes))
    if strict and (candidates or pointer is not None):
        raise NoUsableCheckpoint(
            f"no usable checkpoint under {root}: {'; '.join(notes)}. Restore a checkpoint from a backup, or train in a new run directory"
        )
    return None
