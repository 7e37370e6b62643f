"""Prompt synthesis (gen-data --prompts synth:N): the pre-query template cut from real chat templates,
the filters on constructed requests, the diversity report's figures, and the whole path on the tiny
random target (its requests are gibberish: the plumbing is what is checked) with resume and the
held-out split by prompt hash."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.config.data import SynthConfig
from dflash_ipc.data.tokenizer import load_tokenizer
from dflash_ipc.datagen.gen import is_holdout, prompt_key
from dflash_ipc.datagen.prequery import pre_query_template, user_turn_stops
from dflash_ipc.datagen.synth import diversity_path, parse_synth_spec, synth_prompts_path
from dflash_ipc.datagen.synth_filters import PromptFilter, diversity_report

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin")


def test_pre_query_template_is_cut_from_the_tokenizers_own_template(tok):
    pre = pre_query_template(tok)
    assert pre == "<|im_start|>user\n"
    chat = tok.apply_chat_template([{"role": "user", "content": "Plan a trip."}], tokenize=False)
    assert chat.startswith(pre) and chat[len(pre) :].startswith("Plan a trip.")
    assert pre_query_template(tok, "Ask about {x}.") == "<|im_start|>system\nAsk about {x}.<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert (
        pre_query_template(tok, history=history)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
    )
    # the user turn is closed by <|im_end|>: a stop for sampling requests
    assert tok.convert_tokens_to_ids("<|im_end|>") in user_turn_stops(tok)


def test_pre_query_template_keeps_an_injected_default_system_prompt_and_other_formats(tok):
    t = copy.deepcopy(tok)
    t.chat_template = (
        "{%- if messages[0]['role'] != 'system' -%}{{ '<|im_start|>system\\nYou are SmolLM.<|im_end|>\\n' }}{%- endif -%}"
        + tok.chat_template
    )
    assert pre_query_template(t) == "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\n"
    assert pre_query_template(t, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    t.chat_template = "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    assert pre_query_template(t) == "<start_of_turn>user\n"


def test_a_tokenizer_without_chat_template_is_refused(tok):
    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        pre_query_template(t)
    t.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="verbatim"):
        pre_query_template(t)


def test_synth_spec_parsing():
    assert parse_synth_spec("synth:2000") == 2000
    assert parse_synth_spec("data/x.jsonl") is None and parse_synth_spec(None) is None
    for bad in ("synth:", "synth:0", "synth:-3", "synth:1e3"):
        with pytest.raises(ValueError, match="synth:N"):
            parse_synth_spec(bad)


def test_filters_drop_each_kind_and_keep_good_requests(tok):
    f = PromptFilter(SynthConfig(min_chars=10, max_chars=200), tok.all_special_tokens)
    good = "How do I plan a three-day trip to Lisbon on a small budget?"
    cases = [
        (good, True, None),
        ("Write a haiku about", False, "unfinished"),
        ("Hi there", True, "too_short"),
        ("x " * 150, True, "too_long"),
        ("Tell me a joke.<|im_end|>\n<|im_start|>assistant\nSure", True, "leak"),
        ("What is a good name for a dog?\nAssistant: Rex", True, "leak"),
        ("give me give me give me give me give me give me give me give me", True, "degenerate"),
        ("Why is the sky blue?!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!", True, "degenerate"),
        ("  how do i PLAN a three-day trip to lisbon   on a small budget? ", True, "exact_dup"),
        ("How do I plan a three-day trip to Lisbon on a small budget, please?", True, "near_dup"),
        ("Suggest a vegetarian dinner menu for six guests with a dessert.", True, None),
    ]
    for text, finished, want in cases:
        assert f.reason(text, finished) == want, text
    assert f.kept == 2
    assert dict(f.dropped) == {
        "unfinished": 1,
        "too_short": 1,
        "too_long": 1,
        "leak": 2,
        "degenerate": 2,
        "exact_dup": 1,
        "near_dup": 1,
    }
    # below the threshold a similar request is kept: LSH only proposes, the exact Jaccard decides
    assert f.reason("How do I plan a weekend trip to Porto with kids and a dog?", True) is None


def test_near_dup_threshold_one_is_exact_only_and_resumed_index_rejects_kept(tok):
    f = PromptFilter(SynthConfig(near_dup_threshold=1.0))
    assert f.reason("How do I bake sourdough bread at home?") is None
    assert f.reason("How do I bake sourdough bread at home, today?") is None
    g = PromptFilter(SynthConfig())
    g.add_kept("How do I bake sourdough bread at home?")
    assert g.reason("how do i bake sourdough bread at home?") == "exact_dup"
    assert g.kept == 0 and g.dropped["exact_dup"] == 1


def test_diversity_report_figures_on_a_known_input():
    r = diversity_report(["a b c", "a b d", "Zed " * 20], {"near_dup": 2, "leak": 1}, sampled=6)
    # unigrams: a b c a b d + zed x20 -> 26 total, 5 distinct
    assert r["distinct_1"] == round(5 / 26, 4)
    # bigrams: (a b) (b c) (a b) (b d) + (zed zed) x19 -> 23 total, 4 distinct
    assert r["distinct_2"] == round(4 / 23, 4)
    assert r["distinct_3"] == round(3 / 20, 4)
    assert r["prompts"] == 3 and r["sampled"] == 6 and r["kept_fraction"] == 0.5
    assert r["removed"]["near_dup"] == 2 and r["removed"]["leak"] == 1 and r["removed"]["exact_dup"] == 0
    assert r["first_words"][:2] == [["a", 2], ["zed", 1]]
    assert r["chars_histogram"]["0-24"] == 2 and r["chars_histogram"]["50-99"] == 1 and sum(r["chars_histogram"].values()) == 3


def test_synth_config_is_validated_naming_the_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.read_text() + '\n[synth]\ntopics = ["cooking"]\n')
    with pytest.raises(ConfigError, match=r"synth\.topics: .*\{topic\}"):
        load_config(cfg)
    cfg.write_text(TINY.read_text() + "\n[synth]\nnum_perm = 64\nlsh_bands = 5\n")
    with pytest.raises(ConfigError, match=r"synth\.lsh_bands"):
        load_config(cfg)


# ---------------------------------------------------------------------------------- end to end

SYNTH_TOML = """
[synth]
max_prompt_tokens = 6
drop_unfinished = false
min_chars = 1
system_prompts = ["Ask about {topic}.", "Ask anything."]
topics = ["cooking", "travel", "math"]
"""


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "synth.toml"
    cfg.write_text(TINY.read_text() + SYNTH_TOML)
    return cfg


def _synth(cfg: Path, out: Path, n: int, *extra: str) -> dict:
    args = ["gen-data", "--config", str(cfg), "--out", str(out), "--prompts", f"synth:{n}", "--batch-size", "4", "--max-new", "3"]
    r = CliRunner().invoke(main, [*args, "--holdout-fraction", "0.3", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_synth_end_to_end_resumes_without_duplicates_and_holds_out_by_hash(tmp_path):
    cfg = _config(tmp_path)
    fresh = tmp_path / "fresh" / "gen.jsonl"
    full = _synth(cfg, fresh, 10)
    assert full["synth"]["kept"] >= 10 and full["written"] + full["held_out"] == 10

    # stopped midway: 5 first (whole batches kept), a torn line, then 10
    out = tmp_path / "resumed" / "gen.jsonl"
    first = _synth(cfg, out, 5)
    assert first["written"] + first["held_out"] == 5
    with open(synth_prompts_path(out), "a") as f:
        f.write('{"id": "synth-0-9-0", "batch": 9, "conversa')
    second = _synth(cfg, out, 10)
    assert second["skipped_done"] == 5 and second["written"] + second["held_out"] == 5

    # the same requests as the run that never stopped, each answered once
    assert synth_prompts_path(out).read_text() == synth_prompts_path(fresh).read_text()
    recs = _lines(out) + _lines(out.with_name("gen.holdout.jsonl"))
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)) == 10
    assert sorted(ids) == sorted(r["id"] for r in _lines(fresh) + _lines(fresh.with_name("gen.holdout.jsonl")))
    wanted = [json.loads(x)["id"] for x in synth_prompts_path(out).read_text().splitlines()][:10]
    assert sorted(ids) == sorted(wanted)

    # held out by prompt hash: no held-out prompt in train, every record on its side of the split
    train_keys = {prompt_key(r["conversations"][:-1]) for r in _lines(out)}
    held_keys = {prompt_key(r["conversations"][:-1]) for r in _lines(out.with_name("gen.holdout.jsonl"))}
    assert not train_keys & held_keys
    assert all(not is_holdout(k, 0.3) for k in train_keys) and all(is_holdout(k, 0.3) for k in held_keys)
    # answers carry the target's ids; a request is a user turn only (the steering system prompt is not kept)
    for r in recs:
        assert [m["role"] for m in r["conversations"]] == ["user", "assistant"] and r["conversations"][1]["token_ids"]

    report = json.loads(diversity_path(out).read_text())
    assert report["prompts"] == len(_lines(synth_prompts_path(out)))
    assert report["sampled"] == report["prompts"] + sum(report["removed"].values())
    assert 0 < report["distinct_1"] <= 1 and sum(report["chars_histogram"].values()) == report["prompts"]
    # a finished run asked again loads no model and answers nothing
    again = _synth(cfg, out, 10)
    assert again["to_generate"] == 0 and again["synth"]["new"] == 0


def test_synth_gives_up_after_its_draw_budget(tmp_path):
    cfg = tmp_path / "strict.toml"
    cfg.write_text(TINY.read_text() + "\n[synth]\nmax_prompt_tokens = 4\nmin_chars = 1999\nmax_draws_per_prompt = 2\n")
    r = _synth(cfg, tmp_path / "g.jsonl", 3)
    assert r["synth"]["kept"] == 0 and r["synth"]["sampled"] == 8  # ceil(3 * 2) = 6 draws -> two batches of 4
    assert r["to_generate"] == 0


def test_multi_turn_adds_second_turns_beside_their_first_and_resumes(tmp_path, tok):
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.tokenizer import vocab_identity
    from dflash_ipc.datagen.gen import GenOptions
    from dflash_ipc.datagen.synth_turns import extend_turns, turns_path
    from dflash_ipc.eval.target_lm import build_target_lm

    path = tmp_path / "mt.toml"
    synth = "\n[synth]\nmax_prompt_tokens = 6\ndrop_unfinished = false\nmin_chars = 1\nmulti_turn_fraction = 1.0\n"
    path.write_text(TINY.read_text() + synth)
    cfg = load_config(path)
    out, hold = tmp_path / "gen.jsonl", tmp_path / "gen.holdout.jsonl"
    for i in range(6):
        answer = f"Boil it for {i} minutes."
        rec = {
            "id": f"synth-0-0-{i}",
            "conversations": [
                {"role": "user", "content": f"How do I cook dish {i}?"},
                {"role": "assistant", "content": answer, "token_ids": tok(answer, add_special_tokens=False)["input_ids"]},
            ],
            "finish": "length" if i == 5 else "stop",  # a cut answer gets no follow-up
            "tokenizer_vocab": vocab_identity(tok),
        }
        with open(hold if i >= 4 else out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    lm = build_target_lm(cfg.target, "cpu", vocab_size=len(tok))
    opts = GenOptions(batch_size=4, max_new=3)

    first = extend_turns(cfg, tok, lambda: lm, out, opts)
    turns = _lines(turns_path(out))
    assert first["multi_turn_candidates"] == 5 and first["turns_sampled"] == 5 and len(turns) == 5
    kept = {t["id"] for t in turns if t["content"]}
    assert first["turns_written"] == len(kept) and first["turns_dropped"] == 5 - len(kept)
    t2 = {r["id"]: r for r in _lines(out) + _lines(hold) if r["id"].endswith("/t2")}
    assert set(t2) == {k + "/t2" for k in kept}
    assert {r["id"] for r in _lines(hold) if r["id"].endswith("/t2")} == {k + "/t2" for k in kept if k.endswith("-4")}
    for rid, r in t2.items():
        conv = r["conversations"]
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant"]
        assert "token_ids" not in conv[1] and conv[3]["token_ids"]
        assert conv[2]["content"] == next(t["content"] for t in turns if t["id"] + "/t2" == rid)

    # resumed: nothing sampled again; a lost answer is redone from the kept turn
    assert extend_turns(cfg, tok, lambda: lm, out, opts) == {**first, "turns_sampled": 0, "turns_written": 0}
    if kept - {"synth-0-0-4"}:
        lines = out.read_text().splitlines()
        kept_lines = [x + "\n" for x in lines if not json.loads(x)["id"].endswith("/t2")]
        out.write_text("".join(kept_lines) + '{"id": "synth-0-0-0/t2", "conversa')  # and a torn line
        again = extend_turns(cfg, tok, lambda: lm, out, opts)
        assert again["turns_sampled"] == 0 and again["turns_written"] == len(kept - {"synth-0-0-4"})
    # the two-turn records train as chat records
    corpus = load_corpus(dataclasses.replace(cfg.data, paths=[str(out)]), tok, None)
    assert corpus.report.num_bad_lines == 0 and corpus.num_samples == len(_lines(out))


def test_synth_stops_at_its_time_budget_and_the_same_command_continues(tmp_path):
    cfg = tmp_path / "budget.toml"
    cfg.write_text(TINY.read_text() + "\n[synth]\nmax_prompt_tokens = 4\ndrop_unfinished = false\nmin_chars = 1\nmax_seconds = 0.001\n")
    out = tmp_path / "g.jsonl"
    first = _synth(cfg, out, 40)
    assert first["synth"]["sampled"] == 4  # one batch: the budget is checked between batches
    second = _synth(cfg, out, 40)
    assert second["synth"]["sampled"] == 8 and second["synth"]["new"] == second["synth"]["kept"] - first["synth"]["kept"]
    ids = [json.loads(x)["id"] for x in synth_prompts_path(out).read_text().splitlines()]
    assert len(ids) == len(set(ids)) == second["synth"]["kept"]


def test_a_spent_time_budget_still_samples_one_batch_per_call(tmp_path, monkeypatch):
    """However slow the process is scheduled between starting the clock and the first batch (here a clock
    that jumps an hour each read), each call samples one batch before it looks at synth.max_seconds, so a
    re-run always makes progress."""
    import itertools
    import time

    cfg = tmp_path / "slow.toml"
    cfg.write_text(TINY.read_text() + "\n[synth]\nmax_prompt_tokens = 4\ndrop_unfinished = false\nmin_chars = 1\nmax_seconds = 1\n")
    hours = itertools.count(step=3600.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(hours))
    out = tmp_path / "g.jsonl"
    assert _synth(cfg, out, 40)["synth"]["sampled"] == 4
    assert _synth(cfg, out, 40)["synth"]["sampled"] == 8
