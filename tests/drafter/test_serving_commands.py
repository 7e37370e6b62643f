"""The serving commands as `export` prints them, per target family (dflash_ipc/drafter/export/serving.py): the target
read from the run's config as the loaders read it, SGLang's flag for hybrid targets, absolute paths, and the
speculators entry for the layouts its converter reads. Executing the printed Python routes against eval:
tests/drafter/test_export_clients.py."""

from __future__ import annotations

import shlex

from loop_harness import small_config

from dflash_ipc.drafter.export.serving import (
    ENGINES_BY_CLIENT,
    TARGET_PLACEHOLDER,
    engine_reference,
    render_serving_commands,
    serving_target,
)
from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig

HYBRID_FLAG = "--mamba-scheduler-strategy extra_buffer"


def _drafter(draft_vocab_size: int = 0) -> DrafterModelConfig:
    return DrafterModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        block_size=8,
        vocab_size=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        target_layer_ids=[0, 2],
        mask_token_id=1023,
        draft_vocab_size=draft_vocab_size,
    )


def _sglang_argv(commands: dict[str, str]) -> list[str]:
    return shlex.split(commands["sglang"].splitlines()[-1])


def test_a_hybrid_target_gets_sglangs_mamba_scheduler_strategy_and_an_attention_only_one_does_not(tmp_path, tiny_llama, monkeypatch):
    # the embedded default's target: Qwen3.5-family GatedDeltaNet layers beside full attention
    for sub in ("hybrid", "llama"):
        (tmp_path / sub).mkdir()
    hybrid_cfg = small_config(tmp_path / "hybrid", targets=1)
    hybrid = serving_target(hybrid_cfg)
    assert hybrid.hybrid and hybrid.name == TARGET_PLACEHOLDER
    argv = _sglang_argv(render_serving_commands(tmp_path / "export", _drafter(), hybrid))
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH" and argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"

    # an attention-only Llama named by a path relative to the working directory, as the loaders read it
    monkeypatch.chdir(tiny_llama.parent)
    llama_cfg = small_config(tmp_path / "llama", targets=1, target={"model_path": tiny_llama.name, "spec": {}, "layer_ids": [0, 2]})
    llama = serving_target(llama_cfg)
    assert not llama.hybrid and llama.name == str(tiny_llama.resolve())
    commands = render_serving_commands(tmp_path / "export", _drafter(), llama)
    argv = _sglang_argv(commands)
    assert HYBRID_FLAG not in commands["sglang"] and argv[argv.index("--model-path") + 1] == str(tiny_llama.resolve())
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str((tmp_path / "export").resolve())
    vllm = shlex.split(commands["vllm"].splitlines()[-1])
    assert vllm[vllm.index("serve") + 1] == str(tiny_llama.resolve())


def test_a_hub_id_stays_a_hub_id_and_a_local_directory_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert engine_reference("Qwen/Qwen3.5-27B") == "Qwen/Qwen3.5-27B"
    (tmp_path / "models" / "m").mkdir(parents=True)
    assert engine_reference("models/m") == str(tmp_path / "models" / "m")
    assert engine_reference("") == TARGET_PLACEHOLDER


def test_speculators_is_named_with_the_layout_it_converts(tmp_path, tiny_llama):
    cfg = small_config(tmp_path, targets=1, target={"model_path": str(tiny_llama), "spec": {}, "layer_ids": [0, 2]})
    target = serving_target(cfg)
    whole = render_serving_commands(tmp_path / "export", _drafter(), target)
    assert list(whole) == list(ENGINES_BY_CLIENT["all"])
    argv = shlex.split(whole["speculators"].splitlines()[-1])
    assert argv[:3] == ["speculators", "convert", str((tmp_path / "export").resolve())] and argv[argv.index("--verifier") + 1] == str(
        tiny_llama
    )
    # a reduced head in the `all` layout: no command that would fail, the layout that converts instead
    reduced = render_serving_commands(tmp_path / "export", _drafter(draft_vocab_size=256), target)["speculators"]
    assert "speculators convert" not in reduced and "--for sglang" in reduced and "256" in reduced
    sglang_layout = render_serving_commands(tmp_path / "export", _drafter(draft_vocab_size=256), target, "sglang")["speculators"]
    assert sglang_layout.splitlines()[-1].startswith("speculators convert")
