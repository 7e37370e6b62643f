"""``dflash-ipc gen-data``: self-distilled training data, the target answering the configured prompts.

Each chat record's prompt is its *first* user turn (with a leading system message, if any);
later turns are dropped, because the target's own answer to turn one would no longer match
the conversation's later turns. Text records have no prompt and are skipped.

Output, one JSON object per line (the corpus's chat format, so it trains as is)::

    {"id": "...", "conversations": [..prompt.., {"role": "assistant", "content": "<target's answer>",
                                                  "token_ids": [<the generated ids>]}],
     "finish": "stop" | "length", "tokenizer_vocab": "sha256:..."}

``token_ids`` are the answer's ids as the target generated them (the stop token left out); the
corpus trains on them, not on the text, which is for people: decoding and re-tokenizing does not
always give the same ids back. The message's text fields are the ones the chat template renders
back into the generated text (:func:`~dflash_ipc.data.answer_message.answer_message`: gpt-oss's
analysis channel as ``thinking`` and its final channel as ``content``; a ``<think>`` block stays in
the content, where Qwen3's and DeepSeek-R1's templates look for it). ``tokenizer_vocab`` (:func:`~dflash_ipc.data.tokenizer.vocab_identity`)
says which vocabulary they belong to; the corpus refuses them under another one.

The held-out split is by the *prompt* (:func:`prompt_key`: the system message and first user turn,
canonical JSON): prompts whose sha256 falls below ``holdout_fraction`` go to ``OUT.holdout.jsonl``
beside ``OUT`` (prompts for ``dflash-ipc eval --prompts`` and ``data.holdout_paths``), the same on
every run and machine. A prompt already seen (the built-in corpus repeats questions: 20,000 records
hold 10,705 distinct first user turns) is skipped and counted (``duplicate_prompts``), so no
held-out prompt is ever trained on. Resuming appends to both files and skips the ids and prompts
already in either (a torn last line of an interrupted run is ignored and redone).

Generation is batched (left-padded, sorted by prompt length) with transformers' ``generate``
on the target's device: greedy, or sampled with temperature / top-p, up to ``max_new``
tokens, stopping at the chat template's end-of-turn token. A model that left padding would change
(:func:`padding_problem`: Llama 4) decodes each batch in groups of one prompt length, unpadded, on the
dynamic cache.

Decoding (``GenOptions.decode``, ``gen-data --decode``): ``dynamic`` is ``generate``'s default cache
(it grows by concatenation; every decode step launches each layer's kernels from Python, so a small
model's step time hardly grows with the batch and the batch size sets the rate: docs/EVAL.md);
``static`` preallocates the KV cache for ``width + max_new`` tokens (attention-only models: a
hybrid model's own cache stays, transformers ignores the flag); ``compiled`` adds a
``torch.compile``d decode step on that static cache (``CompileConfig``, inductor's
``reduce-overhead``: CUDA graphs, no per-kernel launch from Python). With a static cache the
left-padded width is rounded up to a power of two, so batches of similar prompts reuse one
compiled graph (shapes, not values, decide a recompile). Greedy outputs are the same ids in
every mode (tests/datagen/test_gen_data.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.data.answer_message import answer_message
from dflash_ipc.data.readers import iter_records, prompt_messages, record_id
from dflash_ipc.data.records import ANSWER_IDS_FIELD, VOCAB_FIELD
from dflash_ipc.families import family_of

log = logging.getLogger(__name__)

__all__ = [
    "DECODE_MODES",
    "GenOptions",
    "done_ids",
    "generate_batch",
    "holdout_path",
    "is_holdout",
    "padding_problem",
    "prompt_key",
    "run_gen_data",
    "truncate_torn_tail",
]


DECODE_MODES = ("dynamic", "static", "compiled")


@dataclass(frozen=True)
class GenOptions:
    batch_size: int = 16
    max_new: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    holdout_fraction: float = 0.0
    limit: int = 0  # 0: every prompt
    seed: int = 0
    decode: str = "dynamic"  # one of DECODE_MODES
    compile_backend: str = "inductor"  # torch.compile backend of decode = "compiled"

    def __post_init__(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)} (got {self.decode!r})")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {self.batch_size})")
        if self.max_new < 1:
            raise ValueError(f"max_new must be >= 1 (got {self.max_new})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy; got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in [0, 1) (got {self.holdout_fraction})")
        if self.limit < 0:
            raise ValueError(f"limit must be >= 0 (got {self.limit})")

    def sampling(self, max_new: int, temperature: float, top_p: float) -> GenOptions:
        """These options (batch, decode mode) for sampling text of another kind (synthesized user turns)."""
        return dataclasses.replace(self, max_new=max_new, temperature=temperature, top_p=top_p, holdout_fraction=0.0, limit=0)


def holdout_path(out: Path) -> Path:
    return out.with_name(out.stem + ".holdout" + (out.suffix or ".jsonl"))


def prompt_key(messages: list[dict]) -> str:
    """A prompt's identity for dedup and the split: its messages (system + first user turn) as canonical JSON."""
    return json.dumps([{"role": m.get("role"), "content": m.get("content")} for m in messages], ensure_ascii=False, sort_keys=True)


