"""``dflash-ipc eval``: load the target and an exported drafter, decode prompt sets both ways, report.

Prompts: ``--prompts FILE`` (or each set of ``--suite``) is read by :mod:`dflash_ipc.eval.prompts`,
every record by its fields (chat, MT-Bench, HumanEval, GSM8K, Alpaca, plain prompt; ``humaneval``
by name), a record no format reads is an error naming ``file:line``. Without ``--prompts``, the
first user turn of each chat record of the configured ``data.paths`` (other records skipped). Chat
prompts are rendered with the chat template's generation prompt. Stop tokens: the tokenizer's eos,
``<|im_end|>`` where the vocabulary has it, and the model's generation-config eos ids.

A suite is several named sets decoded by one set of processes (models loaded once per process):
each set is summarized on its own (:func:`~dflash_ipc.eval.spec.summarize`), ``run_eval`` is the
suite of one set.

``--workers N`` (per target device; ``--target-device`` may list several, each worker's drafter
then runs on its target's device) decodes the prompts in N worker processes per device, each
loading the target and the drafter; the prompts of all sets, in order, go round-robin to the
workers. Results are merged exactly: the per-prompt results are put back in prompt order and each
set summarized as one run (pooled τ = tokens / verification steps, acceptance per position from
the pooled steps, lossless = every prompt). Speed is not measured under that concurrency: the first
``--speed-prompts`` prompts of each set are decoded alone first (both ways, in this process) and
``tokens_per_s_*`` / ``speedup`` come from them, with their own τ (``speed_tau``) beside; since that τ
may be far from the set's, ``speedup_at_set_tau`` applies their measured step costs to the set's τ.
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
from dflash_ipc.eval.prompts import EvalPrompt, read_eval_prompts, set_name
from dflash_ipc.platform.third_party_logs import quiet_import_notes

log = logging.getLogger(__name__)

__all__ = ["format_suite_table", "load_prompts", "run_eval", "run_suite"]


def render_prompt(tokenizer, prompt: EvalPrompt, max_len: int, messages: list[dict] | None = None) -> list[int]:
    """Token ids of ``prompt`` (or of ``messages``, a later turn of it): the chat template with the
    generation prompt, or the raw text as is."""
    if prompt.raw is not None and messages is None:
        return tokenizer(prompt.raw)["input_ids"][:max_len]
    text = tokenizer.apply_chat_template(list(messages or prompt.messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_len]


def _config_prompts(cfg: DFlashConfig, n: int) -> list[EvalPrompt]:
    out = []
    for where, rec in iter_records(list(cfg.data.paths), cfg.data.builtin_samples, cfg.data.max_seq_len):
        msgs = prompt_messages(rec)
        if msgs is not None:
            out.append(EvalPrompt(where, "chat", tuple(msgs)))
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"no chat prompts (records with a user turn) in {', '.join(cfg.data.paths)}")
    return out


def _read_set(cfg: DFlashConfig, source: str | None, n: int, options: dict) -> list[EvalPrompt]:
    return _config_prompts(cfg, n) if source is None else read_eval_prompts(source, n, **options)


def load_prompts(cfg: DFlashConfig, tokenizer, prompts_path: str | None, n: int, **options) -> list[list[int]]:
    """Token ids of the first turn of the first ``n`` prompts (``options``: see :func:`read_eval_prompts`)."""
    return [render_prompt(tokenizer, p, cfg.data.max_seq_len) for p in _read_set(cfg, prompts_path, n, options)]


def _with_quantization(cfg: DFlashConfig, quantization: str, dtype: str, tdevs: list[str]) -> DFlashConfig:
    """The config with eval's target quantization (``--target-quantization`` or target.quantization),
    refused before any model loads where the target devices cannot run it."""
    import dataclasses

    from dflash_ipc.platform.devices import dtype_from_name
    from dflash_ipc.target.fp8 import fp8_device_problem

    if quantization == "none":
        return dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, quantization="none"))
    if quantization != "fp8":
        raise ValueError(f"target quantization must be none or fp8 (got {quantization!r})")
    for dev in tdevs:
        problem = fp8_device_problem(dev, dtype_from_name(dtype))
        if problem:
            raise ValueError(f"--target-quantization fp8 (target.quantization) on {dev}: {problem} (eval: --dtype bfloat16 on such a GPU)")
    return dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, quantization="fp8", dtype=dtype))


class _Job(NamedTuple):
    """What every eval process needs to load the models (picklable: spawned workers rebuild the config)."""

    cfg: dict
    source: str
    drafter_dir: str
    max_new: int
    block_size: int
    dtype: str
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class _Item(NamedTuple):
    """One prompt to decode: ``key`` = (set index, prompt index), its first turn's ids, the prompt."""

    key: tuple[int, int]
    ids: list[int]
    prompt: EvalPrompt


