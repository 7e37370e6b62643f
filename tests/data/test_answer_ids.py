"""gen-data keeps the target's own token ids and the corpus trains on them: the ids a record
stores are the ids the model generated, they land in the supervised positions verbatim, canonical
text gives the same sample as the text path, a cut answer ends at the cut, bad ids are bad lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import DataConfig, load_config
from dflash_ipc.data.builtin_corpus import builtin_conversations
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.tokenizer import IM_END, build_builtin_tokenizer, stop_token_ids, vocab_identity

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"


@pytest.fixture(scope="module")
def tok():
    return build_builtin_tokenizer()


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _cfg(*paths, **kw) -> DataConfig:
    kw.setdefault("max_seq_len", 2048)
    return DataConfig(paths=[str(p) for p in paths], bucket_edges=[kw["max_seq_len"]], token_budget=kw["max_seq_len"], **kw)


def _samples(corpus) -> list[tuple[list[int], list[int]]]:
    return [tuple(t.tolist() for t in corpus.sample(i)) for i in range(corpus.num_samples)]


def _prompt_ids(tok, msgs) -> list[int]:
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _greedy(lm, prompt: list[int], stops: set[int], max_new: int) -> tuple[list[int], str]:
    """Plain greedy decoding, one argmax per full forward: the ids the target generates, found without `generate`."""
    ids = list(prompt)
    for _ in range(max_new):
        nxt = int(lm(torch.tensor([ids])).logits[0, -1].argmax())
        if nxt in stops:
            return ids[len(prompt) :], "stop"
        ids.append(nxt)
    return ids[len(prompt) :], "length"


def test_gen_data_stores_the_generated_ids_and_the_corpus_supervises_exactly_them(tmp_path, tok):
    from dflash_ipc.eval.target_lm import build_target_lm

    chats = [{"id": f"c{i}", **c} for i, c in enumerate(builtin_conversations(6, 256))]
    prompts = _write(tmp_path / "prompts.jsonl", chats)
    out = tmp_path / "gen.jsonl"
    max_new = 12
    args = ["--out", str(out), "--prompts", str(prompts), "--max-new", str(max_new), "--batch-size", "4"]
    r = CliRunner().invoke(main, ["gen-data", "--config", str(TINY), *args])
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == len(chats)

    cfg = load_config(TINY)
    lm = build_target_lm(cfg.target, "cpu", vocab_size=len(tok))
    stops = stop_token_ids(tok, lm.generation_config)
    im_end, newline = tok.convert_tokens_to_ids(IM_END), tok("\n", add_special_tokens=False)["input_ids"]
    corpus = load_corpus(_cfg(out), tok, None)
    assert corpus.num_samples == len(records) and corpus.report.num_bad_lines == 0
    same_text_ids = 0
    for rec, (ids, mask) in zip(records, _samples(corpus)):
        answer = rec["conversations"][-1]
        assert rec["tokenizer_vocab"] == vocab_identity(tok)
        prompt = _prompt_ids(tok, rec["conversations"][:-1])
        generated, finish = _greedy(lm, prompt, stops, max_new)
        assert answer["token_ids"] == generated and rec["finish"] == finish
        assert answer["content"] == tok.decode(generated)  # the text the template renders back into the generated one
        same_text_ids += tok(answer["content"], add_special_tokens=False)["input_ids"] == generated
        # the sample: the prompt as eval feeds it, then exactly the generated ids, supervised
        closing = [] if finish == "length" else [im_end] + newline
        assert ids == prompt + generated + closing
        assert mask == [0] * len(prompt) + [1] * len(generated) + ([] if finish == "length" else [1] + [0] * len(newline))
    print(f"finish: {[r['finish'] for r in records]}; answers whose text re-tokenizes to the generated ids: {same_text_ids}/{len(records)}")


def _first_turns(n: int, system: bool = False) -> list[list[dict]]:
    out = []
    for c in builtin_conversations(n, 512):
        turns = [m for m in c["conversations"] if m["role"] != "system"][:2]
        assert [m["role"] for m in turns] == ["user", "assistant"]
        out.append(([{"role": "system", "content": "Answer briefly."}] if system else []) + turns)
    return out


def test_canonical_text_gives_todays_ids_and_mask(tmp_path, tok):
    # the built-in tokenizer round-trips any text, so the text's own ids are what a target emitting it canonically generates
    convs = _first_turns(40) + _first_turns(5, system=True)
    old, new = [], []
    for i, conv in enumerate(convs):
        answer = conv[-1]["content"]
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == answer
        old.append({"id": f"r{i}", "conversations": conv, "finish": "stop"})
        new.append({**old[-1], "conversations": conv[:-1] + [{**conv[-1], "token_ids": ids}], "tokenizer_vocab": vocab_identity(tok)})
    today = load_corpus(_cfg(_write(tmp_path / "old.jsonl", old)), tok, None)
    stored = load_corpus(_cfg(_write(tmp_path / "new.jsonl", new)), tok, None)
    assert today.num_samples == stored.num_samples == len(convs)
    assert torch.equal(today.tokens, stored.tokens) and torch.equal(today.loss_mask, stored.loss_mask)
    assert torch.equal(today.offsets, stored.offsets)
    # old and new records mix in one file; each loads as its own kind would alone
    mixed = load_corpus(_cfg(_write(tmp_path / "mixed.jsonl", [x for pair in zip(old, new) for x in pair])), tok, None)
    assert mixed.num_samples == 2 * len(convs) and mixed.report.num_bad_lines == 0
    assert _samples(mixed)[::2] == _samples(today) and _samples(mixed)[1::2] == _samples(stored)
    # Parquet gives every turn every field (the user turn's token_ids is null): the same samples
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(new), tmp_path / "new.parquet")
    table = load_corpus(_cfg(tmp_path / "new.parquet"), tok, None)
    assert table.report.num_bad_lines == 0 and _samples(table) == _samples(stored)


def test_stored_ids_are_used_verbatim_where_the_text_would_tokenize_otherwise(tmp_path, tok):
    # "ab" emitted as two tokens, and a special token that decoding drops from the text
    a, b = tok("a", add_special_tokens=False)["input_ids"], tok("b", add_special_tokens=False)["input_ids"]
    ab = tok("ab", add_special_tokens=False)["input_ids"]
    assert len(a) == len(b) == len(ab) == 1 and ab != a + b
    mask_tok = tok.convert_tokens_to_ids("<|mask|>")
    ids = a + b + [mask_tok] + a
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "aba" and tok(text, add_special_tokens=False)["input_ids"] != ids
    conv = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": text, "token_ids": ids}]
    corpus = load_corpus(_cfg(_write(tmp_path / "g.jsonl", [{"conversations": conv, "finish": "stop"}])), tok, None)
    got, mask = _samples(corpus)[0]
    prompt = _prompt_ids(tok, conv[:1])
    assert got == prompt + ids + [tok.convert_tokens_to_ids(IM_END)] + tok("\n", add_special_tokens=False)["input_ids"]
    assert [t for t, m in zip(got, mask) if m] == ids + [tok.convert_tokens_to_ids(IM_END)]


def test_an_answer_cut_at_max_new_ends_at_the_cut_unsupervised_end_never_added(tmp_path, tok):
    conv = _first_turns(1)[0]
    ids = tok(conv[-1]["content"], add_special_tokens=False)["input_ids"][:9]
    conv[-1]["content"] = tok.decode(ids)
    prompt = _prompt_ids(tok, conv[:1])
    stored = {"conversations": conv[:1] + [{**conv[-1], "token_ids": ids}], "finish": "length"}
    text_only = {"conversations": conv, "finish": "length"}
    stopped = {"conversations": conv[:1] + [{**conv[-1], "token_ids": ids}], "finish": "stop"}
    corpus = load_corpus(_cfg(_write(tmp_path / "g.jsonl", [stored, text_only, stopped])), tok, None)
    (s_ids, s_mask), (t_ids, t_mask), (f_ids, f_mask) = _samples(corpus)
    # the target was cut mid-answer: the sample is prompt + the generated ids, every one of them supervised
    assert s_ids == t_ids == prompt + ids
    assert s_mask == t_mask == [0] * len(prompt) + [1] * len(ids)
    assert tok.convert_tokens_to_ids(IM_END) not in s_ids[len(prompt) :]
    # a finished answer is closed by the template's end of turn, supervised (the target produced a stop token)
    assert f_ids == prompt + ids + [tok.convert_tokens_to_ids(IM_END)] + tok("\n", add_special_tokens=False)["input_ids"]
    assert f_mask == [0] * len(prompt) + [1] * (len(ids) + 1) + [0]
    # a longer chat cut in its last answer: earlier answers keep their supervised end of turn
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}, *conv]
    two = load_corpus(_cfg(_write(tmp_path / "t.jsonl", [{"conversations": turns, "finish": "length"}])), tok, None)
    ((got, mask),) = _samples(two)
    assert got[-len(ids) :] == ids and got.count(tok.convert_tokens_to_ids(IM_END)) == 3  # the three turns before the cut one
    supervised = [t for t, m in zip(got, mask) if m]
    assert supervised == tok("Hello.<|im_end|>", add_special_tokens=False)["input_ids"] + ids


def test_bad_token_ids_are_bad_lines_with_a_reason(tmp_path, tok):
    user = {"role": "user", "content": "Q?"}

    def rec(ids, **kw):
        return {"conversations": [user, {"role": "assistant", "content": "x", "token_ids": ids}], **kw}

    good = rec(tok("Fine answer.", add_special_tokens=False)["input_ids"], tokenizer_vocab=vocab_identity(tok))
    bad = [
        rec([5, len(tok)]),
        rec([-1]),
        rec([5, "6"]),
        rec([True]),
        rec("5 6"),
        rec([5, 6], tokenizer_vocab="sha256:" + "0" * 64),
        {"conversations": [{**user, "token_ids": [5]}, {"role": "assistant", "content": "x"}]},
        {"conversations": [{"role": "assistant", "content": "x"}, {**user, "token_ids": [5]}]},
    ]
    path = _write(tmp_path / "g.jsonl", [good] + bad)
    corpus = load_corpus(_cfg(path), tok, None)
    assert corpus.num_samples == 1 and corpus.report.num_bad_lines == len(bad)
    reasons = corpus.report.bad_lines
    assert f'g.jsonl:2: "token_ids"[1] = {len(tok)} is outside the tokenizer\'s vocabulary (ids 0..{len(tok) - 1})' in reasons[0]
    assert "outside the tokenizer's vocabulary" in reasons[1]
    assert "must be an integer token id, got '6'" in reasons[2] and "got True" in reasons[3]
    assert "must be a list of token ids, got str" in reasons[4]
    assert "belong to another vocabulary" in reasons[5] and "regenerate it with gen-data" in reasons[5]
    assert "read only on the final (assistant) turn" in reasons[6] and "is a 'user' turn, not an assistant answer" in reasons[7]
    with pytest.raises(DataError, match=r"g\.jsonl:2: .* outside the tokenizer's vocabulary .*on_bad_line"):
        load_corpus(_cfg(path, on_bad_line="error"), tok, None)
