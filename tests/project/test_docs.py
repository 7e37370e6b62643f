"""The tree states what the product is, and its docs name only what exists.

Guards two things:

1. No words of how the project was built, in any tracked (or new, not ignored) text file: work periods
   counted or relative, issue numbers, lettered GPU calls, a borrowed machine, numbered rounds (the
   patterns of FORBIDDEN below), and the tool-call syntax of one particular working
   environment (``$OUT``, ``carry=[...]``, ``run(command=...)``, its machine kind names). History lives in
   git; a doc states what holds today.
2. The docs (README.md, docs/*.md, examples/README.md and the example scripts) name only repository paths
   that exist and only ``dflash-ipc`` commands (and subcommands) the click CLI has, so a renamed file or
   command cannot leave a doc pointing at nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest

from dflash_ipc.cli import main

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|[0-9]+(?:st|nd|rd|th)"
)
FORBIDDEN: list[tuple[str, re.Pattern[str]]] = [
    ("a work period", re.compile(rf"\b(?:{_ORDINALS}|next|previous|last|this|that|earlier|later|same) (?:sessions?|leases?)\b", re.I)),
    ("a relative GPU period", re.compile(r"\b(?:next|previous|last) GPU (?:sessions?|calls?|runs?|leases?|machines?)\b", re.I)),
    ("an issue number", re.compile(r"\bissues?[ -]#?[0-9]+\b", re.I)),
    ("a lettered call", re.compile(r"\b[Cc]alls? [A-E][0-9]?\b")),
    ("a borrowed machine", re.compile(r"\blent\b", re.I)),
    ("a numbered round", re.compile(r"\bround [0-9]+\b", re.I)),
    ("a red-team finding", re.compile(r"\bred[- ]team", re.I)),
    (
        "the working environment's tool syntax",
        re.compile(r"\$OUT\b|\bcarry=\[|\brun\(command=|\bdevice calls?\b|\bnvidia-h200(?:-x[0-9])?\b"),
    ),
]

DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")), "examples/README.md"]
DOCS += sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.sh"))
# a path anchored at a top-level folder of the repository, or a module path inside the package
TOP_PATH = re.compile(r"(?<![\w/.$~-])((?:dflash_ipc|procs|tests|tools|configs|docs|examples|systemd|\.ci)/[\w./@-]*[\w/])")
PACKAGES = "control|transport|data|target|drafter|eval|runtime|ops|bench|cli|config|datagen|families|platform|rundir|target_spec"
PKG_MODULE = re.compile(rf"(?<![\w/.$~-])((?:{PACKAGES})/[\w/]+\.py)\b")
COMMAND = re.compile(r"\bdflash-ipc ([a-z][\w-]*)(?: ([a-z][\w-]*))?")


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = []
    for name in sorted(set(out.decode().split("\0")) - {"", THIS}):
        path = ROOT / name
        if not path.is_file() or name.endswith(".lock"):
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:  # text, not a binary file
            files.append(name)
    return files


def forbidden_words(text: str) -> list[str]:
    """``line: what (the words)`` for each match of a forbidden pattern in ``text``."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN:
            for m in pattern.finditer(line):
                hits.append(f"{n}: {what} ({m.group(0)!r})")
    return hits


def test_no_file_speaks_of_how_the_project_was_built():
    found = []
    for name in _tracked_text_files():
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        found += [f"{name}:{hit}" for hit in forbidden_words(text)]
    assert not found, "the tree states what the product is; history belongs in git:\n" + "\n".join(found)


def test_the_patterns_catch_history_and_leave_product_words_alone():
    planted = [
        # assembled, so that this file does not read as history to a plain grep of the tree
        "measured in the seventh " + "session",
        "see issue " + "27",
        "the next GPU " + "call runs it",
        "GPU call " + "B2 took 500 s",
        "on the le" + "nt H200",
        "write it under $OUT",
        'run(command="bash x.sh", carry=[".whl"])',
    ]
    for line in planted:
        assert forbidden_words(line), line
    kept = ["a login session", "scope='session'", "the first call compiles", "a call to a function", "$OUT_DIR", "a silent machine"]
    for line in kept:
        assert not forbidden_words(line), line


def _missing_paths(text: str) -> list[str]:
    missing = []
    for m in TOP_PATH.finditer(text):
        if text[m.end() : m.end() + 1] in ("<", "*", "{"):  # a pattern such as procs/<role>.py or tests/test_x*.py
            continue
        if not (ROOT / m.group(1)).exists():
            missing.append(m.group(1))
    for m in PKG_MODULE.finditer(text):
        if not (ROOT / "dflash_ipc" / m.group(1)).exists():
            missing.append(m.group(1))
    return missing


def _code(text: str, markdown: bool) -> str:
    """What a reader runs: a script whole, a Markdown file's code spans, fenced blocks and indented lines
    (its prose may say "dflash-ipc" in a sentence)."""
    if not markdown:
        return text
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    indented = re.findall(r"^(?: {4}|\t)(.*)$", text, re.M)
    spans = re.findall(r"`([^`\n]+)`", text)
    return "\n".join([*fenced, *indented, *spans])


def _missing_commands(text: str, markdown: bool = True) -> list[str]:
    missing = []
    for m in COMMAND.finditer(_code(text, markdown)):
        cmd, sub = m.group(1), m.group(2)
        found = main.commands.get(cmd)
        if found is None:
            missing.append(f"dflash-ipc {cmd}")
        elif isinstance(found, click.Group) and sub is not None and sub not in found.commands:
            missing.append(f"dflash-ipc {cmd} {sub}")
    return missing


@pytest.mark.parametrize("doc", DOCS)
def test_a_doc_names_only_files_and_commands_that_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    assert not _missing_paths(text), f"{doc} names files that do not exist: {sorted(set(_missing_paths(text)))}"
    commands = _missing_commands(text, markdown=doc.endswith(".md"))
    assert not commands, f"{doc} names commands the CLI does not have: {sorted(set(commands))}"


def test_the_reference_checks_catch_a_renamed_file_and_command():
    assert _missing_paths("run `tools/no_such_tool.py` then `runtime/no_such.py`") == ["tools/no_such_tool.py", "runtime/no_such.py"]
    assert _missing_paths("`procs/<role>.py`, `tests/test_multinode*.py`, configs/tiny-cpu.toml, runtime/heartbeat.py") == []
    assert _missing_commands("# dflash-ipc design\nA version of dflash-ipc added it; run `dflash-ipc launch`.") == ["dflash-ipc launch"]
    assert _missing_commands("dflash-ipc up, dflash-ipc bench pipeline, dflash-ipc launch, dflash-ipc bench warp", markdown=False) == [
        "dflash-ipc launch",
        "dflash-ipc bench warp",
    ]