def run_eval(cfg: DFlashConfig, drafter_dir: str, *, prompts_path: str | None = None, **kwargs) -> dict:
    """Decode the first ``n`` prompts greedily and speculatively; the set's report (see :func:`run_suite`)."""
    name = set_name(prompts_path)[0] if prompts_path else "data.paths"
    suite = run_suite(cfg, drafter_dir, [(name, prompts_path)], **kwargs)
    report = suite["sets"][name]
    report.update({k: v for k, v in suite.items() if k != "sets"})
    return report


def run_suite(
    cfg: DFlashConfig,
    drafter_dir: str,
    sets: list[tuple[str, str | None]],
    *,
    n: int = 16,
    max_new: int = 128,
    block_size: int = 0,
    dtype: str = "float32",
    target_device: str | None = None,
    drafter_device: str | None = None,
    workers: int = 1,
    speed_prompts: int = 4,
    humaneval_as: str = "chat",
    mt_bench_turns: str = "first",
    target_quantization: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    echo=lambda s: None,
) -> dict:
    """Decode the first ``n`` prompts of each ``(name, source)`` set (source None: ``data.paths``) both
    ways; ``{"sets": {name: summarize report + speed fields}, ...run-wide fields}``."""
    from dflash_ipc.data.tokenizer import check_target_tokenizer, config_tokenizer
    from dflash_ipc.drafter.export.layout import read_export

    _check_suite_options(sets, workers, speed_prompts, temperature, top_p)
    names = [name for name, _ in sets]
    tdevs, ddevs = _suite_devices(cfg, target_device, drafter_device)
    cfg = _with_quantization(cfg, target_quantization or cfg.target.quantization, dtype, tdevs)
    read_export(drafter_dir)  # a damaged export is named now, not after the target is loaded
    check_template_kwargs(cfg, drafter_dir, echo)
    tokenizer = config_tokenizer(cfg)
    check_target_tokenizer(cfg.target, tokenizer)
    options = {"humaneval_as": humaneval_as, "mt_bench_turns": mt_bench_turns}
    items: list[list[_Item]] = []
    for s, (_, source) in enumerate(sets):
        prompts = _read_set(cfg, source, n, options)
        items.append([_Item((s, i), render_prompt(tokenizer, p, cfg.data.max_seq_len), p) for i, p in enumerate(prompts)])
    job = _Job(cfg.to_dict(), cfg.source, str(drafter_dir), max_new, block_size, dtype, temperature, top_p, seed)
    decoded = _decode_suite(job, items, names, tdevs, ddevs, workers, speed_prompts, echo)
    decoder = decoded.decoder
    reports = {}
    for s, name in enumerate(names):
        rep = _set_report(
            [r for r in decoded.results if r[0][0] == s],
            [r for r in decoded.speed if r[0][0] == s],
            decoder.block_size,
            items[s],
            sets[s][1],
        )
        rep["speed_measured"] = decoded.measured
        _add_lossless_check(rep, name, temperature, echo)
        reports[name] = rep
    return {
        "sets": reports,
        "workers": decoded.workers,
        "dtype": dtype,
        "target_device": ",".join(tdevs),
        "drafter_device": ",".join(ddevs),
        "drafter": str(drafter_dir),
        "cache_rollback": decoder.rollback,
        "max_new": max_new,
        "chat_template_kwargs": cfg.chat_template.kwargs,
        "mask_token_id": decoder.mask_token_id,
        "humaneval_as": humaneval_as,
        "mt_bench_turns": mt_bench_turns,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "baseline": "plain greedy decoding" if temperature == 0 else f"plain sampling at T={temperature:g}, top-p {top_p:g}",
    }


