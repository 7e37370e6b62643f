"""`dflash-ipc export`: a run's trained drafter, as a serving engine reads it, and the command that serves it.

    SOURCE (a run directory, its checkpoints/ root, or one checkpoints/step-NNNNNN)
      -> the newest complete checkpoint there (damaged ones skipped, as a resume skips them)
      -> its config (meta.json's extra.config) + the run's draft vocabulary (RUN_DIR/draft_vocab.json)
      -> the drafter rebuilt over the target's frozen embedding / head, the checkpoint's weights loaded
      -> export_drafter(client) -> OUT (0644 files, swapped in whole; OUT missing, empty or a previous export:
         drafter/export_target.py)  +  the serving command of each engine

Supported versions (their DFlash loaders were read for the layout: drafter/export.py): vLLM 0.33,
SGLang 0.5.23, z-lab ``dflash`` 0.1.0; speculators 0.9.0 converts the export with its DFlash converter.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ipc.drafter.ckpt_layout import STEP_DIR_RE
from dflash_ipc.drafter.export import CLIENTS, carries_reduced_head
from dflash_ipc.drafter.export_target import check_outside_run, check_replaceable
from dflash_ipc.drafter.model import FULL, SLIDING, DrafterModelConfig

SUPPORTED = {"vllm": "vLLM 0.33", "sglang": "SGLang 0.5.23", "zlab": "z-lab dflash 0.1.0"}


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    client: str
    commands: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


def _source_dirs(src: Path) -> tuple[Path, Path, Path | None]:
    """(checkpoint root, run directory, the one checkpoint asked for or None) of ``src``, nothing loaded."""
    from dflash_ipc.node_spec import read_node_spec

    if not src.is_dir():
        raise ValueError(f"{src}: not a directory; give a run directory or one of its checkpoints/step-NNNNNN")
    if STEP_DIR_RE.match(src.name):
        return src.parent, src.parent.parent, src
    if (src / "latest").exists() or any(STEP_DIR_RE.match(p.name) for p in src.iterdir()):
        return src, src.parent, None
    return read_node_spec(src).checkpoint_root(src), src, None


def _load_source(root: Path, step_dir: Path | None):
    """The checkpoint ``step_dir``, else the newest complete one under ``root``; a ValueError saying what is missing."""
    from dflash_ipc.drafter.checkpoint import CheckpointError, load_checkpoint, load_latest_checkpoint

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
    from dflash_ipc.drafter.build import build_drafter, run_draft_vocab
    from dflash_ipc.drafter.export import export_drafter

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
    path = export_drafter(model, out, chat_template_kwargs=cfg.chat_template.kwargs, client=client)
    target = cfg.target.model_path or "TARGET"
    notes = [*ckpt.notes, *client_notes(model.config)]
    if not cfg.target.model_path:
        notes.append("the run's target is a random spec (no target.model_path): TARGET in the commands stands for it")
    commands = serving_commands(path, model.config, target, cfg.chat_template.kwargs, client)
    return ExportResult(path, ckpt.path, ckpt.step, client, commands, notes)


def client_notes(config: DrafterModelConfig) -> list[str]:
    """What the clients read differently in this drafter (empty: they all read it as it trained)."""
    last = config.num_target_layers - 1
    if config.num_target_layers and last in config.target_layer_ids:
        return [
            f"target layer {last} is the target's last layer: Hugging Face's hidden_states[{last + 1}] (z-lab's loop) is "
            "its final-normed output, not the raw layer output the drafter trained on (engines may differ too); train with "
            "target.layer_ids below it for a drafter every client serves as it trained"
        ]
    return []


def serving_commands(out: Path, config: DrafterModelConfig, target: str, chat_kwargs: dict, client: str = "all") -> dict[str, str]:
    """The command (z-lab: the Python lines) that serves export ``out`` with ``target``, per engine of ``client``."""
    engines = list(SUPPORTED) if client == "all" else [client]
    out_s, kwargs = str(Path(out).resolve()), dict(chat_kwargs or {})
    head = "own head rows (lm_head + d2t)" if carries_reduced_head(config) else "the target's whole head"
    cmds: dict[str, str] = {}
    if "vllm" in engines:
        spec = json.dumps({"method": "dflash", "model": out_s, "num_speculative_tokens": config.block_size - 1})
        mixed = SLIDING in config.layer_types and FULL in config.layer_types
        line = f"{'VLLM_USE_V2_MODEL_RUNNER=1 ' if mixed else ''}vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"
        if kwargs:
            line += f" --default-chat-template-kwargs {shlex.quote(json.dumps(kwargs))}"
        cmds["vllm"] = f"# {SUPPORTED['vllm']}; drafts over {head}\n{line}"
    if "sglang" in engines:
        line = (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {shlex.quote(out_s)} --speculative-num-draft-tokens {config.block_size}"
        )
        note = f"# {SUPPORTED['sglang']}; drafts over the target's whole head"
        if kwargs:
            note += f'; send "chat_template_kwargs": {json.dumps(kwargs)} with each chat request (as trained)'
        cmds["sglang"] = f"{note}\n{line}"
    if "zlab" in engines:
        template_kwargs = "".join(f", {k}={v!r}" for k, v in kwargs.items())
        cmds["zlab"] = "\n".join(
            [
                f"# {SUPPORTED['zlab']} route (AutoModel + the export's own modeling code); drafts over {head}",
                "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
                f"draft = AutoModel.from_pretrained({out_s!r}, trust_remote_code=True, dtype='auto').eval()",
                f"target = AutoModelForCausalLM.from_pretrained({target!r}, dtype='auto').eval()",
                f"tok = AutoTokenizer.from_pretrained({target!r})",
                "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hello'}], add_generation_prompt=True, "
                f"return_tensors='pt', return_dict=False{template_kwargs})",
                "out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[tok.eos_token_id])",
                "# or z-lab's own loop: dflash.model.dflash_generate(draft, target, ids, 256, [tok.eos_token_id])",
            ]
        )
    return cmds
