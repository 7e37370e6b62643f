"""The attention kernel eval's and gen-data's target loads with: ``target.attn_implementation`` resolved by the
family (``DecoderFamily.attention_implementation``), as the training target resolves it. gpt-oss has no sdpa."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from family_zoo import family_config

from dflash_ipc.cli import main
from dflash_ipc.families import family_of

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def test_auto_picks_sdpa_where_the_family_has_it_and_eager_for_gpt_oss():
    assert family_of(family_config("llama")).attention_implementation("auto") == "sdpa"
    assert family_of(family_config("gemma3")).attention_implementation("auto") == "sdpa"
    gpt_oss = family_of(family_config("gpt_oss"))
    assert gpt_oss.attention_implementation("auto") == "eager"
    assert gpt_oss.attention_implementation("flex_attention") == "flex_attention"
    with pytest.raises(ValueError, match=r"no sdpa attention for gpt_oss \(it supports eager, .*target\.attn_implementation"):
        gpt_oss.attention_implementation("sdpa")


def test_gen_data_loads_gpt_oss_with_eager_by_default_and_refuses_sdpa_by_the_key(family_checkpoint, tmp_path):
    path = family_checkpoint("gpt_oss")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "-"}]}) + "\n")
    argv = ["gen-data", "--config", str(TINY), "--prompts", str(prompts), "--out", str(tmp_path / "gen.jsonl"), "--max-new", "4"]
    for key_value in (f'target.model_path="{path}"', f'target.tokenizer="{path}"', "target.spec={}"):
        argv += ["--set", key_value]
    r = CliRunner().invoke(main, [*argv, "--set", 'target.attn_implementation="sdpa"'])
    assert r.exit_code == 2, r.output
    assert "error: transformers has no sdpa attention for gpt_oss" in r.output and "target.attn_implementation" in r.output
    r = CliRunner().invoke(main, argv)  # the default, "auto"
    assert r.exit_code == 0, r.output
