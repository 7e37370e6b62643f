"""``dflash-ipc eval``: load the target and an exported drafter, decode prompts both ways, report.

Prompts: the first user turn (with a leading system message) of each chat record of
``--prompts FILE`` or, without it, of the configured ``data.paths``, rendered with the chat
template's generation prompt. Stop tokens: the tokenizer's eos, ``<|im_end|>`` where the
vocabulary has it, and the model's generation-config eos ids.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.data.readers import iter_records, prompt_messages
from dflash_ipc.data.tokenizer import stop_token_ids

log = logging.getLogger(__name__)

__all__ = ["load_prompts", "run_eval"]


def load_prompts(cfg: DFlashConfig, tokenizer, prompts_path: str | None, n: int) -> list[list[int]]:
    paths = [prompts_path] if prompts_path else list(cfg.data.paths)
    out: list[list[int]] = []
    for _, rec in iter_records(paths, cfg.data.builtin_samples, cfg.data.max_seq_len):
        msgs = prompt_messages(rec)
        if msgs is None:
            continue
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids:
            out.append(ids[: cfg.data.max_seq_len])
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"no chat prompts (records with a user turn) in {', '.join(paths)}")
    return out


def run_eval(
    cfg: DFlashConfig,
    drafter_dir: str,
    *,
    prompts_path: str | None = None,
    n: int = 16,
    max_new: int = 128,
    block_size: int = 0,
    dtype: str = "float32",
    target_device: str | None = None,
    drafter_device: str | None = None,
    echo=lambda s: None,
) -> dict:
    """Decode ``n`` prompts greedily and speculatively; the :func:`~dflash_ipc.eval.spec.summarize` report."""
    from dflash_ipc.data.tokenizer import check_target_tokenizer, load_tokenizer
    from dflash_ipc.devices import dtype_from_name
    from dflash_ipc.drafter.export import load_exported_drafter
    from dflash_ipc.eval.spec import (
        DrafterProposer,
        greedy_generate,
        speculative_generate,
        summarize,
    )
    from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
    from dflash_ipc.target.heads import target_head_weights
    from dflash_ipc.target.hf_config import load_hf_config

    tdev = torch.device(target_device or cfg.topology.targets[0])
    ddev = torch.device(drafter_device or cfg.topology.drafters[0])
    tokenizer = load_tokenizer(cfg.target.tokenizer)
    check_target_tokenizer(cfg.target, tokenizer)
    prompts = load_prompts(cfg, tokenizer, prompts_path, n)
    lm = build_target_lm(cfg.target, tdev, vocab_size=len(tokenizer), dtype=dtype)
    hf_config = load_hf_config(cfg.target, vocab_size=len(tokenizer))
    embed, head = target_head_weights(cfg.target, hf_config, ddev, dtype_from_name(dtype))
    drafter = load_exported_drafter(Path(drafter_dir), embed, head, attention="sdpa", device=ddev).to(dtype_from_name(dtype))
    drafter.eval()
    dcfg = drafter.config
    bs = block_size or dcfg.block_size
    if not 1 <= bs <= dcfg.block_size:
        raise ValueError(f"--block-size must be in [1, {dcfg.block_size}] (the drafter's block size); got {bs}")
    target = TargetLM(lm, dcfg.target_layer_ids)
    stops = stop_token_ids(tokenizer, getattr(lm, "generation_config", None))
    if dcfg.mask_token_id in stops:
        echo(
            f"warning: the drafter's mask token {dcfg.mask_token_id} is a stop token; a serving engine that scans "
            "drafts for stop tokens stops early with it (retrain: the default mask token is never a stop token)"
        )
    echo(
        f"eval: {len(prompts)} prompts, block {bs}, max_new {max_new}, {dtype}, target {tdev} (cache rollback: "
        f"{target.rollback}), drafter {ddev}, mask token {dcfg.mask_token_id}, stop ids {sorted(stops)}"
    )
    try:
        # one untimed warm-up of each path (kernel selection, allocator)
        greedy_generate(target, prompts[0], min(4, max_new), stops)
        speculative_generate(target, DrafterProposer(drafter), prompts[0], min(4, max_new), stops, bs, ddev)
        plain, spec = [], []
        for i, p in enumerate(prompts):
            plain.append(greedy_generate(target, p, max_new, stops))
            spec.append(speculative_generate(target, DrafterProposer(drafter), p, max_new, stops, bs, ddev))
            echo(
                f"  prompt {i + 1}/{len(prompts)}: {len(spec[-1].tokens)} tokens, tau {spec[-1].tau:.2f}, "
                f"{'same as greedy' if spec[-1].tokens == plain[-1].tokens else 'DIFFERS from greedy'}"
            )
    finally:
        target.close()
    report = summarize(spec, plain, bs)
    report.update(
        {
            "dtype": dtype,
            "target_device": str(tdev),
            "drafter_device": str(ddev),
            "drafter": str(drafter_dir),
            "cache_rollback": target.rollback,
            "max_new": max_new,
            "mask_token_id": dcfg.mask_token_id,
        }
    )
    return report
