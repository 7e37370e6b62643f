"""``[chat_template] kwargs`` end to end: set once in the config, applied by gen-data, the training
corpus (whose rendering decides the loss mask), the supervisor's data plan and eval, recorded by the
export, and checked by eval. The tokenizer fixture's template reads ``enable_thinking`` (as Qwen3's
does) and refuses to render without it, so a place that forgets the kwarg fails loudly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.tokenizer import build_builtin_tokenizer, config_tokenizer, tokenizer_identity

THINK = "<think></think>"
TEMPLATE = (
    "{%- if enable_thinking is not defined %}{{ raise_exception('enable_thinking is not set') }}{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and not enable_thinking %}" + THINK + "{% endif %}{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}" + THINK + "{% endif %}{% endif -%}"
)
CHATS = [{"id": f"c{i}", "conversations": [{"role": "user", "content": f"Question number {i}?"}]} for i in range(3)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("template")
    tok = build_builtin_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d / "tokenizer")
    (d / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))

    def config(name: str, kwargs: dict | None, **data) -> Path:
        sections = {"target": {"tokenizer": str(d / "tokenizer")}, "data": {"builtin_samples": 8, **data}}
        if kwargs is not None:
            sections["chat_template"] = {"kwargs": kwargs}
        return write_toml(d / f"{name}.toml", tiny_cpu_config(**sections))

    return d, config


def test_config_validates_the_kwargs(setup):
    _, config = setup
    assert load_config(config("ok", {"enable_thinking": False})).chat_template.kwargs == {"enable_thinking": False}
    assert load_config(config("none", None)).chat_template.kwargs == {}
    for bad, why in (({"add_generation_prompt": True}, "set by apply_chat_template itself"), ({"not-a-name": 1}, "template variable")):
        with pytest.raises(ConfigError, match=rf"bad\.toml: chat_template\.kwargs: .*{why}"):
            load_config(config("bad", bad))
    with pytest.raises(ConfigError, match=r"chat_template\.kwargs: must be a table"):
        load_config(config("bad", "enable_thinking"))


def test_the_kwargs_reach_gen_data_the_loss_mask_the_plan_the_export_and_eval(setup, tmp_path):
    d, config = setup
    chats = str(d / "chats.jsonl")
    off, unset = config("off", {"enable_thinking": False}), config("unset", None)
    gen = ["gen-data", "--prompts", chats, "--max-new", "4", "--batch-size", "4", "--holdout-fraction", "0"]

    # gen-data renders its prompts with them (the template refuses to render without)
    r = CliRunner().invoke(main, [*gen, "--config", str(unset), "--out", str(tmp_path / "x.jsonl")])
    assert r.exit_code != 0 and "enable_thinking is not set" in (r.output + repr(r.exception))
    r = CliRunner().invoke(main, [*gen, "--config", str(off), "--out", str(tmp_path / "gen.jsonl"), "--json"])
    assert r.exit_code == 0, r.output
    records = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert len(records) == len(CHATS)

    # training's corpus: the prompt as gen-data fed it (think block included, unsupervised), the answer ids supervised
    cfg = load_config(config("train", {"enable_thinking": False}, paths=[str(tmp_path / "gen.jsonl")]))
    tok = config_tokenizer(cfg)
    corpus = load_corpus(cfg.data, tok, None)
    assert corpus.report.num_bad_lines == 0 and corpus.num_samples == len(CHATS)
    ids, mask = (t.tolist() for t in corpus.sample(0))
    prompt = tok(tok.apply_chat_template(CHATS[0]["conversations"], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    prompt = prompt["input_ids"]
    answer = records[0]["conversations"][-1]["token_ids"]
    assert tok.decode(prompt).endswith(f"<|im_start|>assistant\n{THINK}")
    assert ids[: len(prompt) + len(answer)] == prompt + answer
    assert mask[: len(prompt)] == [0] * len(prompt) and mask[len(prompt) : len(prompt) + len(answer)] == [1] * len(answer)
    on = load_config(config("train_on", {"enable_thinking": True}, paths=[str(tmp_path / "gen.jsonl")]))
    assert tokenizer_identity(config_tokenizer(on)) != tokenizer_identity(tok)  # the data cache is keyed by them
    assert load_corpus(on.data, config_tokenizer(on), None).sample(0)[0].tolist()[: len(prompt)] != prompt

    # the supervisor's data plan tokenizes the same corpus (without the kwargs every line is bad)
    from dflash_ipc.runtime.probe import plan_data

    assert plan_data(cfg, tmp_path / "run", 1).samples == len(CHATS)
    bare = load_config(config("bare", None, paths=[str(tmp_path / "gen.jsonl")]))
    with pytest.raises(DataError, match="no usable samples"):
        plan_data(bare, tmp_path / "run2", 1)

    # the export records them; eval renders with them and refuses a drafter trained with others
    exp = tmp_path / "export"
    assert CliRunner().invoke(main, ["export-untrained", "--config", str(off), "--out", str(exp)]).exit_code == 0
    assert json.loads((exp / "config.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    ev = ["eval", "--drafter", str(exp), "--prompts", chats, "--n", "1", "--max-new", "4", "--json"]
    r = CliRunner().invoke(main, [*ev, "--config", str(off)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["chat_template_kwargs"] == {"enable_thinking": False}
    r = CliRunner().invoke(main, [*ev, "--config", str(config("on", {"enable_thinking": True}))])
    assert r.exit_code == 2 and "trained on chats rendered with chat-template kwargs {'enable_thinking': False}" in r.output
