"""gen-data with the tiny random Qwen3.5 target: resume, held-out split, batching; Parquet and
saved-dataset sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import load_config
from dflash_ipc.data.corpus import DataError, load_corpus
from dflash_ipc.data.readers import iter_records
from dflash_ipc.data.tokenizer import load_tokenizer
from dflash_ipc.datagen.gen import holdout_path, is_holdout, prompt_key

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"

CHATS = [
    {
        "id": f"q{i}",
        "conversations": [
            {"role": "user", "content": f"What does function number {i} do?"},
            {"role": "assistant", "content": f"It returns {i}."},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "Nothing."},
        ],
    }
    for i in range(10)
]


def _gen(out: Path, *extra: str) -> dict:
    r = CliRunner().invoke(
        main, ["gen-data", "--config", str(TINY), "--out", str(out), "--max-new", "6", "--batch-size", "3", "--json", *extra]
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def _lines(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _held(chat: dict, fraction: float) -> bool:
    return is_holdout(prompt_key(chat["conversations"][:1]), fraction)


def test_gen_data_resumes_without_repeating_and_splits_by_prompt_hash(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in CHATS) + '{"text": "no prompt here"}\n')
    out = tmp_path / "gen.jsonl"
    first = _gen(out, "--prompts", str(prompts), "--limit", "4", "--holdout-fraction", "0.3")
    assert first["written"] + first["held_out"] == 4 and first["skipped_done"] == 0
    # an interrupted run leaves half a line: it is cut and that record redone
    with open(out, "a") as f:
        f.write('{"id": "q9", "conversa')
    second = _gen(out, "--prompts", str(prompts), "--holdout-fraction", "0.3")
    assert second["skipped_done"] == 4 and second["written"] + second["held_out"] == 6 and second["no_prompt"] == 1
    train, held = _lines(out), _lines(holdout_path(out))
    ids = [r["id"] for r in train + held]
    assert sorted(ids) == sorted(c["id"] for c in CHATS)  # every prompt exactly once
    assert {r["id"] for r in held} == {c["id"] for c in CHATS if _held(c, 0.3)}
    for r in train + held:
        conv = r["conversations"]
        assert [m["role"] for m in conv] == ["user", "assistant"]  # the first user turn only
        assert conv[0]["content"] == next(c for c in CHATS if c["id"] == r["id"])["conversations"][0]["content"]
        assert r["finish"] in ("stop", "length")
    # a third run has nothing left to do
    assert _gen(out, "--prompts", str(prompts), "--holdout-fraction", "0.3")["to_generate"] == 0


def test_repeated_prompts_are_answered_once_and_never_on_both_sides(tmp_path):
    # the same first user turn under other ids (the built-in corpus repeats questions), one with another later turn
    dupes = [{"id": f"dup{i}", "conversations": c["conversations"][:2]} for i, c in enumerate(CHATS)]
    system = [{"id": "sys0", "conversations": [{"role": "system", "content": "Be brief."}] + CHATS[0]["conversations"][:2]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in CHATS[:6] + dupes + system))
    out = tmp_path / "gen.jsonl"
    first = _gen(out, "--prompts", str(prompts), "--holdout-fraction", "0.4")
    # dup0..dup5 repeat q0..q5; dup6..dup9 are new prompts; a system message makes another prompt
    assert first["duplicate_prompts"] == 6 and first["written"] + first["held_out"] == 11
    train, held = _lines(out), _lines(holdout_path(out))
    keys = [prompt_key(r["conversations"][:-1]) for r in train + held]
    assert len(keys) == len(set(keys))
    assert {prompt_key(r["conversations"][:-1]) for r in train}.isdisjoint(prompt_key(r["conversations"][:-1]) for r in held)
    assert {r["id"] for r in held} == {c["id"] for c in CHATS[:6] + dupes[6:] + system if _held(c, 0.4)}
    assert held and train  # 0.4 of 11 prompts: both sides used (fixed by the hash)
    # resuming with the repeats listed first: prompts answered under another id count as done
    fresh = [{"id": f"new{i}", "conversations": [{"role": "user", "content": "A brand new question?"}]} for i in range(2)]
    prompts.write_text("".join(json.dumps(c) + "\n" for c in dupes + CHATS + fresh))
    again = _gen(out, "--prompts", str(prompts), "--holdout-fraction", "0.4")
    assert (again["to_generate"], again["skipped_done"], again["duplicate_prompts"]) == (1, 20, 1)


def test_batched_greedy_answers_equal_one_at_a_time(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(c) + "\n" for c in CHATS[:4]))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _gen(a, "--prompts", str(prompts))
    r = CliRunner().invoke(
        main, ["gen-data", "--config", str(TINY), "--out", str(b), "--max-new", "6", "--batch-size", "1", "--prompts", str(prompts)]
    )
    assert r.exit_code == 0, r.output

    def key(rows):
        return sorted((x["id"], x["conversations"][-1]["content"]) for x in rows)

    assert key(_lines(a)) == key(_lines(b))


def test_holdout_split_is_deterministic_and_near_the_fraction():
    assert prompt_key([{"role": "user", "content": "x"}]) != prompt_key(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    )
    ids = [f"doc-{i}" for i in range(4000)]
    share = sum(is_holdout(i, 0.1) for i in ids) / len(ids)
    assert 0.085 < share < 0.115
    assert [is_holdout(i, 0.1) for i in ids[:50]] == [is_holdout(i, 0.1) for i in ids[:50]]
    assert not any(is_holdout(i, 0.0) for i in ids)


def test_parquet_and_saved_dataset_sources_load_like_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = CHATS[:5]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in rows))
    tok = load_tokenizer("builtin")
    cfg = load_config(TINY).data
    corpora = []
    for path in (jsonl, tmp_path / "chats.parquet", tmp_path / "ds"):
        cfg.paths = [str(path)]
        corpora.append(load_corpus(cfg, tok, None))
    for c in corpora[1:]:
        assert c.num_samples == 5 and c.tokens.tolist() == corpora[0].tokens.tolist()
        assert c.loss_mask.tolist() == corpora[0].loss_mask.tolist()
    where = [w for w, _ in iter_records([str(tmp_path / "chats.parquet")])]
    assert where[0].endswith("chats.parquet:row 1")


def test_unreadable_parquet_is_a_clear_data_error(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    tok = load_tokenizer("builtin")
    cfg = load_config(TINY).data
    cfg.paths = [str(bad)]
    with pytest.raises(DataError, match="bad.parquet: not a readable Parquet file"):
        load_corpus(cfg, tok, None)


def test_static_and_compiled_decoding_give_the_ids_of_the_dynamic_cache(tiny_llama):
    # an attention-only model (SmolLM2's family): the static cache applies to it (a hybrid model keeps its own)
    import torch
    from transformers import LlamaForCausalLM

    from dflash_ipc.datagen.gen import GenOptions, generate_batch

    lm = LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3] * 20, [1, 2]]
    dyn = GenOptions(max_new=12)
    free = generate_batch(lm, prompts, 0, {1023}, dyn, seed=0)
    # a stop token the first answer reaches mid-way: cut there in every mode
    stop = free[0][0][4]
    ref = generate_batch(lm, prompts, 0, {stop}, dyn, seed=0)
    assert ref[0] == (free[0][0][:4], "stop") and any(f == "length" for _, f in ref)
    compiled_graphs = []

    @torch._dynamo.register_backend(name="dflash_test_counting")
    def counting(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    try:
        for mode, backend in (("static", "inductor"), ("compiled", "dflash_test_counting")):
            opts = GenOptions(max_new=12, decode=mode, compile_backend=backend)
            assert generate_batch(lm, prompts, 0, {stop}, opts, seed=0) == ref, mode
        assert compiled_graphs  # the compiled mode did run a compiled forward
        # a short batch is filled to the batch size: the same graph serves it, and only its own answers return
        graphs = len(compiled_graphs)
        assert generate_batch(lm, prompts[1:], 0, {stop}, opts, seed=0) == ref[1:]
        assert len(compiled_graphs) == graphs
    finally:
        torch._dynamo.reset()


def test_decode_mode_is_checked():
    from dflash_ipc.datagen.gen import GenOptions

    with pytest.raises(ValueError, match="decode must be one of dynamic, static, compiled"):
        GenOptions(decode="graphs")
    # synthesis samples with gen-data's batch and decode mode, never its split or limit
    sampling = GenOptions(batch_size=7, decode="compiled", holdout_fraction=0.1, limit=3).sampling(5, 1.0, 0.9)
    assert (sampling.batch_size, sampling.decode, sampling.max_new, sampling.temperature, sampling.top_p) == (7, "compiled", 5, 1.0, 0.9)
    assert (sampling.holdout_fraction, sampling.limit) == (0.0, 0)
    r = CliRunner().invoke(main, ["gen-data", "--config", str(TINY), "--out", "/tmp/never.jsonl", "--decode", "graphs"])
    assert r.exit_code == 2 and "graphs" in r.output
