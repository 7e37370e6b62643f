"""Each target family's chat format trains what the target generates: under Llama 3 headers, Gemma turns,
gpt-oss's harmony channels, Qwen3's and DeepSeek-R1's thinking blocks (and Phi-3's generation-config stop),
the loss mask covers the last answer as the target writes it after the generation prompt, with the stop
token it ends on, and the earlier answer's content as the template writes it; gen-data's record of the same
answer trains the same sample, and eval's prompt is the generation prompt that sample starts with.

The templates and tokens are tests/chat_formats.py's (written after the published templates; no hub)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from chat_formats import ANSWERS, ASKS, FORMAT_BY_NAME, FORMATS, SYSTEM, THOUGHTS, format_tokenizer
from conftest import supervised_runs
from transformers import GenerationConfig, LlamaConfig

from dflash_ipc.config import DataConfig, TargetConfig, load_config
from dflash_ipc.data.answer_message import answer_message
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.records import ANSWER_IDS_FIELD
from dflash_ipc.data.tokenizer import config_tokenizer, stop_token_ids, target_stop_ids
from dflash_ipc.datagen.gen import GenOptions, answer_prompts
from dflash_ipc.eval.prompts import EvalPrompt
from dflash_ipc.eval.run import render_prompt

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"
MAX_LEN = 1024


def _corpus(tmp_path: Path, name: str, records: list[dict], tok):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    corpus = load_corpus(DataConfig(paths=[str(path)], max_seq_len=MAX_LEN, bucket_edges=[MAX_LEN], token_budget=MAX_LEN), tok, None)
    assert corpus.report.num_bad_lines == 0, corpus.report.bad_lines
    return corpus


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _eval_prompt(tok, messages: list[dict]) -> list[int]:
    return render_prompt(tok, EvalPrompt("chat", "chat", tuple(messages)), MAX_LEN)


class ScriptedTarget(torch.nn.Module):
    """A target whose ``generate`` continues every prompt with one fixed script, so gen-data's own batching,
    stop cut and record writing run on an answer in the family's format (a random model writes no harmony)."""

    def __init__(self, script: list[int], stops: list[int]):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gen-data finds the device through the parameters
        self.generation_config = GenerationConfig(eos_token_id=stops)
        self.config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=1)  # a family left padding leaves alone
        self.script = script
        self.prompts: list[list[int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        self.prompts += [[t for t, m in zip(row, keep) if m] for row, keep in zip(input_ids.tolist(), attention_mask.tolist())]
        new = torch.tensor(self.script[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, new], dim=1)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_answer_trains_as_the_target_writes_it_after_eval_s_prompt(fmt, tmp_path):
    tok = format_tokenizer(fmt)
    chat = fmt.conversation
    ids, mask = _corpus(tmp_path, "rows", [{"conversations": chat}], tok).sample(0)
    assert supervised_runs(tok, ids, mask) == [fmt.earlier, fmt.generated + fmt.stop]
    # the answer's first supervised token follows exactly the prompt eval sends the target
    prompt = _eval_prompt(tok, chat[:-1])
    answer = _ids(tok, fmt.generated) + [tok.convert_tokens_to_ids(fmt.stop)]
    assert ids.tolist()[: len(prompt) + len(answer)] == prompt + answer
    assert mask.tolist()[len(prompt) - 1 : len(prompt) + len(answer)] == [0] + [1] * len(answer)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_gen_data_s_record_of_the_answer_trains_the_same_sample_with_or_without_its_ids(fmt, tmp_path):
    tok = format_tokenizer(fmt)
    chat, stops = fmt.conversation, [tok.convert_tokens_to_ids(t) for t in fmt.stops]
    generated = _ids(tok, fmt.generated)
    target = ScriptedTarget(generated + [tok.convert_tokens_to_ids(fmt.stop), generated[0]], stops)
    prompt = _eval_prompt(tok, chat[:-1])
    out, hold = tmp_path / "gen.jsonl", tmp_path / "gen.holdout.jsonl"
    counts = {"written": 0, "held_out": 0, "new_tokens": 0}
    opts = GenOptions(batch_size=1, max_new=len(generated) + 2)
    answer_prompts(load_config(TINY), target, tok, [("c0", chat[:-1], prompt)], opts, out, hold, counts, lambda line: None)

    assert target.prompts == [prompt]  # gen-data feeds the target eval's prompt
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    answer = record["conversations"][-1]
    assert answer[ANSWER_IDS_FIELD] == generated and record["finish"] == "stop"  # the stop token left out
    if fmt.name == "gpt_oss":  # the channels split into the fields the template reads back
        assert (answer["thinking"], answer["content"]) == (THOUGHTS[1], ANSWERS[1])
    text_only = {**record, "conversations": [*chat[:-1], {k: v for k, v in answer.items() if k != ANSWER_IDS_FIELD}]}
    samples = [_corpus(tmp_path, name, [r], tok) for name, r in (("row", {"conversations": chat}), ("ids", record), ("text", text_only))]
    for corpus in samples[1:]:
        assert torch.equal(corpus.tokens, samples[0].tokens) and torch.equal(corpus.loss_mask, samples[0].loss_mask)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_eval_sends_the_target_s_answer_back_as_a_training_row_holds_it(fmt):
    # MT-Bench's second turn: the first answer as the target generated it, in the fields the template reads
    tok = format_tokenizer(fmt)
    chat = fmt.conversation
    first = answer_message(tok, chat[:2], _ids(tok, fmt.generation(THOUGHTS[0], ANSWERS[0])))
    assert _eval_prompt(tok, [*chat[:2], first, chat[3]]) == _eval_prompt(tok, chat[:4])


@pytest.mark.parametrize(
    ("name", "row_answer", "scaffold"),
    [
        ("qwen3", {"content": ANSWERS[1]}, "<think>\n\n</think>\n\n"),
        ("qwen3_5", {"content": ANSWERS[1]}, "\n</think>\n\n"),
        ("gpt_oss", {"content": ANSWERS[1]}, "<|channel|>final<|message|>"),
    ],
)
def test_an_answer_without_reasoning_trains_its_content_not_the_template_s_empty_block(name, row_answer, scaffold, tmp_path):
    fmt = FORMAT_BY_NAME[name]
    tok = format_tokenizer(fmt)
    chat = [*fmt.conversation[:4], {"role": "assistant", **row_answer}]
    ids, mask = _corpus(tmp_path, "rows", [{"conversations": chat}], tok).sample(0)
    assert supervised_runs(tok, ids, mask) == [fmt.earlier, ANSWERS[1] + fmt.stop]
    assert tok.decode(ids.tolist()).endswith(scaffold + ANSWERS[1] + fmt.stop + ("\n" if name.startswith("qwen") else ""))


def test_a_cut_answer_ends_at_the_cut_in_every_format(tmp_path):
    for fmt in FORMATS:
        tok = format_tokenizer(fmt)
        record = {"conversations": fmt.conversation, "finish": "length"}
        ids, mask = _corpus(tmp_path, fmt.name, [record], tok).sample(0)
        assert supervised_runs(tok, ids, mask) == [fmt.earlier, fmt.generated], fmt.name
        assert ids.tolist()[-1] != tok.convert_tokens_to_ids(fmt.stop)


def test_the_turns_close_on_the_stop_ids_of_the_target_s_generation_config(tmp_path):
    # Phi-3 ends a turn with <|end|>: not its tokenizer's eos, not a name the project knows; only the
    # checkpoint's generation config says the target stops there
    from transformers import Phi3Config

    fmt = FORMAT_BY_NAME["phi3"]
    bare = format_tokenizer(fmt, bind_stops=False)
    end = bare.convert_tokens_to_ids("<|end|>")
    assert end not in stop_token_ids(bare)
    ids, mask = _corpus(tmp_path, "bare", [{"conversations": fmt.conversation}], bare).sample(0)
    assert supervised_runs(bare, ids, mask) == [ANSWERS[0], ANSWERS[1]]

    ckpt, tok_dir = tmp_path / "phi3", tmp_path / "phi3-tokenizer"
    stops = [bare.convert_tokens_to_ids(t) for t in fmt.stops]
    config = Phi3Config(vocab_size=len(bare), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, eos_token_id=stops[0])
    config.save_pretrained(ckpt)
    GenerationConfig(eos_token_id=stops).save_pretrained(ckpt)
    bare.save_pretrained(tok_dir)
    cfg = load_config(TINY)
    cfg = dataclasses.replace(cfg, target=TargetConfig(model_path=str(ckpt), tokenizer=str(tok_dir)))
    tok = config_tokenizer(cfg)
    assert stop_token_ids(tok) >= set(stops)
    ids, mask = _corpus(tmp_path, "bound", [{"conversations": fmt.conversation}], tok).sample(0)
    assert supervised_runs(tok, ids, mask) == [fmt.earlier, fmt.generated + fmt.stop]
    # without generation_config.json transformers stops at the model config's eos; so does the corpus
    (ckpt / "generation_config.json").unlink()
    assert target_stop_ids(cfg.target, len(bare)) == [stops[0]]


def test_gen_data_s_answer_message_falls_back_to_the_text_for_people_when_no_shape_renders_it_back():
    # an answer cut inside gpt-oss's analysis channel: no message renders back into it; the ids still train
    fmt = FORMAT_BY_NAME["gpt_oss"]
    tok = format_tokenizer(fmt)
    cut = _ids(tok, f"<|channel|>analysis<|message|>{THOUGHTS[1]}")
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASKS[1]}]
    assert answer_message(tok, prompt, cut) == {"role": "assistant", "content": "analysis" + THOUGHTS[1]}
    assert answer_message(tok, prompt, _ids(tok, fmt.generated)) == {"role": "assistant", "thinking": THOUGHTS[1], "content": ANSWERS[1]}


