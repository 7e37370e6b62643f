"""`dflash-ipc export`: a run's trained drafter, as a serving engine reads it, and the command that serves it.

    SOURCE (a run directory, its checkpoints/ root, or one checkpoints/step-NNNNNN)
      -> the newest complete checkpoint there (damaged ones skipped, as a resume skips them)
      -> its config (meta.json's extra.config) + the run's draft vocabulary (RUN_DIR/draft_vocab.json)
      -> the drafter rebuilt over the target's frozen embedding / head, the checkpoint's weights loaded
      -> export_drafter(client) -> OUT (0644 files, swapped in whole; OUT missing, empty or a previous export:
         drafter/export/destination.py)  +  the serving command of each engine

Supported versions (their DFlash loaders were read for the layout: drafter/export/layout.py): vLLM 0.33,
SGLang 0.5.23, z-lab ``dflash`` 0.1.0; speculators 0.9.0 converts the layouts without the reduced head rows
with its DFlash converter. The commands per engine and target family: drafter/export/serving.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ipc.drafter.checkpoint.layout import STEP_DIR_RE
from dflash_ipc.drafter.export.destination import check_outside_run, check_replaceable
from dflash_ipc.drafter.export.layout import CLIENTS
from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    client: str
    commands: dict[str, str]
    notes: list[str] = field(default_factory=list)
    # the tau these weights reached, and whether it is worth serving (control/drafter_tau.py); None: not measured
    drafter_tau: dict | None = None
    drafter_tau_line: str = ""

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


def _source_dirs(src: Path) -> tuple[Path, Path, Path | None]:
    """(checkpoint root, run directory, the one checkpoint asked for or None) of ``src``, nothing loaded."""
    from dflash_ipc.rundir.node_spec import read_node_spec

    if not src.is_dir():
        raise ValueError(f"{src}: not a directory; give a run directory or one of its checkpoints/step-NNNNNN")
    if STEP_DIR_RE.match(src.name):
        return src.parent, src.parent.parent, src
    if (src / "latest").exists() or any(STEP_DIR_RE.match(p.name) for p in src.iterdir()):
        return src, src.parent, None
    return read_node_spec(src).checkpoint_root(src), src, None


def _load_source(root: Path, step_dir: Path | None):
    """The checkpoint ``step_dir``, else the newest complete one under ``root``; a ValueError saying what is missing."""
    from dflash_ipc.drafter.checkpoint.store import CheckpointError, load_checkpoint, load_latest_checkpoint

    if step_dir is not None:
        try:
            return load_checkpoint(step_dir)
        except CheckpointError as e:
            raise ValueError(str(e)) from None
    ckpt = load_latest_checkpoint(root)
    if ckpt is None:
        raise ValueError(f"{root}: no complete checkpoint (training.checkpoint_every, or a run that ended, writes one)")
    return ckpt


def export_checkpoint(src: str | Path, out: str | Path, client: str = "all", device: str = "cpu") -> ExportResult:
    """Export the newest complete checkpoint of ``src`` for ``client`` (see the module docstring)."""
    if client not in CLIENTS:
        raise ValueError(f"--for: one of {', '.join(CLIENTS)} (got {client!r})")
    root, run_dir, step_dir = _source_dirs(Path(src))
    out = Path(out).resolve()
    check_outside_run(out, run_dir, root)  # before anything is loaded: a directory the export would not own is refused at once
    check_replaceable(out)
    import torch

    from dflash_ipc.config import ConfigError, config_from_dict
    from dflash_ipc.drafter.export.layout import export_drafter
    from dflash_ipc.drafter.export.serving import TARGET_PLACEHOLDER, render_serving_commands, serving_target, speculators_note
    from dflash_ipc.drafter.model.build import build_drafter, run_draft_vocab

    ckpt = _load_source(root, step_dir)
    raw = ckpt.extra.get("config")
    if not isinstance(raw, dict):
        raise ValueError(f"{ckpt.path}/meta.json: no extra.config (the run's config); export it with a config-bearing checkpoint")
    try:
        cfg = config_from_dict(raw, source=f"{ckpt.path}/meta.json")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    # the weights come from the checkpoint: no start from the target's layers; FP8 matmuls are a training
    # option (same weights, same names): the export builds a plain drafter and needs no torchao
    cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, init_from_target=[], fp8_linears="none"))
    model = build_drafter(cfg, device, log_mask_token=False, draft_vocab=run_draft_vocab(cfg, run_dir))
    try:
        model.load_state_dict({k: v.to(torch.device(device)) for k, v in ckpt.model_state.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{ckpt.path}: its weights do not fit the drafter its config describes: {str(e)[:400]}") from None
    tau = checkpoint_drafter_tau(ckpt)
    path = export_drafter(model, out, chat_template_kwargs=cfg.chat_template.kwargs, client=client, drafter_tau=tau)
    notes = [*ckpt.notes, *client_notes(model.config, client)]
    if not cfg.target.model_path:
        notes.append(f"the run's target is a random spec (no target.model_path): {TARGET_PLACEHOLDER} in the commands stands for it")
    speculators = speculators_note(model.config, client)
    if speculators is not None:
        notes.append(speculators)
    commands = render_serving_commands(path, model.config, serving_target(cfg), client)
    line = tau.describe() if tau is not None else f"no tau recorded with this checkpoint: measure it with {eval_command(run_dir, path)}"
    return ExportResult(path, ckpt.path, ckpt.step, client, commands, notes, tau.metadata() if tau else None, line)


def checkpoint_drafter_tau(ckpt):
    """The τ a checkpoint's weights reached (its meta's extra.drafter_tau), None when it recorded none."""
    from dflash_ipc.control.drafter_tau import DrafterTau
    from dflash_ipc.control.wire import ProtocolError, from_wire

    raw = ckpt.extra.get("drafter_tau")
    try:
        return from_wire(DrafterTau, raw, "extra.drafter_tau") if raw is not None else None
    except ProtocolError:
        return None  # written by another version: measured again by eval, never guessed


def eval_command(run_dir: Path, export_dir: Path) -> str:
    """The `dflash-ipc eval` command that measures an export's τ, with the run's config file where the run recorded it."""
    import json
    import shlex

    from dflash_ipc.config import RESOLVED_CONFIG_FILE

    try:
        config = json.loads((run_dir / RESOLVED_CONFIG_FILE).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        config = "CONFIG"
    return f"dflash-ipc eval --config {shlex.quote(str(config))} --drafter {shlex.quote(str(export_dir))} --n 16"


def client_notes(config: DrafterModelConfig, client: str = "all") -> list[str]:
    """What the clients of ``client``'s layout read differently in this drafter (empty: they all read it as it trained)."""
    notes = []
    last = config.num_target_layers - 1
    if config.num_target_layers and last in config.target_layer_ids:
        notes.append(
            f"target layer {last} is the target's last layer: Hugging Face's hidden_states[{last + 1}] (z-lab's loop) is "
            "its final-normed output, not the raw layer output the drafter trained on (engines may differ too); train with "
            "target.layer_ids below it for a drafter every client serves as it trained"
        )
    return notes + _frozen_head_notes(config, client)


def _frozen_head_notes(config: DrafterModelConfig, client: str) -> list[str]:
    """Where an engine cannot compute the target's embeddings or logits as the drafter trained on them (docs/EVAL.md)."""
    head, engines = config.frozen_head, [c for c in CLIENTS if c != "all"] if client == "all" else [client]
    notes = []
    if head.final_logit_softcap is not None and "vllm" in engines:
        notes.append(
            "vLLM reads no logit soft-cap for a DFlash drafter: it drafts from uncapped logits (greedy drafts as trained; "
            "drafts sampled at T > 0 from another distribution than trained, still verified without loss)"
        )
    if head.embed_scale != 1.0 and "sglang" in engines:
        notes.append(
            "SGLang embeds the block with the target's input-embedding module and reads no scale from the export: the "
            f"drafter sees the embeddings it trained on (x {head.embed_scale:.6g}) only where that module applies the scale (Gemma)"
        )
    return notes
