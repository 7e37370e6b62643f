"""``up --resume``: the checkpoints to resume from were trained by this config.

A checkpoint records the run's config in its ``meta.json`` (``extra.config``, and its hash as
``config_hash``). Before any process starts, every complete checkpoint under the root is
compared with the config of this run, key by key, and a difference in what the checkpoint's
weights, optimizer state or batch ledger mean is refused, naming the keys with both values:
a drafter of 3 layers does not load 2 layers' weights (it failed 41 s after spawn), another
seed or data changes which batches the ledger's ids are. Keys that only say how the run runs
(:data:`MAY_CHANGE`: timeouts, checkpoint cadence, ring sizes, devices, ``training.max_steps``)
may change. A ``config_hash`` that does not match the config stored beside it means meta.json
was edited: refused too. A checkpoint written before configs were stored is compared through
``RUN_DIR/config.json`` when that file's hash is the checkpoint's, else by hash alone. A key added
to the config after the checkpoint was written is kept when this run leaves it at its default.

The checkpoints themselves (:mod:`dflash_ipc.drafter.checkpoint.verify`): at the door the newest one whose
meta, sizes and ledger count hold is found (:func:`check_resume_checkpoints`; when checkpoints exist
and none holds, ``--resume`` is refused: it never trains again from step 0); after the probe has
planned the data, the same with every file's sha256 and the ledger against the new plan, and the
chosen checkpoint's data fingerprint against the data now (:func:`check_resume_data`): changed data
is refused, naming what changed, unless ``up --replan`` asks to re-plan it (the weights and
optimizer continue, the old ledger's ids do not name batches of the new plan: every batch is new).

No torch here: the supervisor runs this (``preflight.validate_for_up``, ``Supervisor.prepare``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from dflash_ipc.config import RESOLVED_CONFIG_FILE, ConfigError, DFlashConfig
from dflash_ipc.data.fingerprint import describe_changes, same_data
from dflash_ipc.drafter.checkpoint.layout import CKPT_FORMAT, META_FILE, STEP_DIR_RE, run_config_hash
from dflash_ipc.drafter.checkpoint.verify import NoUsableCheckpoint, ResumeChoice, choose_checkpoint
from dflash_ipc.rundir import bounded_json

KEY = "--resume"
# Dotted keys (or whole sections, ending in ".") a resumed run may change.
MAY_CHANGE = (
    "run.",
    "transport.",
    "topology.dist_backend",
    "data.cache_dir",
    "data.holdout_paths",
    "target.async_pack",
    "target.varlen",
    "target.attn_implementation",
    "drafter.warm_up",
    "drafter.attention",
    "drafter.flex_tile",  # retired (it changed the attention's tiles, not its result): checkpoints that hold it resume
    "drafter.anchor_chunk",
    "drafter.fp8_linears",  # the same weights and names either way: only the matmuls' precision differs
    "training.max_steps",
    "training.max_seconds",
    "training.checkpoint_every",
    "training.keep_checkpoints",
    "training.export_on_finish",
    "training.checkpoint_on_finish",
    "training.holdout_every",
    "training.holdout_batches",
    "training.holdout_max_new",
    "training.max_consecutive_skipped_updates",
)
# run.seed orders the batches the ledger names: not operational although it sits in [run].
MUST_MATCH = ("run.seed",)


# With --replan the data may change: re-planning it is what the flag asks for.
MAY_CHANGE_ON_REPLAN = ("data.",)


def check_resume_config(cfg: DFlashConfig, ckpt_root: Path, *, replan: bool = False) -> None:
    """Refuse resuming from any complete checkpoint under ``ckpt_root`` that another config wrote."""
    if not ckpt_root.is_dir():
        return
    current = json.loads(json.dumps(cfg.to_dict()))
    for step_dir in sorted(p for p in ckpt_root.iterdir() if STEP_DIR_RE.match(p.name)):
        meta = _read_meta(step_dir)
        if meta is None:
            continue  # incomplete or damaged: loading skips it too
        stored, origin = _stored_config(meta, step_dir, ckpt_root)
        recorded = meta.get("config_hash", "")
        if stored is None:
            if recorded and recorded != run_config_hash(current):
                _fail(
                    cfg,
                    f"{step_dir} was written by another config (hash {recorded!r}, this config's is "
                    f"{run_config_hash(current)!r}) and holds no copy of it to name the keys that differ: resume with that "
                    "config, or start a new run directory",
                )
            continue
        diff = config_differences(stored, current, MAY_CHANGE_ON_REPLAN if replan else ())
        if diff:
            listed = "; ".join(f"{k}: {_show(a)} in the checkpoint, {_show(b)} now" for k, a, b in diff[:8])
            more = f"; and {len(diff) - 8} more" if len(diff) > 8 else ""
            raise ConfigError.at(
                cfg.source,
                diff[0][0],
                f"differs from the config of the checkpoint {step_dir} ({origin}): {listed}{more}. "
                "A resumed run keeps what the checkpoint trained; change these back, or train them in a new run directory",
            )


def _read_meta(step_dir: Path) -> dict[str, Any] | None:
    try:
        meta = bounded_json.read(step_dir / META_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != CKPT_FORMAT:
        return None
    return meta


def _stored_config(meta: dict[str, Any], step_dir: Path, ckpt_root: Path) -> tuple[dict[str, Any] | None, str]:
    extra = meta.get("extra")
    stored = extra.get("config") if isinstance(extra, dict) else None
    recorded = meta.get("config_hash", "")
    if isinstance(stored, dict) and isinstance(stored.get("training"), dict):
        if recorded != run_config_hash(stored):
            raise ConfigError.at(
                str(step_dir / META_FILE),
                "config_hash",
                f"is {recorded!r} but the config stored beside it hashes to {run_config_hash(stored)!r}: this meta.json "
                "was edited; restore it from a backup, or start a new run directory",
            )
        return stored, "stored in its meta.json"
    # older checkpoints: the run directory's frozen config, if it is the one that wrote them
    frozen_path = ckpt_root.parent / RESOLVED_CONFIG_FILE
    try:
        frozen = bounded_json.read(frozen_path)["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""
    if isinstance(frozen, dict) and isinstance(frozen.get("training"), dict) and run_config_hash(frozen) == recorded:
        return frozen, f"{frozen_path}, whose hash it records"
    return None, ""


def config_differences(
    stored: dict[str, Any], current: dict[str, Any], also_may_change: tuple[str, ...] = ()
) -> list[tuple[str, Any, Any]]:
    """(dotted key, checkpoint's value, this run's value) for every key a resumed run must keep.

    A key the checkpoint lacks because a later version added it counts as kept while this run holds
    its default: a new option's default is the behaviour from before it existed, so upgrading
    dflash-ipc between a checkpoint and its resume changes nothing the checkpoint means."""
    a, b = _flatten(stored), _flatten(current)
    defaults = _flatten(json.loads(json.dumps(DFlashConfig().to_dict())))
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in MUST_MATCH and key.startswith(MAY_CHANGE + also_may_change):
            continue
        if key not in a and key in defaults and b.get(key) == defaults[key]:
            continue
        if a.get(key, _ABSENT) != b.get(key, _ABSENT):
            out.append((key, a.get(key, _ABSENT), b.get(key, _ABSENT)))
    return out


_ABSENT = "(absent)"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif key in ("topology.targets", "topology.drafters") and isinstance(v, list):
            out[key] = f"{len(v)} processes"  # devices may move; the shards and data-parallel ranks may not
        else:
            out[key] = v
    return out


def _show(v: Any) -> str:
    text = v if isinstance(v, str) and (v == _ABSENT or v.endswith(" processes")) else json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(cfg: DFlashConfig, message: str) -> NoReturn:
    raise ConfigError.at(cfg.source, KEY, message)


def check_resume_checkpoints(
    cfg: DFlashConfig, ckpt_root: Path, *, digests: bool = False, plan: dict[str, Any] | None = None
) -> ResumeChoice:
    """The checkpoint ``--resume`` continues from (``checkpoint.verify.choose_checkpoint``); checkpoints that
    all fail are refused, naming each one's fault. ``digests`` and ``plan`` as there."""
    try:
        return choose_checkpoint(ckpt_root, digests=digests, plan=plan)
    except NoUsableCheckpoint as e:
        _fail(cfg, str(e))


def check_resume_data(cfg: DFlashConfig, choice: ResumeChoice, plan: dict[str, Any], *, replan: bool) -> tuple[bool, str | None]:
    """The chosen checkpoint's data against the data planned now: (re-planned, the line `up` prints).
    Changed data is refused, naming what changed, unless ``replan``."""
    extra = choice.meta.get("extra")
    old = extra.get("data") if isinstance(extra, dict) else None
    new = plan.get("data_fingerprint")
    if choice.path is None or same_data(old, new):
        return False, ("--replan: the data is as the checkpoint's; nothing re-planned" if replan and choice.path is not None else None)
    changes = "; ".join(describe_changes(old, new)) or "its digest differs"
    if not replan:
        _fail(
            cfg,
            f"the data changed since the checkpoint {choice.path} was written: {changes}. Its ledger's batch ids would name "
            "other samples (some trained twice, some never): put the data back, or pass --replan to re-plan the changed data",
        )
    return True, (
        f"--replan: the data changed since {choice.path.name} ({changes}); re-planned: {plan.get('n_batches_total')} batches, "
        f"all new (the checkpoint's {len(choice.ledger)} consumed batches were ids of the old plan); the weights and optimizer "
        f"continue from step {choice.meta.get('step')}"
    )