def test_a_null_reasoning_field_is_absent_and_a_non_string_one_a_bad_line(tmp_path):
    # Parquet gives every message every field; gpt-oss's template renders an analysis message for any "thinking" key
    fmt = FORMAT_BY_NAME["gpt_oss"]
    tok = format_tokenizer(fmt)
    plain = [*fmt.conversation[:4], {"role": "assistant", "content": ANSWERS[1]}]
    nulls = [{**m, "thinking": None, "reasoning_content": None} for m in plain]
    a, b = (_corpus(tmp_path, name, [{"conversations": c}], tok) for name, c in (("plain", plain), ("nulls", nulls)))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversations": [*plain[:4], {**plain[4], "thinking": 5}]}) + "\n")
    cfg = DataConfig(paths=[str(path)], max_seq_len=MAX_LEN, bucket_edges=[MAX_LEN], token_budget=MAX_LEN, on_bad_line="error")
    with pytest.raises(DataError, match=rf"{path}:1: conversations\[4\]\.thinking must be a string, got int"):
        load_corpus(cfg, tok, None)


@pytest.mark.parametrize(
    "reasoning",
    [{"content": ANSWERS[1], "reasoning_content": THOUGHTS[1]}, {"content": f"<think>\n{THOUGHTS[1]}\n</think>\n\n{ANSWERS[1]}"}],
    ids=["field", "inline"],
)
def test_a_reasoning_answer_under_a_prompt_that_closed_the_reasoning_is_a_bad_line_unless_its_ids_train(reasoning, tmp_path):
    fmt = FORMAT_BY_NAME["qwen3_no_thinking"]
    tok = format_tokenizer(fmt)
    chat = [*fmt.conversation[:4], {"role": "assistant", **reasoning}]
    path = tmp_path / "thinking.jsonl"
    path.write_text(json.dumps({"conversations": chat}) + "\n")
    cfg = DataConfig(paths=[str(path)], max_seq_len=MAX_LEN, bucket_edges=[MAX_LEN], token_budget=MAX_LEN, on_bad_line="error")
    with pytest.raises(DataError, match=r"thinking turned off in \[chat_template\] kwargs\?"):
        load_corpus(cfg, tok, None)
    # the ids a target generated train whatever its text says
    ids = _ids(tok, ANSWERS[1])
    record = {"conversations": [*chat[:4], {**chat[4], ANSWER_IDS_FIELD: ids}]}
    sample, mask = _corpus(tmp_path, "ids", [record], tok).sample(0)
    assert supervised_runs(tok, sample, mask) == [fmt.earlier, ANSWERS[1] + fmt.stop]
