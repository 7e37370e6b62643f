"""Tokenizer and data loading: exact loss masks, bad lines, cache reuse, the built-in corpus."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import supervised_runs

from dflash_ipc.config import DataConfig
from dflash_ipc.config.fields import FieldError
from dflash_ipc.data import corpus as data_mod
from dflash_ipc.data.builtin_corpus import builtin_conversations, stdlib_doc_entries
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.tokenizer import (
    IM_END,
    TokenizerError,
    build_builtin_tokenizer,
    load_tokenizer,
    mask_token_id,
    tokenizer_identity,
)


@pytest.fixture(scope="module")
def tok():
    return build_builtin_tokenizer()


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def cfg_for(*paths, **kw) -> DataConfig:
    kw.setdefault("max_seq_len", 2048)
    kw.setdefault("bucket_edges", [kw["max_seq_len"]])
    kw.setdefault("token_budget", kw["max_seq_len"])
    return DataConfig(paths=[str(p) for p in paths], **kw)


# --------------------------------------------------------------------------- tokenizer


def test_builtin_tokenizer(tok, tmp_path):
    assert len(tok) <= 1024
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"):
        tid = tok.convert_tokens_to_ids(t)
        assert tok(t, add_special_tokens=False)["input_ids"] == [tid]
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == IM_END
    assert mask_token_id(tok) == tok.convert_tokens_to_ids("<|mask|>")
    text = "def f(x):\n    return {'ü': x ** 2}  # 😀 ok\r\n\ttabs"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        tokenize=False,
    )
    assert rendered == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    gen = tok.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>assistant\n")
    # deterministic: same ids on every build
    assert tokenizer_identity(build_builtin_tokenizer()) == tokenizer_identity(tok)

    # a local directory loads offline through AutoTokenizer, with the same ids and template
    tok.save_pretrained(tmp_path / "tok")
    local = load_tokenizer(str(tmp_path / "tok"))
    assert local(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert local.apply_chat_template([{"role": "user", "content": "U"}], tokenize=False) == ("<|im_start|>user\nU<|im_end|>\n")
    assert mask_token_id(local) == mask_token_id(tok)
    assert type(load_tokenizer("builtin")).__name__ == type(tok).__name__
    with pytest.raises(TokenizerError, match="neither"):
        load_tokenizer(str(tmp_path / "missing"))


# --------------------------------------------------------------------------- loss masks


TRICKY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say a letter."},
    {"role": "assistant", "content": "a"},  # also a substring of "assistant" and of the user turn
    {"role": "user", "content": "Again, with unicode: ünï 😀"},
    {"role": "assistant", "content": "Sure:\n  ünï 😀\n\n```py\nprint('x')\n```  "},
    {"role": "user", "content": "Say a letter."},
    {"role": "assistant", "content": "Say a letter."},  # same text as a user turn
]


def test_loss_mask_exactly_on_assistant_tokens(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"conversations": TRICKY},
            {"messages": TRICKY[1:3]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
        ],
    )
    corpus = load_corpus(cfg_for(path), tok, None)
    assert corpus.num_samples == 3 and corpus.report.samples == 3
    expected = [
        [m["content"] + IM_END for m in TRICKY if m["role"] == "assistant"],
        ["a" + IM_END],
        ["hello there" + IM_END],
    ]
    convs = [TRICKY, TRICKY[1:3], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]]
    for i in range(3):
        ids, mask = corpus.sample(i)
        assert ids.dtype == torch.int64 and mask.dtype == torch.uint8 and ids.shape == mask.shape
        assert supervised_runs(tok, ids, mask) == expected[i]
        # the full sequence is exactly the rendered chat; unsupervised tokens are everything else
        assert tok.decode(ids.tolist()) == tok.apply_chat_template(convs[i], tokenize=False)
        assert int(corpus.lengths[i]) == ids.numel()
    r = corpus.report
    assert r.lines_read == 3 and r.num_bad_lines == 0 and r.supervised_tokens == int(corpus.loss_mask.sum())


def test_loss_mask_with_a_template_that_rewrites_contents(tmp_path):
    # Qwen3-like: strips contents and inserts an empty think block in assistant turns.
    tok = build_builtin_tokenizer()
    tok.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + (m['content'] | trim) + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] | trim) + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
    conv = [
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "\n4, not five.\n"},
        {"role": "user", "content": "and 3+3"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "a letter?"},
        {"role": "assistant", "content": "a"},  # must not match inside the "assistant" header
    ]
    path = write_jsonl(tmp_path / "q.jsonl", [{"conversations": conv}])
    corpus = load_corpus(cfg_for(path), tok, None)
    ids, mask = corpus.sample(0)
    assert supervised_runs(tok, ids, mask) == ["4, not five." + IM_END, "6" + IM_END, "a" + IM_END]
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(conv, tokenize=False)


def test_plain_text_all_supervised_and_truncation(tok, tmp_path):
    text = "The quick brown fox jumps over the lazy dog."
    long_text = "word " * 400
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": text}, {"text": long_text}])
    corpus = load_corpus(cfg_for(path, max_seq_len=64), tok, None)
    ids, mask = corpus.sample(0)
    assert tok.decode(ids.tolist()) == text and bool(mask.all())
    ids1, mask1 = corpus.sample(1)
    assert ids1.numel() == 64 and bool(mask1.all())
    assert tok.decode(ids1.tolist()) == tok.decode(tok(long_text, add_special_tokens=False)["input_ids"][:64])
    assert corpus.report.truncated == 1


def test_dropped_without_supervision(tok, tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"conversations": [{"role": "user", "content": "no answer"}]},
            {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            {"text": "a"},  # one token: no two consecutive supervised tokens
            {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine answer"}]},
            # the answer starts after max_seq_len: nothing supervised survives truncation
            {"conversations": [{"role": "user", "content": "long " * 50}, {"role": "assistant", "content": "late"}]},
        ],
    )
    corpus = load_corpus(cfg_for(path, max_seq_len=32), tok, None)
    assert corpus.num_samples == 1
    assert corpus.report.dropped_no_supervision == 4
    assert supervised_runs(tok, *corpus.sample(0)) == ["fine answer" + IM_END]


BAD_ROWS = [
    {"text": "good line one"},  # 1
    '{"text": "unterminated',  # 2 invalid JSON
    "",  # 3 empty
    "[1, 2]",  # 4 not an object
    {"foo": 1},  # 5 missing field
    {"conversations": "hello"},  # 6 wrong type
    {"conversations": [{"role": "user"}]},  # 7 missing content
    {"text": 5},  # 8 wrong type
    {"text": "   "},  # 9 empty text
    {"messages": []},  # 10 empty list
    {"conversations": [{"role": "user", "content": ["a"]}]},  # 11 wrong content type
    {"text": "good line two"},  # 12
]


def test_bad_lines_skipped_and_reported(tok, tmp_path, caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with caplog.at_level("WARNING", logger="dflash_ipc.data.corpus"):
        corpus = load_corpus(cfg_for(path), tok, None)
    r = corpus.report
    assert corpus.num_samples == 2 and r.lines_read == 12 and r.num_bad_lines == 10
    assert [b.split(": ", 1)[0] for b in r.bad_lines] == [f"{path}:{n}" for n in range(2, 12)]
    reasons = dict(b.split(": ", 1) for b in r.bad_lines)
    assert "invalid JSON" in reasons[f"{path}:2"]
    assert "empty line" in reasons[f"{path}:3"]
    assert "JSON object" in reasons[f"{path}:4"]
    assert "missing field" in reasons[f"{path}:5"]
    assert "must be a list" in reasons[f"{path}:6"]
    assert "content" in reasons[f"{path}:7"]
    assert "must be a string" in reasons[f"{path}:8"]
    assert "empty" in reasons[f"{path}:9"]
    assert f"{path}:2" in caplog.text


def test_bad_line_refused_in_error_mode(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON"):
        load_corpus(cfg_for(path, on_bad_line="error"), tok, None)
    with pytest.raises(DataError, match="file not found"):
        load_corpus(cfg_for(tmp_path / "nope.jsonl"), tok, None)
    # a cache built in skip mode does not hide bad lines from error mode
    load_corpus(cfg_for(path), tok, tmp_path / "cache")
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON"):
        load_corpus(cfg_for(path, on_bad_line="error"), tok, tmp_path / "cache")


def test_cache_reused_without_retokenizing(tok, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": TRICKY}, {"text": "some plain text here"}])
    cache = tmp_path / "cache"
    calls = []
    real = data_mod._encode_batch
    monkeypatch.setattr(data_mod, "_encode_batch", lambda t, texts: calls.append(len(texts)) or real(t, texts))
    first = load_corpus(cfg_for(path), tok, cache)
    assert calls and not first.report.loaded_from_cache
    assert len(list(cache.glob("tokens-*.pt"))) == 1

    calls.clear()
    again = load_corpus(cfg_for(path), tok, cache)
    assert calls == [] and again.report.loaded_from_cache
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.loss_mask, first.loss_mask)
    assert torch.equal(again.lengths, first.lengths) and again.report.samples == first.report.samples

    # any change of the key re-tokenizes: max_seq_len, the file, the tokenizer
    load_corpus(cfg_for(path, max_seq_len=1024), tok, cache)
    assert calls
    calls.clear()
    with open(path, "a") as f:
        f.write(json.dumps({"text": "one more line"}) + "\n")
    os.utime(path, ns=(1, 1))
    changed = load_corpus(cfg_for(path), tok, cache)
    assert calls and changed.num_samples == 3 and not changed.report.loaded_from_cache
    calls.clear()
    other = build_builtin_tokenizer()
    other.chat_template = other.chat_template.replace("\\n", "\\n\\n", 1)
    load_corpus(cfg_for(path), other, cache)
    assert calls


def test_collate_right_pads(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "short one"}, {"text": "a somewhat longer text line"}])
    corpus = load_corpus(cfg_for(path), tok, None)
    ids, mask, lens = corpus.collate([1, 0], tok.pad_token_id)
    assert ids.shape == (2, int(corpus.lengths.max())) and lens.tolist() == [int(corpus.lengths[1]), int(corpus.lengths[0])]
    assert (ids[1, lens[1] :] == tok.pad_token_id).all() and not mask[1, lens[1] :].any()
    assert torch.equal(ids[1, : lens[1]], corpus.sample(0)[0])


# --------------------------------------------------------------------------- builtin:stdlib-docs


def test_builtin_corpus_is_real_docs_and_deterministic(tok, tmp_path):
    entries = stdlib_doc_entries()
    assert len(entries) > 1000
    assert [e.module for e in entries] == sorted(e.module for e in entries)
    by_name = {e.name: e for e in entries}
    import json as json_module
    import textwrap

    assert by_name["json.dumps"].doc == inspect.cleandoc(json_module.dumps.__doc__).strip()
    assert by_name["textwrap"].kind == "module" and by_name["textwrap"].doc == inspect.cleandoc(textwrap.__doc__).strip()
    assert not any(m in {e.module for e in entries} for m in ("tkinter", "turtle", "antigravity", "this", "idlelib"))

    # a fresh collection (new subprocess) gives the same entries
    stdlib_doc_entries.cache_clear()
    assert stdlib_doc_entries() == entries

    a = builtin_conversations(300, 2048)
    assert a == builtin_conversations(300, 2048)
    assert a[:50] == builtin_conversations(50, 2048)
    n_turns = [sum(m["role"] == "assistant" for m in c["conversations"]) for c in a]
    assert min(n_turns) == 1 and max(n_turns) >= 3
    answers = {m["content"] for c in a for m in c["conversations"] if m["role"] == "assistant"}
    assert answers & {e.doc for e in entries}

    cfg = DataConfig(builtin_samples=300)
    c1 = load_corpus(cfg, tok, None)
    c2 = load_corpus(cfg, tok, tmp_path)
    assert torch.equal(c1.tokens, c2.tokens) and torch.equal(c1.loss_mask, c2.loss_mask)
    lens = c1.lengths
    assert c1.num_samples == 300 and c1.report.dropped_no_supervision == 0
    assert int(lens.min()) < 100 and int(lens.max()) > 1500 and int((lens > 1024).sum()) >= 10
    assert int(lens.max()) <= cfg.max_seq_len
    # the first sample's supervised text is the assistant answers of the first conversation
    want = [m["content"] + IM_END for m in a[0]["conversations"] if m["role"] == "assistant"]
    assert supervised_runs(tok, *c1.sample(0)) == want


def test_unknown_builtin_corpus(tok):
    with pytest.raises(FieldError, match=r"'builtin:nope' is no built-in corpus; the built-in ones: builtin:stdlib-docs"):
        DataConfig(paths=["builtin:nope"])  # refused with the config, before any corpus is read
    cfg = DataConfig()
    cfg.paths = ["builtin:nope"]  # past the config (a dict built by hand): the corpus still refuses it
    with pytest.raises(DataError, match="unknown built-in corpus"):
        load_corpus(cfg, tok, None)


def test_tokenizer_asset_regenerates_a_loadable_1024_id_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from dflash_ipc.data.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE
    from dflash_ipc.data.tokenizer_asset import write_asset

    out = tmp_path / "tok.json"
    write_asset(out)
    fresh = Tokenizer.from_file(str(out))
    assert fresh.get_vocab_size() == VOCAB_SIZE
    assert [fresh.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(VOCAB_SIZE - len(SPECIAL_TOKENS), VOCAB_SIZE))
    text = "def f(x):\n    return {'ü': x}  # 😀"
    assert fresh.decode(fresh.encode(text).ids) == text
