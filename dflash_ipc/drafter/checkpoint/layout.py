"""A checkpoint root's names, and what can be read from it without torch.

The file names and the step-directory pattern live here so the supervisor (which never imports
torch: runtime/probe.py) can tell how far a run got from ``latest`` and ``meta.json`` alone;
:mod:`dflash_ipc.drafter.checkpoint.store` writes and loads the payloads under the same names.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from dflash_ipc.rundir import bounded_json
from dflash_ipc.rundir.ledger import LEDGER_FILE, LEDGER_FORMAT  # noqa: F401 - a checkpoint's names, the ledger's among them

CKPT_FORMAT = "dflash-ipc-ckpt/1"
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
OPTIM_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
LATEST_FILE = "latest"
STEP_DIR_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def read_latest_pointer(ckpt_root: Path | str) -> str | None:
    try:
        name = (Path(ckpt_root) / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, OSError):
        return None
    return name or None


def latest_committed_step(ckpt_root: Path | str) -> int | None:
    """The step ``latest`` points at, if that directory's meta.json (written last) agrees; else None.

    A cheap look, not a validation: loading still checks every file and falls back past damage."""
    name = read_latest_pointer(ckpt_root)
    m = STEP_DIR_RE.match(name or "")
    if not m:
        return None
    try:
        meta = bounded_json.read(Path(ckpt_root) / name / META_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != CKPT_FORMAT or meta.get("step") != int(m.group(1)):
        return None
    return int(m.group(1))


def config_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able config (e.g. ``DFlashConfig.to_dict()``)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_config_hash(config: dict[str, Any]) -> str:
    """The hash a checkpoint's meta.json records: of the run's config, ``training.max_steps`` and
    ``training.max_seconds`` left out (a resumed run may train further)."""
    training = {k: v for k, v in config["training"].items() if k != "max_seconds"}
    return config_hash(config | {"training": {**training, "max_steps": None}})