def _check_suite_options(sets: list[tuple[str, str | None]], workers: int, speed_prompts: int, temperature: float, top_p: float) -> None:
    if workers < 1 or speed_prompts < 1:
        raise ValueError(f"--workers and --speed-prompts must be >= 1 (got {workers}, {speed_prompts})")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"--temperature must be >= 0 and --top-p in (0, 1] (got {temperature}, {top_p})")
    if temperature == 0 and top_p != 1:
        raise ValueError("--top-p needs --temperature > 0 (T = 0 decodes greedily)")
    names = [name for name, _ in sets]
    if not sets or len(set(names)) != len(names):
        raise ValueError(f"eval sets need distinct names (got {names}): name them NAME=PATH")


def _suite_devices(cfg: DFlashConfig, target_device: str | None, drafter_device: str | None) -> tuple[list[str], list[str]]:
    """The targets' devices (comma-separated, one worker group each) and the drafters': one per target when
    there are several, else ``drafter_device`` or the config's first drafter."""
    tdevs = [d.strip() for d in (target_device or cfg.topology.targets[0]).split(",") if d.strip()]
    if len(tdevs) > 1 and drafter_device:
        raise ValueError("--drafter-device with several --target-device entries: each worker's drafter runs on its target's device")
    return tdevs, (tdevs if len(tdevs) > 1 else [drafter_device or cfg.topology.drafters[0]])


class _Decoded(NamedTuple):
    """What :func:`_decode_suite` decoded: every prompt's result, the prompts timed alone, how the speed was
    measured, the number of workers, and the (closed) decoder that describes the run."""

    results: list[tuple]
    speed: list[tuple]
    measured: str
    workers: int
    decoder: _Decoder


