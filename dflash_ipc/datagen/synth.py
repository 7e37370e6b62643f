"""Prompt synthesis by the target (``dflash-ipc gen-data --prompts synth:N``): the Magpie technique
(arXiv 2406.08464). Given only its chat template up to the start of a user turn, an aligned model
writes a realistic user request; the target's answers to those requests then train the drafter on
the kind of traffic the target serves, with no data set downloaded.

The pre-query prefix comes from the tokenizer's own chat template (:mod:`dflash_ipc.datagen.prequery`): a
conversation with a sentinel user message is rendered and cut at the sentinel, so a default system
prompt the template injects is kept and nothing is hard-coded per model. A tokenizer without a chat
template is refused.

Sampling is batched on the target's device (gen-data's generation: ``synth.temperature`` / ``top_p``,
up to ``synth.max_prompt_tokens``, stopping at the end-of-turn token), and every sample goes through
the filters of :mod:`dflash_ipc.datagen.synth_filters`. Steering: batch ``k`` renders the system prompt
``synth.system_prompts[k % len]`` with ``{topic}`` = ``synth.topics[k % len]``; the stored request
keeps only the user turn, so the answers are written to the request alone, as users send it.

Files beside gen-data's ``OUT``::

    OUT.prompts.jsonl      kept requests, whole sampling batches in order:
                           {"id": "synth-<seed>-<batch>-<row>", "batch": k, "conversations": [{"role": "user", ...}]}
    OUT.synth-state.json   sampling batches done, samples drawn, removals by reason (written after each batch)
    OUT.diversity.json     the diversity report of the kept requests (synth_filters.diversity_report)

Resume: batch ``k`` is sampled with a seed of ``(synth.seed, k)`` alone, and the filters' index is
rebuilt from the kept requests, so a stopped run continues at the next batch and gives the same
requests as one that never stopped. gen-data answers the first ``N`` requests of the file.

State of a synthesis run::

    read OUT.prompts.jsonl (torn tail cut) -> index rebuilt -> [kept < N and draws left]
        -> sample batch k -> filter -> append its kept rows -> write state -> k += 1 -> [...]
    -> kept >= N (or draws exhausted: fewer, said) -> diversity report -> gen-data answers them
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_ipc.config import DFlashConfig
from dflash_ipc.datagen.gen import GenOptions, generate_batch, read_complete_jsonl, run_gen_data
from dflash_ipc.datagen.prequery import pre_query_template, user_turn_stops
from dflash_ipc.datagen.synth_filters import PromptFilter, diversity_report, format_report
from dflash_ipc.datagen.synth_turns import extend_turns
from dflash_ipc.rundir.fsutil import write_text_atomic

__all__ = [
    "SYNTH_PREFIX",
    "diversity_path",
    "parse_synth_spec",
    "run_synth_gen_data",
    "synth_prompts_path",
    "synthesize_prompts",
]

SYNTH_PREFIX = "synth:"


def parse_synth_spec(spec: str | None) -> int | None:
    """``synth:N`` -> N (None for any other prompt source); a bad N is a ValueError."""
    if not spec or not spec.startswith(SYNTH_PREFIX):
        return None
    raw = spec[len(SYNTH_PREFIX) :]
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"--prompts {spec}: synth:N needs a number of prompts N >= 1 (e.g. synth:2000)")
    return int(raw)


def _sidecar(out: Path, suffix: str) -> Path:
    return out.with_name(out.stem + suffix)


def synth_prompts_path(out: Path) -> Path:
    return _sidecar(Path(out), ".prompts.jsonl")


def diversity_path(out: Path) -> Path:
    return _sidecar(Path(out), ".diversity.json")


def _state_path(out: Path) -> Path:
    return _sidecar(Path(out), ".synth-state.json")


def _steering(cfg_synth, batch: int) -> str | None:
    if not cfg_synth.system_prompts:
        return None
    system = cfg_synth.system_prompts[batch % len(cfg_synth.system_prompts)]
    if cfg_synth.topics and "{topic}" in system:
        system = system.replace("{topic}", cfg_synth.topics[batch % len(cfg_synth.topics)])
    return system


def _read_kept(path: Path) -> list[dict]:
    """The complete lines of the prompts file (a torn last line is cut off the file)."""
    rows = []
    for rec in read_complete_jsonl(path):
        try:
            rows.append({"id": str(rec["id"]), "batch": int(rec["batch"]), "text": rec["conversations"][0]["content"]})
        except (ValueError, KeyError, TypeError, IndexError):
            continue
    return rows


def synthesize_prompts(
    cfg: DFlashConfig,
    tokenizer,
    get_lm: Callable[[], Any],
    out: Path,
    n: int,
    gen: GenOptions,
    echo: Callable[[str], None] = lambda s: None,
) -> dict:
    """Sample until ``OUT.prompts.jsonl`` holds at least ``n`` kept requests (or the draws run out);
    write the diversity report; return it with the counts of this call. ``gen``: gen-data's options, whose
    batch size and decode mode the sampling uses (``synth.*`` sets the rest)."""
    import time

    sc = cfg.synth
    out = Path(out)
    path, state_path = synth_prompts_path(out), _state_path(out)
    special = list(tokenizer.all_special_tokens) + [str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()]
    filt = PromptFilter(sc, special)
    kept = _read_kept(path)
    for row in kept:  # rebuild the index: these were kept before
        filt.add_kept(row["text"])
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    next_batch = max([int(state.get("next_batch", 0))] + [r["batch"] + 1 for r in kept])
    sampled = int(state.get("sampled", 0))
    filt.dropped.update({k: int(v) for k, v in state.get("dropped", {}).items() if k in filt.dropped})
    max_draws = math.ceil(n * sc.max_draws_per_prompt)
    new = 0
    seconds = 0.0
    batch_size = gen.batch_size
    if len(kept) < n:
        where = f"batch {next_batch} (batch {batch_size}, {gen.decode} decoding)"
        echo(f"synth: {len(kept)} of {n} prompts kept already; sampling from {where}")
        lm = get_lm()
        stops = user_turn_stops(tokenizer, getattr(lm, "generation_config", None))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        opts = gen.sampling(sc.max_prompt_tokens, sc.temperature, sc.top_p)
        t0, sampled_before = time.perf_counter(), sampled
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            while len(kept) < n and sampled < max_draws:
                k = next_batch
                prefix = pre_query_template(tokenizer, _steering(sc, k))
                ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
                rows = generate_batch(lm, [ids] * batch_size, pad_id, stops, opts, seed=sc.seed * 1_000_003 + k)
                lines = []
                for r, (gen_ids, finish) in enumerate(rows):
                    text = tokenizer.decode(gen_ids, skip_special_tokens=False).strip()
                    if filt.reason(text, finish == "stop") is None:
                        rid = f"synth-{sc.seed}-{k}-{r}"
                        kept.append({"id": rid, "batch": k, "text": text})
                        lines.append(
                            json.dumps({"id": rid, "batch": k, "conversations": [{"role": "user", "content": text}]}, ensure_ascii=False)
                        )
                        new += 1
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                sampled += len(rows)
                next_batch = k + 1
                write_text_atomic(state_path, json.dumps({"next_batch": next_batch, "sampled": sampled, "dropped": dict(filt.dropped)}))
                rate = (sampled - sampled_before) / max(time.perf_counter() - t0, 1e-9)
                echo(f"synth: {len(kept)}/{n} prompts kept, {sampled} sampled ({rate:.1f} samples/s)")
                # The budget is checked after a batch, never before the first: every call makes progress.
                if sc.max_seconds and time.perf_counter() - t0 >= sc.max_seconds:
                    break
        seconds = time.perf_counter() - t0
        if len(kept) < n and sampled >= max_draws:
            echo(f"synth: stopped at {len(kept)} prompts: {sampled} samples drawn (synth.max_draws_per_prompt = {sc.max_draws_per_prompt})")
        elif len(kept) < n:
            echo(f"synth: stopped at {len(kept)} prompts after {seconds:.0f} s (synth.max_seconds; the same command continues)")
    report = diversity_report([r["text"] for r in kept], dict(filt.dropped), sampled)
    write_text_atomic(diversity_path(out), json.dumps(report, indent=2))
    echo(format_report(report))
    return {
        "prompts_file": str(path),
        "kept": len(kept),
        "new": new,
        "sampled": sampled,
        "seconds": round(seconds, 2),
        "diversity": str(diversity_path(out)),
    }


def run_synth_gen_data(
    cfg: DFlashConfig,
    out: Path,
    opts: GenOptions,
    n: int,
    *,
    device: str | None = None,
    echo: Callable[[str], None] = lambda s: None,
) -> dict:
    """``gen-data --prompts synth:N``: synthesize N requests (resumable), then answer the first N as gen-data
    answers any prompt file (held-out split by prompt hash, token ids stored); the target is loaded once."""
    import torch

    from dflash_ipc.data.tokenizer import check_target_tokenizer, load_tokenizer
    from dflash_ipc.eval.target_lm import build_target_lm

    tokenizer = load_tokenizer(cfg.target.tokenizer)
    check_target_tokenizer(cfg.target, tokenizer)
    pre_query_template(tokenizer)  # refuse a tokenizer without a usable chat template before loading the model
    loaded: list = []

    def get_lm():
        if not loaded:
            loaded.append(build_target_lm(cfg.target, torch.device(device or cfg.topology.targets[0]), vocab_size=len(tokenizer)))
        return loaded[0]

    synth = synthesize_prompts(cfg, tokenizer, get_lm, out, n, opts, echo)
    limit = min(opts.limit or n, n)
    result = run_gen_data(
        cfg, out, dataclasses.replace(opts, limit=limit), prompts_path=synth["prompts_file"], device=device, echo=echo, get_lm=get_lm
    )
    result["synth"] = synth
    if cfg.synth.multi_turn_fraction > 0:
        result["multi_turn"] = extend_turns(cfg, tokenizer, get_lm, out, opts, echo)
    return result
