"""Building a drafter: freshly initialised (seeded by run.seed) over the target's frozen embedding and LM
head, its layers optionally copied from the target (``drafter.init_from_target``), over the run's draft
vocabulary when it has one, its trainable linears in FP8 with ``drafter.fp8_linears`` (before anything
compiles or the trainer takes the parameters). What training starts from, and what benches and the export
rebuild (the export without FP8: it only reads the weights)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.data.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab, read_draft_vocab
from dflash_ipc.data.tokenizer import choose_mask_token, load_tokenizer
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.drafter.model.fp8_linears import convert_fp8_linears
from dflash_ipc.drafter.model.init_from_target import apply_init, plan_init
from dflash_ipc.platform.devices import dtype_from_name
from dflash_ipc.target_spec.heads import decoder_stack_shapes, read_decoder_stack, target_head_weights
from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids, text_config

log = logging.getLogger(__name__)


def build_drafter(
    cfg: DFlashConfig, device: torch.device | str, *, log_mask_token: bool = True, draft_vocab: DraftVocab | None = None
) -> DFlashDrafter:
    """A freshly initialised drafter (seeded by run.seed) on the target's frozen embedding and LM head
    (its ``draft_vocab`` rows when ``drafter.draft_vocab_size`` > 0: the run's, :func:`run_draft_vocab`)."""
    device = torch.device(device)
    tokenizer = load_tokenizer(cfg.target.tokenizer)
    hf_config = load_hf_config(cfg.target, vocab_size=len(tokenizer))
    layer_ids = resolve_layer_ids(cfg.target, int(text_config(hf_config).num_hidden_layers))
    if cfg.drafter.mask_token_id >= 0:
        mask_id, why = cfg.drafter.mask_token_id, "drafter.mask_token_id"
    else:
        mask_id, why = choose_mask_token(tokenizer, int(text_config(hf_config).vocab_size))
    if log_mask_token:
        log.info("mask token: id %d (%s)", mask_id, why)
    return drafter_for_target(cfg, hf_config, layer_ids, mask_id, device, draft_vocab)


def run_draft_vocab(cfg: DFlashConfig, run_dir: Path) -> DraftVocab | None:
    """The draft vocabulary `up` chose into ``run_dir`` (None without ``drafter.draft_vocab_size``)."""
    return read_draft_vocab(run_dir / DRAFT_VOCAB_FILE) if cfg.drafter.draft_vocab_size else None


def drafter_for_target(
    cfg: DFlashConfig, hf_config, layer_ids: list[int], mask_id: int, device: torch.device | str, draft_vocab: DraftVocab | None = None
) -> DFlashDrafter:
    """The drafter of ``cfg`` over a target of config ``hf_config`` (its frozen heads read as
    ``cfg.target`` says: the checkpoint's, or random ones without ``target.model_path``)."""
    if bool(cfg.drafter.draft_vocab_size) != (draft_vocab is not None):
        raise ValueError(
            f"drafter.draft_vocab_size = {cfg.drafter.draft_vocab_size} needs the run's draft vocabulary "
            f"(RUN_DIR/{DRAFT_VOCAB_FILE}, chosen by `up`) exactly when it is > 0"
        )
    dtype = dtype_from_name(cfg.drafter.dtype)
    embed, lm_head = target_head_weights(cfg.target, hf_config, device, dtype)
    mcfg = DrafterModelConfig.from_configs(cfg.drafter, hf_config, layer_ids, mask_id)
    model = DFlashDrafter(
        mcfg,
        embed,
        lm_head,
        attention=cfg.drafter.attention,
        device=device,
        dtype=dtype,
        init_seed=cfg.run.seed,
        compile_dense=cfg.drafter.compile,
        draft_token_ids=None if draft_vocab is None else draft_vocab.tensor(),
        target_dtype=dtype_from_name(cfg.target.dtype),  # scaled embeddings round as the target rounds them
    )
    if not mcfg.frozen_head.is_plain:
        log.info("the target's embedding and head: %s (applied by the drafter too)", mcfg.frozen_head.describe())
    if draft_vocab is not None:
        log.info("%s", draft_vocab.describe())
    if cfg.drafter.init_from_target:
        start_from_target(model, cfg, device, dtype)
    if cfg.drafter.fp8_linears != "none":
        use_fp8_linears(model, cfg)
    return model


def use_fp8_linears(model: DFlashDrafter, cfg: DFlashConfig) -> None:
    """``drafter.fp8_linears``: the trainable linears to torchao's float8 training, said in the log (how many)."""
    conversion = convert_fp8_linears(model, cfg.drafter.fp8_linears)
    log.info("%s", conversion.describe())
    if not conversion.converted:
        log.warning("drafter.fp8_linears = %r: no linear layer of this drafter is large enough to gain from FP8", cfg.drafter.fp8_linears)
    elif model.device.type == "cuda" and not cfg.drafter.compile:
        log.warning(
            "drafter.fp8_linears without drafter.compile: every float8 cast and scale runs as a kernel of its own, "
            "which can cost more than the FP8 GEMMs save; set drafter.compile = true"
        )


def start_from_target(model: DFlashDrafter, cfg: DFlashConfig, device: torch.device | str, dtype: torch.dtype) -> None:
    """``drafter.init_from_target``: the drafter's layers, final norm and fc from the target's checkpoint."""
    if not cfg.target.model_path:
        raise ValueError("drafter.init_from_target copies the target's weights from target.model_path; this target is a random spec")
    plan = plan_init(model.config, cfg.drafter.init_from_target, decoder_stack_shapes(cfg.target.model_path))
    apply_init(model, plan, read_decoder_stack(cfg.target.model_path, [src for _, src in plan.copies], device, dtype))
    log.info("drafter start: %s", plan.describe())
