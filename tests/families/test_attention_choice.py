"""Which attention kernel eval's and gen-data's target is loaded with: what ``target.attn_implementation`` asks,
where the family's transformers class has it; ``"auto"``: sdpa where it has it, else eager (gpt-oss has no sdpa)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from family_zoo import family_config

from dflash_ipc.cli import main
from dflash_ipc.families import family_of
from dflash_ipc.families.attention import choose_attention

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def test_auto_picks_sdpa_where_the_family_has_it_and_eager_for_gpt_oss():
    assert choose_attention(family_of(family_config("llama")), "auto") == "sdpa"
    assert choose_attention(family_of(family_config("gemma3")), "auto") == "sdpa"
    assert choose_attention(family_of(family_config("gpt_oss")), "auto") == "eager"


def test_a_kernel_the_family_has_is_kept_and_one_it_lacks_is_refused_naming_the_key_and_what_it_has():
    gpt_oss = family_of(family_config("gpt_oss"))
    assert choose_attention(gpt_oss, "eager") == "eager"
    assert choose_attention(gpt_oss, "flex_attention") == "flex_attention"
    with pytest.raises(ValueError, match=r"target\.attn_implementation = 'sdpa'.* gpt_oss \(supported: eager, flash_attention_2"):
        choose_attention(gpt_oss, "sdpa")


def test_gen_data_refuses_gpt_oss_with_sdpa_by_the_key_before_loading_it(zoo_checkpoint, tmp_path):
    path = zoo_checkpoint("gpt_oss")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "-"}]}) + "\n")
    sets = [f'target.model_path="{path}"', f'target.tokenizer="{path}"', "target.spec={}", 'target.attn_implementation="sdpa"']
    argv = ["gen-data", "--config", str(TINY), "--prompts", str(prompts), "--out", str(tmp_path / "gen.jsonl"), "--max-new", "4"]
    r = CliRunner().invoke(main, argv + [arg for s in sets for arg in ("--set", s)])
    assert r.exit_code == 2, r.output
    assert "error: target.attn_implementation = 'sdpa': transformers has no sdpa attention for gpt_oss" in r.output
    r = CliRunner().invoke(main, argv + [arg for s in sets[:-1] for arg in ("--set", s)] + ["--set", 'target.attn_implementation="eager"'])
    assert r.exit_code == 0, r.output
