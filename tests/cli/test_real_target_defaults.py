"""Defaults for real checkpoints: the model's own tokenizer, vocabulary check, mask token choice,
ascending layer ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, config_from_dict, load_config
from dflash_ipc.data.tokenizer import (
    TokenizerError,
    check_vocab,
    choose_mask_token,
    load_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]


def _chat_tokenizer(specials: list[str], eos: str, pad: str | None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of 40 ids with ``specials`` first (SmolLM2-style layout)."""
    words = [f"w{i}" for i in range(40 - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)
    fast.add_special_tokens({"additional_special_tokens": specials})
    return fast


def test_mask_token_is_never_a_stop_token():
    # builtin: its own <|mask|>
    assert choose_mask_token(load_tokenizer("builtin"))[0] == 1023
    # SmolLM2-like: pad = eos = <|im_end|>; the unused <empty_output> wins
    smol = _chat_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<empty_output>"], "<|im_end|>", "<|im_end|>")
    tid, why = choose_mask_token(smol, 40)
    assert tid == 4 and "empty_output" in why
    # no unused special token, model vocabulary padded past the tokenizer: the first free row
    plain = _chat_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|im_end|>")
    assert choose_mask_token(plain, 64)[0] == 40
    # nothing else: the last id that is no stop token (the pad is the end-of-turn token here)
    tid, _ = choose_mask_token(plain, 40)
    assert tid == 39 and tid != plain.convert_tokens_to_ids("<|im_end|>")


def test_vocab_mismatch_is_refused_padding_is_not():
    tok = load_tokenizer("builtin")
    with pytest.raises(TokenizerError, match="has 1024 ids but the target model's vocabulary has 49152"):
        check_vocab(tok, 49152, "builtin")
    with pytest.raises(TokenizerError):
        check_vocab(tok, 512, "builtin")
    check_vocab(tok, 1024, "builtin")
    check_vocab(tok, 1024 + 256, "builtin")  # padded embedding table


def test_tokenizer_defaults_to_the_checkpoint(tmp_path):
    assert config_from_dict({}).target.tokenizer == "builtin"
    cfg = config_from_dict({"target": {"model_path": str(tmp_path)}})
    assert cfg.target.tokenizer == str(tmp_path)
    assert config_from_dict({"target": {"model_path": str(tmp_path), "tokenizer": "builtin"}}).target.tokenizer == "builtin"


def test_check_config_refuses_builtin_tokenizer_for_a_large_vocab_checkpoint(tmp_path):
    # A whole checkpoint (config and weights): the preflight refuses a folder without weights first.
    LlamaForCausalLM(
        LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4)
    ).save_pretrained(tmp_path / "m")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[target]\nmodel_path = "{tmp_path / "m"}"\ntokenizer = "builtin"\n')
    r = CliRunner().invoke(main, ["check-config", "--config", str(cfg)])
    assert r.exit_code == 2
    assert "1024 ids but the target model's vocabulary has 49152" in r.output


def test_layer_ids_must_be_strictly_ascending(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[target]\nlayer_ids = [1, 5, 3]\n")
    with pytest.raises(ConfigError, match=r"c\.toml: target\.layer_ids: must be strictly ascending .*use \[1, 3, 5\]"):
        load_config(cfg)
    cfg.write_text("[target]\nlayer_ids = [1, 3, 3]\n")
    with pytest.raises(ConfigError, match="strictly ascending"):
        load_config(cfg)
