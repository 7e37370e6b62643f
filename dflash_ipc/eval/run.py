"""``dflash-ipc eval``: load the target and an exported drafter, decode prompts both ways, report.

Prompts: the first user turn (with a leading system message) of each chat record of
``--prompts FILE`` or, without it, of the configured ``data.paths``, rendered with the chat
template's generation prompt. Stop tokens: the tokenizer's eos, ``<|im_end|>`` where the
vocabulary has it, and the model's generation-config eos ids.

``--workers N`` (per target device; ``--target-device`` may list several, each worker's drafter
then runs on its target's device) decodes the prompts in N spawned processes per device, each
loading the target and the drafter; prompt ``i`` goes to worker ``i % total``. Results are merged
exactly: the per-prompt results are put back in prompt order and summarized as one run (pooled τ =
tokens / verification steps, acceptance per position from the pooled steps, lossless = every
prompt). Speed is not measured under that concurrency: the first ``--speed-prompts`` prompts are
decoded alone first (both ways, in this process) and ``tokens_per_s_*`` / ``speedup`` come from them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from dflash_ipc.config import DFlashConfig, config_from_dict
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
    workers: int = 1,
    speed_prompts: int = 4,
    echo=lambda s: None,
) -> dict:
    """Decode ``n`` prompts greedily and speculatively; the :func:`~dflash_ipc.eval.spec.summarize` report."""
    from dflash_ipc.data.tokenizer import check_target_tokenizer, load_tokenizer
    from dflash_ipc.drafter.export import read_export
    from dflash_ipc.eval.spec import summarize

    if workers < 1 or speed_prompts < 1:
        raise ValueError(f"--workers and --speed-prompts must be >= 1 (got {workers}, {speed_prompts})")
    tdevs = [d.strip() for d in (target_device or cfg.topology.targets[0]).split(",") if d.strip()]
    if len(tdevs) > 1 and drafter_device:
        raise ValueError("--drafter-device with several --target-device entries: each worker's drafter runs on its target's device")
    ddevs = tdevs if len(tdevs) > 1 else [drafter_device or cfg.topology.drafters[0]]
    read_export(drafter_dir)  # a damaged export is named now, not after the target is loaded
    tokenizer = load_tokenizer(cfg.target.tokenizer)
    check_target_tokenizer(cfg.target, tokenizer)
    prompts = load_prompts(cfg, tokenizer, prompts_path, n)
    job = _Job(cfg.to_dict(), cfg.source, str(drafter_dir), max_new, block_size, dtype)
    total = min(workers * len(tdevs), len(prompts))
    if total == 1:
        plain, spec, info = _decode(job, tdevs[0], ddevs[0], list(enumerate(prompts)), echo, len(prompts))
        report = summarize(spec, plain, info["block_size"])
        report["speed_prompts"] = len(prompts)
        report["speed_measured"] = "every prompt, decoded one at a time in one process"
    else:
        k = min(speed_prompts, len(prompts))
        echo(f"eval: speed on {k} prompts decoded alone, then {len(prompts)} prompts in {total} worker processes")
        speed_plain, speed_spec, info = _decode(job, tdevs[0], ddevs[0], list(enumerate(prompts[:k])), echo, len(prompts))
        speed = summarize(speed_spec, speed_plain, info["block_size"])
        shards = [[(i, p) for i, p in enumerate(prompts) if i % total == w] for w in range(total)]
        threads = max(1, (os.cpu_count() or 1) // total) if tdevs[0] == "cpu" else 0
        with ProcessPoolExecutor(total, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_worker, job, tdevs[w % len(tdevs)], ddevs[w % len(ddevs)], shards[w], threads) for w in range(total)]
            done = sorted((r for f in futures for r in f.result()), key=lambda r: r[0])
        plain, spec = [r[1] for r in done], [r[2] for r in done]
        echo(f"eval: {sum(a.tokens == b.tokens for a, b in zip(spec, plain))}/{len(spec)} prompts equal greedy")
        report = summarize(spec, plain, info["block_size"])
        for key in ("tokens_per_s_spec", "tokens_per_s_greedy", "speedup"):
            report[key] = speed[key]
        report["speed_prompts"] = k
        report["speed_measured"] = f"the first {k} prompts decoded alone in one process, before the {total} workers ran"
    report.update(
        {
            "workers": total,
            "dtype": dtype,
            "target_device": ",".join(tdevs),
            "drafter_device": ",".join(ddevs),
            "drafter": str(drafter_dir),
            "cache_rollback": info["rollback"],
            "max_new": max_new,
            "mask_token_id": info["mask_token_id"],
        }
    )
    return report


class _Job(NamedTuple):
    """What every eval process needs to load the models (picklable: spawned workers rebuild the config)."""

    cfg: dict
    source: str
    drafter_dir: str
    max_new: int
    block_size: int
    dtype: str


def _worker(job: _Job, tdev: str, ddev: str, shard: list[tuple[int, list[int]]], threads: int) -> list[tuple]:
    if threads:
        torch.set_num_threads(threads)
    plain, spec, _ = _decode(job, tdev, ddev, shard, lambda s: None, 0)
    return [(i, a, b) for (i, _), a, b in zip(shard, plain, spec)]


def _decode(job: _Job, tdev_name: str, ddev_name: str, prompts: list[tuple[int, list[int]]], echo, n_total: int):
    """Load target and drafter on the given devices, decode ``prompts`` both ways (after an untimed warm-up)."""
    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.devices import dtype_from_name
    from dflash_ipc.drafter.export import load_exported_drafter
    from dflash_ipc.eval.spec import DrafterProposer, greedy_generate, speculative_generate
    from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
    from dflash_ipc.target.heads import target_head_weights
    from dflash_ipc.target.hf_config import load_hf_config

    cfg_dict, source, drafter_dir, max_new, block_size, dtype = job
    cfg = config_from_dict(cfg_dict, source)
    tdev, ddev = torch.device(tdev_name), torch.device(ddev_name)
    tokenizer = load_tokenizer(cfg.target.tokenizer)
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
    if n_total and dcfg.mask_token_id in stops:
        echo(
            f"warning: the drafter's mask token {dcfg.mask_token_id} is a stop token; a serving engine that scans "
            "drafts for stop tokens stops early with it (retrain: the default mask token is never a stop token)"
        )
    if n_total:
        echo(
            f"eval: {n_total} prompts, block {bs}, max_new {max_new}, {dtype}, target {tdev} (cache rollback: "
            f"{target.rollback}), drafter {ddev}, mask token {dcfg.mask_token_id}, stop ids {sorted(stops)}"
        )
    info = {"block_size": bs, "rollback": target.rollback, "mask_token_id": dcfg.mask_token_id}
    try:
        # one untimed warm-up of each path (kernel selection, allocator)
        greedy_generate(target, prompts[0][1], min(4, max_new), stops)
        speculative_generate(target, DrafterProposer(drafter), prompts[0][1], min(4, max_new), stops, bs, ddev)
        plain, spec = [], []
        for i, p in prompts:
            plain.append(greedy_generate(target, p, max_new, stops))
            spec.append(speculative_generate(target, DrafterProposer(drafter), p, max_new, stops, bs, ddev))
            echo(
                f"  prompt {i + 1}: {len(spec[-1].tokens)} tokens, tau {spec[-1].tau:.2f}, "
                f"{'same as greedy' if spec[-1].tokens == plain[-1].tokens else 'DIFFERS from greedy'}"
            )
    finally:
        target.close()
    return plain, spec, info