def is_holdout(key: str, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(key) as a fraction of 2**64 (gen-data: key = prompt_key)."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def done_ids(*paths: Path) -> tuple[set[str], set[str]]:
    """Ids and prompt keys of complete lines already written (a torn or foreign line is ignored)."""
    ids: set[str] = set()
    prompts: set[str] = set()
    for p in paths:
        if not p.exists():
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    ids.add(str(rec["id"]))
                    prompts.add(prompt_key(rec["conversations"][:-1]))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
    return ids, prompts


def truncate_torn_tail(path: Path) -> None:
    """An interrupted write can leave a last line without its newline: cut it, so appends start clean."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)


def read_complete_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file that this command appends to: a torn last line is cut off the file
    first, a line that does not parse is skipped."""
    truncate_torn_tail(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, echo: Callable[[str], None]):
        self.total, self.done, self.echo, self.t0 = total, 0, echo, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=False)
            self.bar.start()
            self.task = self.bar.add_task("gen-data", total=total)

    def advance(self, n: int, tokens: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n)
        else:
            rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
            self.echo(f"gen-data: {self.done}/{self.total} prompts ({rate:.2f}/s, last batch {tokens} new tokens)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_gen_data(
    cfg: DFlashConfig,
    out: Path,
    opts: GenOptions,
    *,
    prompts_path: str | None = None,
    device: str | None = None,
    echo: Callable[[str], None] = lambda s: None,
    get_lm: Callable[[], torch.nn.Module] | None = None,
) -> dict:
    """Answer the prompts with the target; returns counts (written, skipped as done, held out).
    ``get_lm``: gives the target's causal LM (loaded once by the caller), else it is loaded here; either only
    when something is left to answer."""
    from dflash_ipc.data.tokenizer import check_target_tokenizer, config_tokenizer
    from dflash_ipc.eval.target_lm import build_target_lm

    out = Path(out)
    hold = holdout_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in (out, hold):
        truncate_torn_tail(p)
    tokenizer = config_tokenizer(cfg)  # prompts rendered with the [chat_template] kwargs
    check_target_tokenizer(cfg.target, tokenizer)
    paths = [prompts_path] if prompts_path else list(cfg.data.paths)
    clash = [p for p in paths if not p.startswith("builtin:") and Path(p).resolve() in (out.resolve(), hold.resolve())]
    if clash:
        raise ValueError(f"the prompts ({clash[0]}) are the output file; pass --prompts (e.g. builtin:stdlib-docs) or another --out")
    pending, counts = pending_prompts(cfg, paths, tokenizer, opts.limit, *done_ids(out, hold))
    result = {"out": str(out), "holdout": str(hold), "to_generate": len(pending), **counts, "written": 0, "held_out": 0, "new_tokens": 0}
    echo(
        f"gen-data: {len(pending)} prompts to answer ({counts['skipped_done']} already done, {counts['duplicate_prompts']} "
        f"repeated prompts skipped, {counts['no_prompt']} records without a user turn)"
    )
    if not pending:
        return result
    if get_lm is not None:
        lm = get_lm()
    else:
        lm = build_target_lm(cfg.target, torch.device(device or cfg.topology.targets[0]), vocab_size=len(tokenizer))
    answer_prompts(cfg, lm, tokenizer, pending, opts, out, hold, result, echo)
    return result


