"""Hostile data lines: skipped and reported with their line numbers, never fatal, never huge.

Real files, the real built-in tokenizer, the real corpus builder (`load_corpus`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ipc.config import DataConfig
from dflash_ipc.data.corpus import MAX_CHARS_PER_TOKEN, DataError, load_corpus
from dflash_ipc.data.tokenizer import build_builtin_tokenizer

GOOD = {"conversations": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, friend."}]}


@pytest.fixture(scope="module")
def tok():
    return build_builtin_tokenizer()


def data_cfg(path: Path, max_seq_len: int = 256, **kw) -> DataConfig:
    return DataConfig(paths=[str(path)], max_seq_len=max_seq_len, bucket_edges=[max_seq_len], token_budget=max_seq_len, **kw)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "nested",
    [
        '{"text": ' + deep(100_000) + "}",  # fails in the JSON decoder
        deep(50_000),  # a bare array, nested
        '{"conversations": [{"role": "user", "content": "hi", "meta": ' + deep(100_000) + "}]}",
    ],
    # short ids: pytest puts the test's id in PYTEST_CURRENT_TEST, and a 200 kB variable makes every
    # process the test starts (the worker's shared fork server, when this test comes first) fail with E2BIG
    ids=["text", "bare-array", "conversation-meta"],
)
def test_deeply_nested_json_is_a_bad_line(tmp_path, tok, nested):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), nested, json.dumps(GOOD)])
    corpus = load_corpus(data_cfg(path), tok, None)
    r = corpus.report
    assert corpus.num_samples == 2 and r.lines_read == 3 and r.num_bad_lines == 1
    assert r.bad_lines == [f"{path}:2: JSON nested too deeply to parse (over ~{sys.getrecursionlimit()} levels)"]


def test_deeply_nested_json_refused_with_line_number_when_asked(tmp_path, tok):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), json.dumps(GOOD), '{"text": ' + deep(100_000) + "}"])
    with pytest.raises(DataError, match=rf"^{path}:3: JSON nested too deeply"):
        load_corpus(data_cfg(path, on_bad_line="error"), tok, None)


def test_bad_lines_of_every_kind_are_reported_by_line(tmp_path, tok):
    lines = [
        json.dumps(GOOD),
        '{"text": ' + deep(100_000) + "}",
        "{not json",
        "",
        json.dumps({"text": 3}),
        json.dumps({"conversations": "hi"}),
        json.dumps(GOOD),
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(("\n".join(lines[:3]) + "\n").encode() + b"\xff\xfe\n" + ("\n".join(lines[3:]) + "\n").encode())
    corpus = load_corpus(data_cfg(path), tok, None)
    assert corpus.num_samples == 2
    assert [b.split(": ", 1)[0] for b in corpus.report.bad_lines] == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7)]


def test_huge_record_is_cut_before_tokenizing_without_changing_the_sample(tmp_path, tok):
    """A record longer than max_seq_len * MAX_CHARS_PER_TOKEN characters gives the same tokens
    as tokenizing it whole and truncating: the cut only drops what truncation drops."""
    max_seq_len = 128
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(20_000))  # ~1 MB
    assert len(text) > 10 * max_seq_len * MAX_CHARS_PER_TOKEN
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": text})])
    corpus = load_corpus(data_cfg(path, max_seq_len), tok, None)
    whole = tok(text, add_special_tokens=False)["input_ids"][:max_seq_len]
    ids, mask = corpus.sample(0)
    assert ids.tolist() == whole and mask.tolist() == [1] * max_seq_len
    assert corpus.report.truncated == 1


def test_chat_cut_keeps_the_prompt_and_the_loss_mask(tmp_path, tok):
    max_seq_len = 64
    reply = "word " * 100_000
    row = {"conversations": [{"role": "user", "content": "Write a lot."}, {"role": "assistant", "content": reply}]}
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(row)])
    ids, mask = load_corpus(data_cfg(path, max_seq_len), tok, None).sample(0)
    rendered = tok.apply_chat_template(row["conversations"], tokenize=False)
    prompt = rendered[: rendered.index(reply)]
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert len(ids) == max_seq_len and mask.tolist() == [0] * n_prompt + [1] * (max_seq_len - n_prompt)
    assert tok.decode(ids[:n_prompt]) == prompt


PEAK_RSS_SCRIPT = """
import json, resource, sys
from pathlib import Path
from dflash_ipc.config import DataConfig
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.tokenizer import build_builtin_tokenizer
path = Path(sys.argv[1])
tok = build_builtin_tokenizer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
corpus = load_corpus(DataConfig(paths=[str(path)], max_seq_len=512, bucket_edges=[512], token_budget=512), tok, None)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"samples": corpus.num_samples, "peak_growth_kib": after - before}))
"""


def test_19mb_line_does_not_blow_up_memory(tmp_path):
    """Tokenizing a 19 MB line whole took ~3.6 GB; cut first, the load grows the peak RSS by a few MB."""
    path = tmp_path / "big.jsonl"
    text = "the quick brown fox jumps over the lazy dog " * (19_000_000 // 44)
    write_lines(path, [json.dumps(GOOD), json.dumps({"text": text})])
    assert path.stat().st_size > 19_000_000
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(path)], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["samples"] == 2
    # The line itself (19 MB read + decoded + parsed) costs ~100 MB; tokenizing it whole cost 3.6 GB.
    assert out["peak_growth_kib"] < 400 * 1024, out


# A JSON escape of half a UTF-16 pair decodes to a lone surrogate, which no tokenizer takes
# (the Rust tokenizer refused the whole batch, the probe crashed, `up` exited 2
# with a traceback although on_bad_line = "skip").
SURROGATE_LINES = [
    '{"text": "before \\ud800 after"}',
    '{"conversations": [{"role": "user", "content": "hi \\udfff"}, {"role": "assistant", "content": "Hello there."}]}',
    '{"messages": [{"role": "user\\ud83d", "content": "hi"}, {"role": "assistant", "content": "Hello there."}]}',
]


def test_a_line_with_a_lone_surrogate_is_a_bad_line(tmp_path, tok):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), *SURROGATE_LINES, json.dumps(GOOD)])
    corpus = load_corpus(data_cfg(path), tok, None)
    r = corpus.report
    assert corpus.num_samples == 2 and r.records == 2 and r.num_bad_lines == 3, r.bad_lines
    assert r.bad_lines == [
        f"{path}:2: \"text\" holds a lone surrogate '\\ud800' at character 7 (not a Unicode character)",
        f"{path}:3: conversations[0].content holds a lone surrogate '\\udfff' at character 3 (not a Unicode character)",
        f"{path}:4: messages[0].role holds a lone surrogate '\\ud83d' at character 4 (not a Unicode character)",
    ]
    with pytest.raises(DataError, match=rf"^{path}:2: \"text\" holds a lone surrogate .*on_bad_line = \"error\""):
        load_corpus(data_cfg(path, on_bad_line="error"), tok, None)


def test_any_record_the_tokenizer_refuses_costs_only_its_line(tmp_path, tok, monkeypatch):
    """Past the record check (turned off here), the real tokenizer refuses the batch: the records are
    then tokenized one by one, the refused one skipped with its line, the others kept unchanged."""
    import dflash_ipc.data.records as records

    path = write_lines(tmp_path / "d.jsonl", [json.dumps(GOOD), SURROGATE_LINES[0], json.dumps(GOOD)])
    expected = load_corpus(data_cfg(write_lines(tmp_path / "good.jsonl", [json.dumps(GOOD)] * 2)), tok, None)
    monkeypatch.setattr(records, "_unicode", lambda text, what: text)  # noqa: ARG005
    corpus = load_corpus(data_cfg(path), tok, None)
    assert corpus.num_samples == 2 and corpus.report.records == 2 and corpus.tokens.tolist() == expected.tokens.tolist()
    [bad] = corpus.report.bad_lines
    assert bad.startswith(f"{path}:2: the tokenizer cannot take it (TypeError: TextEncodeInput must be"), bad


def test_a_prompt_line_that_is_not_utf8_is_skipped_with_its_line(tmp_path):
    """gen-data and eval read prompts through data.readers: a bad line there is skipped too (it
    ended both commands with "'utf-8' codec can't decode byte 0xff", naming no file)."""
    from dflash_ipc.data.readers import iter_records, prompt_messages

    path = tmp_path / "p.jsonl"
    path.write_bytes(
        json.dumps(GOOD).encode() + b"\n\xff\xfe\n" + b'{"text": ' + deep(100_000).encode() + b"}\n" + json.dumps(GOOD).encode()
    )
    got = list(iter_records([str(path)]))
    assert [w for w, _ in got] == [f"{path}:{n}" for n in (1, 2, 3, 4)]
    assert [prompt_messages(r) is not None for _, r in got] == [True, False, False, True]
    assert got[1][1].reason == "not valid UTF-8 (invalid start byte at byte 0)"