def _decode_suite(job: _Job, items: list[list[_Item]], names: list[str], tdevs, ddevs, workers: int, speed_prompts: int, echo) -> _Decoded:
    """Every prompt decoded both ways: in this process when one worker is asked for; else the first
    ``speed_prompts`` of each set alone here (the speed figures), then all of them in worker processes."""
    flat = [it for group in items for it in group]
    total = min(workers * len(tdevs), len(flat))
    decoder = _Decoder(job, tdevs[0], ddevs[0])
    try:
        decoder.describe(echo, len(flat), names)
        if total == 1:
            speed = results = decoder.decode(flat, echo, names)
            measured = "every prompt, decoded one at a time in one process"
        else:
            k = min(speed_prompts, max(len(g) for g in items))
            echo(f"eval: speed on up to {k} prompts per set decoded alone, then {len(flat)} prompts in {total} worker processes")
            speed = decoder.decode([it for g in items for it in g[:k]], echo, names)
            measured = f"the first {k} prompts of the set decoded alone in one process, before the {total} workers ran"
    finally:
        decoder.close()
    if total > 1:
        shards = [flat[w::total] for w in range(total)]
        threads = max(1, (os.cpu_count() or 1) // total) if tdevs[0] == "cpu" else 0
        with ProcessPoolExecutor(total, mp_context=_worker_context(tdevs + ddevs)) as pool:
            futures = [pool.submit(_worker, job, tdevs[w % len(tdevs)], ddevs[w % len(ddevs)], shards[w], threads) for w in range(total)]
            results = sorted((r for f in futures for r in f.result()), key=lambda r: r[0])
    return _Decoded(results, speed, measured, total, decoder)


def _add_lossless_check(rep: dict, name: str, temperature: float, echo) -> None:
    """Greedy: the outputs must equal plain greedy decoding token for token. Sampled outputs differ from
    any one reference run by design: the check is distributional."""
    if temperature > 0:
        rep.update(
            lossless=None, mismatched_prompts=[], lossless_check=f"distributional at T={temperature:g} (not compared token by token)"
        )
        echo(f"eval {name}: tau {rep['tau']:.2f} at T={temperature:g}")
    else:
        rep["lossless_check"] = "token-exact against greedy decoding"
        echo(f"eval {name}: {rep['prompts'] - len(rep['mismatched_prompts'])}/{rep['prompts']} equal greedy")


def check_template_kwargs(cfg: DFlashConfig, drafter_dir: str, echo) -> None:
    """Refuse a drafter trained on chats rendered with other ``[chat_template] kwargs`` than eval's."""
    from dflash_ipc.drafter.export.layout import recorded_chat_template_kwargs

    recorded, configured = recorded_chat_template_kwargs(drafter_dir), cfg.chat_template.kwargs
    if recorded is None:
        echo(f"warning: {drafter_dir} records no chat_template_kwargs (an older export): eval renders with {configured}")
    elif recorded != configured:
        raise ValueError(
            f"{drafter_dir} was trained on chats rendered with chat-template kwargs {recorded}, but {cfg.source} sets "
            f"[chat_template] kwargs = {configured}: the drafter would see other prompts than it learned; set them alike"
        )


def _set_report(results: list[tuple], speed: list[tuple], block_size: int, items: list[_Item], source: str | None) -> dict:
    from dflash_ipc.eval.spec import summarize

    report = summarize([r[2] for r in results], [r[1] for r in results], block_size)
    timed = summarize([r[2] for r in speed], [r[1] for r in speed], block_size)
    for key in ("tokens_per_s_spec", "tokens_per_s_greedy", "speedup"):
        report[key] = timed[key]
    report["speed_tau"] = timed["tau"]
    report["speedup_at_set_tau"] = _speedup_at_tau(speed, report["tau"])
    formats: dict[str, int] = {}
    for it in items:
        formats[it.prompt.format] = formats.get(it.prompt.format, 0) + 1
    report.update({"source": source or "data.paths", "records": len(items), "formats": formats, "speed_prompts": timed["prompts"]})
    return report


def _worker_context(devices: list[str]):
    """How the workers start: on the CPU forked from multiprocessing's fork server, which imports torch,
    transformers and this module once for them all (and never touches CUDA); with a CUDA device each is a
    new Python ("spawn"), as a process that initializes CUDA needs. The fork server is the standard
    library's: it ends when this process does."""
    if any(d != "cpu" for d in devices):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", __name__])
    return ctx


def _worker(job: _Job, tdev: str, ddev: str, items: list[_Item], threads: int) -> list[tuple]:
    quiet_import_notes()
    if threads:
        torch.set_num_threads(threads)
    decoder = _Decoder(job, tdev, ddev)
    try:
        return decoder.decode(items, lambda s: None, [])
    finally:
        decoder.close()


class _Decoder:
    """Target and drafter loaded on the given devices; decodes items both ways. Call :meth:`close`."""

    def __init__(self, job: _Job, tdev_name: str, ddev_name: str):
        from dflash_ipc.data.tokenizer import config_tokenizer
        from dflash_ipc.drafter.export.layout import load_exported_drafter
        from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
        from dflash_ipc.families import family_of
        from dflash_ipc.platform.devices import dtype_from_name
        from dflash_ipc.target_spec.heads import target_head_weights
        from dflash_ipc.target_spec.hf_config import load_hf_config

        cfg_dict, source, drafter_dir, self.max_new, block_size, self.dtype, self.temperature, self.top_p, self.seed = job
        self.cfg = config_from_dict(cfg_dict, source)
        self.tdev, self.ddev = torch.device(tdev_name), torch.device(ddev_name)
        self.tokenizer = config_tokenizer(self.cfg)
        lm = build_target_lm(self.cfg.target, self.tdev, vocab_size=len(self.tokenizer), dtype=self.dtype)
        hf_config = load_hf_config(self.cfg.target, vocab_size=len(self.tokenizer))
        embed, head = target_head_weights(self.cfg.target, hf_config, self.ddev, dtype_from_name(self.dtype))
        drafter = load_exported_drafter(Path(drafter_dir), embed, head, attention="sdpa", device=self.ddev)
        self.drafter = drafter.to(dtype_from_name(self.dtype))
        self.drafter.eval()
        dcfg = self.drafter.config
        # the drafter embeds and finishes its logits as its export records (as it trained); the target may differ
        self.target_head = family_of(hf_config).frozen_head()
        self.block_size = block_size or dcfg.block_size
        if not 1 <= self.block_size <= dcfg.block_size:
            raise ValueError(f"--block-size must be in [1, {dcfg.block_size}] (the drafter's block size); got {self.block_size}")
        self.mask_token_id = dcfg.mask_token_id
        self.target = TargetLM(lm, dcfg.target_layer_ids)
        self.rollback = self.target.rollback
        self.stops = stop_token_ids(self.tokenizer, getattr(lm, "generation_config", None))
        self._warm = False

    def describe(self, echo, n_total: int, names: list[str]) -> None:
        if self.target_head != self.drafter.config.frozen_head:
            echo(
                f"warning: the drafter trained on other embeddings or logits than this target gives (the target's embedding "
                f"and head: {self.target_head.describe()}; the export's: {self.drafter.config.frozen_head.describe()})"
            )
        if self.mask_token_id in self.stops:
            echo(
                f"warning: the drafter's mask token {self.mask_token_id} is a stop token; a serving engine that scans "
                "drafts for stop tokens stops early with it (retrain: the default mask token is never a stop token)"
            )
        echo(
            f"eval: {n_total} prompts in {len(names)} set(s) ({', '.join(names)}), block {self.block_size}, max_new {self.max_new}, "
            f"{self.dtype}, target {self.tdev} (cache rollback: {self.rollback}), drafter {self.ddev}, "
            f"mask token {self.mask_token_id}, stop ids {sorted(self.stops)}"
        )

    def close(self) -> None:
        self.target.close()
        self.target = self.drafter = None  # the models go now, not when the report is done

    def _samplers(self, key: tuple[int, ...]):
        """Greedy (None, None), or one seeded sampler per decode of this prompt (plain and speculative)."""
        from dflash_ipc.eval.sampling import SpecSampler, prompt_seed

        if self.temperature == 0:
            return None, None
        seed = prompt_seed(self.seed, key)
        return tuple(SpecSampler(self.temperature, self.top_p, seed, self.tdev) for _ in range(2))

    def _both(self, ids: list[int], key: tuple[int, ...]):
        from dflash_ipc.eval.spec import DrafterProposer, first_divergence, greedy_generate, speculative_generate

        plain_s, spec_s = self._samplers(key)
        plain = greedy_generate(self.target, ids, self.max_new, self.stops, plain_s)
        proposer = DrafterProposer(self.drafter)
        spec = speculative_generate(self.target, proposer, ids, self.max_new, self.stops, self.block_size, self.ddev, spec_s)
        if self.temperature == 0 and spec.tokens != plain.tokens:  # after both timings: not part of either
            spec.divergence = first_divergence(self.target, ids, plain.tokens, spec.tokens)
        return plain, spec

    def _verdict(self, plain, spec) -> str:
        if self.temperature > 0:
            return f"sampled at T={self.temperature:g}"
        if spec.tokens == plain.tokens:
            return "same as greedy"
        d = spec.divergence or {}
        gap = "" if d.get("logit_gap") is None else f", target logit gap {d['logit_gap']:g} between the two"
        return f"DIFFERS from greedy at token {d.get('token', '?')}{gap}"

    def decode(self, items: list[_Item], echo, names: list[str]) -> list[tuple]:
        """``[((set, prompt, turn), plain, spec)]``: every turn of every item, in order."""
        from dflash_ipc.data.answer_message import answer_message
        from dflash_ipc.eval.spec import DrafterProposer, greedy_generate, speculative_generate

        if not self._warm and items:  # one untimed warm-up of each path (kernel selection, allocator)
            ids, few = items[0].ids, min(4, self.max_new)
            plain_s, spec_s = self._samplers((-1,))
            greedy_generate(self.target, ids, few, self.stops, plain_s)
            speculative_generate(self.target, DrafterProposer(self.drafter), ids, few, self.stops, self.block_size, self.ddev, spec_s)
            self._warm = True
        out = []
        for it in items:
            messages, ids = list(it.prompt.messages), it.ids
            for turn in range(1 + len(it.prompt.followups)):
                if turn:
                    # the next user turn after the target's own answer, as a chat client sends it back
                    answer = [t for t in out[-1][2].tokens if t not in self.stops]
                    messages += [
                        answer_message(self.tokenizer, messages, answer),  # the fields the template reads (gpt-oss: thinking)
                        {"role": "user", "content": it.prompt.followups[turn - 1]},
                    ]
                    ids = render_prompt(self.tokenizer, it.prompt, self.cfg.data.max_seq_len, messages)
                plain, spec = self._both(ids, (*it.key, turn))
                out.append(((*it.key, turn), plain, spec))
                if names:
                    echo(
                        f"  {names[it.key[0]]} prompt {it.key[1] + 1}{f' turn {turn + 1}' if turn else ''}: {len(spec.tokens)} tokens, "
                        f"tau {spec.tau:.2f}, {self._verdict(plain, spec)}"
                    )
        return out


def _speedup_at_tau(speed: list[tuple], tau: float) -> float:
    """The set's speed-up at its pooled τ, from the timed prompts' measured costs. A few timed prompts carry
    their own τ, which may be far from the set's; the cost of a verify step (draft + verify) hardly depends
    on how many of its tokens are accepted, so the timed prompts' tokens made at the set's τ take
    ``produced / τ`` steps (``produced``: their tokens from verify steps, the prefill's first token aside)
    at the measured seconds per step, against the measured plain tokens/s."""
    spec = [r[2] for r in speed]
    steps = sum(len(g.steps) for g in spec)
    produced = sum(len(st.tokens) for g in spec for st in g.steps)
    spec_s, spec_tokens = sum(g.seconds for g in spec), sum(len(g.tokens) for g in spec)
    plain_s, plain_tokens = sum(r[1].seconds for r in speed), sum(len(r[1].tokens) for r in speed)
    if not steps or tau <= 0 or spec_s <= 0 or plain_s <= 0 or plain_tokens == 0:
        return 0.0
    seconds_at_tau = (produced / tau) * (spec_s / steps)
    return round((spec_tokens / seconds_at_tau) / (plain_tokens / plain_s), 4)


def _lossless_cell(report: dict) -> str:
    if report["lossless"] is None:
        return "distributional"
    if report["lossless"]:
        return "yes"
    gap = report.get("max_logit_gap_at_divergence")
    return f"NO ({len(report['mismatched_prompts'])} differ{'' if gap is None else f', logit gap <= {gap:g}'})"


def format_suite_table(suite: dict) -> str:
    """One line per set: prompts, τ, acceptance per position, speculative / plain tokens/s (plain: greedy
    decoding, or plain sampling at T > 0) of the timed prompts, their own τ, the speed-up at the set's τ
    (:func:`_speedup_at_tau`), lossless."""
    header = (
        "set",
        "prompts",
        "tau",
        "acceptance per position",
        "spec tok/s",
        "plain tok/s",
        "spec/plain",
        "timed tau",
        "at set tau",
        "lossless",
    )
    rows = [header]
    for name, r in suite["sets"].items():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        rows.append(
            (
                name,
                str(r["prompts"]),
                f"{r['tau']:.2f}",
                acc,
                f"{r['tokens_per_s_spec']:.1f}",
                f"{r['tokens_per_s_greedy']:.1f}",
                f"{r['speedup']:.2f}x",
                f"{r['speed_tau']:.2f}",
                f"{r['speedup_at_set_tau']:.2f}x",
                _lossless_cell(r),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