def pending_prompts(
    cfg: DFlashConfig, paths: list[str], tokenizer, limit: int, done: set[str], done_prompts: set[str]
) -> tuple[list[tuple[str, list[dict], list[int]]], dict[str, int]]:
    """The records still to answer, as (id, prompt messages, rendered prompt ids), in reading order, up
    to ``limit`` records counting those already done; and the counts of what was skipped and why."""
    pending: list[tuple[str, list[dict], list[int]]] = []
    seen: set[str] = set()
    seen_prompts: set[str] = set()
    skipped_done = no_prompt = duplicates = duplicate_prompts = 0
    for where, rec in iter_records(paths, cfg.data.builtin_samples, cfg.data.max_seq_len):
        if limit and len(pending) + skipped_done >= limit:  # before the record: all done is also done
            break
        rid = record_id(where, rec)
        if rid in seen:
            duplicates += 1
            continue
        seen.add(rid)
        if rid in done:
            skipped_done += 1
            continue
        msgs = prompt_messages(rec)
        if msgs is None:
            no_prompt += 1
            continue
        key = prompt_key(msgs)
        if key in done_prompts:  # answered already, under another id
            skipped_done += 1
            continue
        if key in seen_prompts:
            duplicate_prompts += 1
            continue
        seen_prompts.add(key)
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        pending.append((rid, msgs, tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.data.max_seq_len]))
    counts = {"skipped_done": skipped_done, "no_prompt": no_prompt, "duplicate_ids": duplicates, "duplicate_prompts": duplicate_prompts}
    return pending, counts


def answer_prompts(
    cfg: DFlashConfig,
    lm,
    tokenizer,
    pending: list[tuple[str, list[dict], list[int]]],
    opts: GenOptions,
    out: Path,
    hold: Path,
    result: dict,
    echo: Callable[[str], None],
) -> None:
    """Generate the answers shortest prompt first, in batches, appending each record to ``out`` or
    (held out by its prompt's hash) ``hold``, flushed after every batch; counts go into ``result``."""
    from dflash_ipc.data.tokenizer import stop_token_ids, vocab_identity

    stops = stop_token_ids(tokenizer, getattr(lm, "generation_config", None))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(f"{cfg.target.tokenizer}: the tokenizer has neither a pad nor an eos token to pad batches with")
    pending.sort(key=lambda r: len(r[2]))
    unpadded = padding_problem(lm)
    if unpadded:
        echo(f"gen-data: {unpadded}: each batch decodes its prompts in groups of one length, unpadded, on the dynamic cache")
    vocab = vocab_identity(tokenizer)
    progress = _Progress(len(pending), echo)
    try:
        with open(out, "a", encoding="utf-8") as f_out, open(hold, "a", encoding="utf-8") as f_hold:
            for b in range(0, len(pending), opts.batch_size):
                batch = pending[b : b + opts.batch_size]
                answers = generate_batch(lm, [r[2] for r in batch], pad_id, stops, opts, seed=opts.seed * 1_000_003 + b)
                new_tokens = 0
                for (rid, msgs, _), (ids, finish) in zip(batch, answers):
                    new_tokens += len(ids)
                    answer = {**answer_message(tokenizer, msgs, ids), ANSWER_IDS_FIELD: ids}
                    record = {"id": rid, "conversations": msgs + [answer], "finish": finish, VOCAB_FIELD: vocab}
                    line = json.dumps(record, ensure_ascii=False)
                    held = is_holdout(prompt_key(msgs), opts.holdout_fraction)
                    (f_hold if held else f_out).write(line + "\n")
                    result["held_out" if held else "written"] += 1
                f_out.flush()
                f_hold.flush()
                result["new_tokens"] += new_tokens
                progress.advance(len(batch), new_tokens)
    finally:
        progress.close()


