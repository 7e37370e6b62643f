"""The offline built-in corpus ``builtin:stdlib-docs``: chats built from the docstrings of the
running Python's standard library (no network, no data files).

:func:`stdlib_doc_entries` collects the docstrings in an isolated subprocess
(:mod:`dflash_ipc.data.stdlib_docs_collector`); :func:`builtin_conversations` turns them into a
deterministic mix of single Q&A pairs, multi-turn chats and long reference answers. The corpus
loader (:mod:`dflash_ipc.data.corpus`) tokenizes them like JSONL records; the built-in
tokenizer's asset is trained on the same docstrings (:mod:`dflash_ipc.data.tokenizer_asset`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_ipc.data import stdlib_docs_collector
from dflash_ipc.data.errors import DataError

BUILTIN_STDLIB_DOCS = "builtin:stdlib-docs"


@dataclass(frozen=True)
class DocEntry:
    module: str
    name: str  # dotted, e.g. "json.JSONEncoder.encode"
    kind: str  # module | class | function | method
    doc: str


@functools.lru_cache(maxsize=1)
def stdlib_doc_entries() -> tuple[DocEntry, ...]:
    """Docstrings of the standard library's modules, classes, functions and methods, sorted by
    module and name. Collected by :mod:`dflash_ipc.data.stdlib_docs_collector` in an isolated
    subprocess of this interpreter (about 1 s); cached for the life of the process."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-X", "utf8", str(Path(stdlib_docs_collector.__file__))],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"{BUILTIN_STDLIB_DOCS}: could not collect the standard library docs: {e}") from None
    if proc.returncode != 0:
        raise DataError(
            f"{BUILTIN_STDLIB_DOCS}: doc collector failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}"
        )
    data = json.loads(proc.stdout.decode("utf-8"))
    entries = tuple(DocEntry(*e) for e in data["entries"])
    if not entries:
        raise DataError(f"{BUILTIN_STDLIB_DOCS}: no docstrings found in the standard library")
    return entries


_SYSTEM_PROMPTS = [
    "You are a helpful assistant that explains the Python standard library.",
    "You are an expert Python developer. Answer with the official documentation.",
    "Answer questions about Python modules precisely.",
]
_FIRST_PROMPTS = {
    "module": ["Explain the `{n}` module.", "What is the `{n}` module for?", "Tell me about the `{n}` module."],
    "class": ["What is the `{n}` class for?", "Describe the class `{n}`.", "Explain `{n}`."],
    "function": ["What does `{n}` do?", "How do I use `{n}`?", "Explain `{n}`.", "Show me the docs of `{n}`."],
    "method": ["What does `{n}` do?", "How does the method `{n}` work?", "Explain `{n}`."],
}
_FOLLOW_UPS = ["And `{n}`?", "What about `{n}`?", "How does `{n}` work?", "Now explain `{n}`, please."]
_LONG_PROMPTS = [
    "Give me a detailed overview of the `{n}` module and its API.",
    "Document the `{n}` module in full: every class and function.",
    "Write a reference guide for `{n}`.",
]
_CHARS_PER_TOKEN = 3.0  # rough, for sizing long answers


def builtin_conversations(n: int, max_seq_len: int = 2048) -> list[dict]:
    """``n`` chat records built from :func:`stdlib_doc_entries`, deterministic for a given
    Python version: about half single Q&A pairs (one docstring), a quarter multi-turn
    conversations about one module, a quarter long "reference guide" answers that
    concatenate docstrings up to a log-uniform length target between 64 and
    1.25 * ``max_seq_len`` tokens (so every length bucket gets samples; some are truncated)."""
    entries = stdlib_doc_entries()
    by_module: dict[str, list[DocEntry]] = {}
    for e in entries:
        by_module.setdefault(e.module, []).append(e)
    modules = sorted(by_module)
    rng = random.Random("dflash-ipc/builtin:stdlib-docs/v1")
    order = list(range(len(entries)))
    rng.shuffle(order)
    lo, hi = 64.0, 1.25 * max_seq_len
    out = []
    for i in range(n):
        e = entries[order[i % len(order)]]
        r = rng.random()
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        if r < 0.5:
            msgs.append({"role": "user", "content": rng.choice(_FIRST_PROMPTS[e.kind]).format(n=e.name)})
            msgs.append({"role": "assistant", "content": e.doc})
        elif r < 0.75:
            pool = by_module[e.module]
            turns = [e] + [pool[rng.randrange(len(pool))] for _ in range(rng.randint(1, 3))]
            for t, x in enumerate(turns):
                tmpl = rng.choice(_FIRST_PROMPTS[x.kind] if t == 0 else _FOLLOW_UPS)
                msgs.append({"role": "user", "content": tmpl.format(n=x.name)})
                msgs.append({"role": "assistant", "content": x.doc})
        else:
            target_chars = int(lo * math.exp(rng.random() * math.log(hi / lo)) * _CHARS_PER_TOKEN)
            mi = modules.index(e.module)
            parts: list[str] = []
            size = 0
            while size < target_chars:
                mod = modules[mi % len(modules)]
                for x in by_module[mod]:
                    piece = f"# `{x.name}`\n\n{x.doc}" if x.kind == "module" else f"## `{x.name}`\n\n{x.doc}"
                    parts.append(piece)
                    size += len(piece) + 2
                    if size >= target_chars:
                        break
                mi += 1
            msgs.append({"role": "user", "content": rng.choice(_LONG_PROMPTS).format(n=e.module)})
            msgs.append({"role": "assistant", "content": "\n\n".join(parts)})
        out.append({"conversations": msgs})
    return out