def padding_problem(lm) -> str | None:
    """Why left padding would change ``lm``'s answers (None: it does not). Llama 4 scales its NoPE layers'
    queries by the token's index in the cache, not by its position id, so pads move every later token's scale."""
    family = family_of(lm.config)
    tuned = [i for i, layer in enumerate(family.attention_layers) if layer.temperature_tuning is not None]
    if tuned:
        return f"{family.name}'s position-scaled queries (layers {tuned}) count left padding as positions"
    return None


@torch.no_grad()
def generate_batch(lm, prompts: list[list[int]], pad_id: int, stops: set[int], opts: GenOptions, seed: int) -> list[tuple[list[int], str]]:
    """Left-padded batched generation; per prompt (new ids without the stop token, "stop"|"length"). A model
    that left padding would change (:func:`padding_problem`) decodes the batch in groups of one prompt length
    each, unpadded, so every answer is the one the prompt gets alone, on the dynamic cache: on a static one
    every prompt length would be a new shape (a compile each)."""
    if opts.temperature > 0:
        torch.manual_seed(seed)
    if padding_problem(lm) is None:
        return _generate(lm, prompts, pad_id, stops, opts)
    unpadded = dataclasses.replace(opts, decode="dynamic")
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out: list[tuple[list[int], str]] = [([], "length")] * len(prompts)
    for rows in by_length.values():
        for i, answer in zip(rows, _generate(lm, [prompts[i] for i in rows], pad_id, stops, unpadded)):
            out[i] = answer
    return out


def _generate(lm, prompts: list[list[int]], pad_id: int, stops: set[int], opts: GenOptions) -> list[tuple[list[int], str]]:
    """One ``generate`` call over ``prompts``, left-padded to one width."""
    dev = next(lm.parameters()).device
    asked = len(prompts)
    width = max(len(p) for p in prompts)
    if opts.decode != "dynamic":
        width = max(16, 1 << (width - 1).bit_length())  # a power of two: one compiled graph per width class
        # a short last batch would be a new shape (a recompile, and a step towards dynamo's recompile limit): fill
        # it with copies of its last prompt and drop their answers
        prompts = list(prompts) + [prompts[-1]] * (opts.batch_size - asked)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    sample = opts.temperature > 0
    kwargs = {"do_sample": sample}
    if sample:
        kwargs.update(temperature=opts.temperature, top_p=opts.top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    kwargs.update(_decode_kwargs(opts))
    gen = lm.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        max_new_tokens=opts.max_new,
        eos_token_id=sorted(stops),
        pad_token_id=pad_id,
        **kwargs,
    )
    out = []
    for row in gen[:asked, width:].tolist():
        cut = next((k for k, t in enumerate(row) if t in stops), None)
        out.append((row[:cut], "stop") if cut is not None else (row, "length"))
    return out


def _decode_kwargs(opts: GenOptions) -> dict:
    """``generate`` keywords of ``opts.decode``: none (dynamic cache), a static cache, or a static cache
    with a compiled forward (on every device: a CPU run compiles too, as asked)."""
    if opts.decode == "dynamic":
        return {}
    if opts.decode == "static":
        return {"cache_implementation": "static"}
    from transformers import CompileConfig

    # reduce-overhead (CUDA graphs) is inductor's mode; another backend takes no mode
    cc = CompileConfig(backend=opts.compile_backend, mode="reduce-overhead" if opts.compile_backend == "inductor" else None)
    cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
    return {"cache_implementation": "static", "compile_config": cc}
