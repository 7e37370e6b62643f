"""``--set SECTION.KEY=VALUE``: one config key over the file's, on every command that takes ``--config``,
checked by the same checks as the file; a refusal names ``--set KEY`` (or, for a file key refused
because of a --set value, the file's key with the --set items)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.bench import pipeline
from dflash_ipc.cli import main
from dflash_ipc.config import ConfigError, load_config, parse_sets
from dflash_ipc.runtime.preflight import validate_for_up

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"


def test_values_parse_as_toml_else_as_strings():
    got = parse_sets(
        [
            "training.lr=3e-4",
            "training.max_steps = 7",
            "run.tensorboard=false",
            'data.paths=["a.jsonl", "b.jsonl"]',
            "run.name=trial-2",
            'run.run_dir="/tmp/x y"',
            "chat_template.kwargs={ enable_thinking = false }",
            "run.run_dir=",
            "target.spec.rope_parameters.rope_theta=1e6",
        ]
    )
    assert got == {
        "training.lr": 3e-4,
        "training.max_steps": 7,
        "run.tensorboard": False,
        "data.paths": ["a.jsonl", "b.jsonl"],
        "run.name": "trial-2",
        "run.run_dir": "",
        "chat_template.kwargs": {"enable_thinking": False},
        "target.spec.rope_parameters.rope_theta": 1e6,
    }


def test_set_applies_over_the_file_down_to_nested_tables():
    cfg = load_config(TINY, sets=["training.lr=1e-3", "target.spec.hidden_size=32", "target.spec.rope_parameters.rope_theta=5e5"])
    assert cfg.training.lr == 1e-3 and cfg.target.spec["hidden_size"] == 32
    assert cfg.target.spec["rope_parameters"] == {**load_config(TINY).target.spec["rope_parameters"], "rope_theta": 5e5}
    assert cfg.target.spec["num_hidden_layers"] == 6  # the rest of the file's table stays


@pytest.mark.parametrize(
    "item, message",
    [
        ("training.lr=-1", "--set training.lr: must be a positive number"),
        ("training.lr=abc", "--set training.lr: must be a number (got str 'abc')"),
        ("training.lr=inf", "--set training.lr: must be a finite number"),
        ("training.lrr=1", "--set training.lrr: unknown key; did you mean 'lr'?"),
        ("trainer.lr=1", "--set trainer: unknown section; did you mean 'training'?"),
        ("lr=1", "--set lr: name a key with its section"),
        ("training.lr.x=1", "--set training.lr.x: training.lr is a value, not a table"),
        ("training", "--set 'training': expected SECTION.KEY=VALUE"),
        ("run.name=..", "--set run.name: must be a plain name"),
        ('topology.targets=["gpu"]', "--set topology.targets[0]: 'gpu' is not a device"),
        ("training.kl_weight=0.5", "--set training.kl_weight: needs target.capture_last_hidden = true"),
    ],
)
def test_a_bad_set_is_refused_naming_its_key(item, message):
    with pytest.raises(ConfigError) as ei:
        load_config(TINY, sets=[item])
    assert str(ei.value).startswith(message), str(ei.value)


def test_a_file_key_refused_because_of_a_set_names_the_set():
    with pytest.raises(ConfigError) as ei:
        load_config(TINY, sets=["data.max_seq_len=1024"])
    assert str(ei.value).startswith(f"{TINY}: data.bucket_edges: the last edge must equal data.max_seq_len (1024)")
    assert str(ei.value).endswith("(with --set data.max_seq_len=1024)")


def test_preflight_refusals_of_a_set_key_name_it(tmp_path):
    """Checks against the model (up's preflight) blame --set as the file's checks do."""
    with pytest.raises(ConfigError, match=r"^--set target\.layer_ids: \[50\] outside the target's 6 decoder layers"):
        validate_for_up(TINY, str(tmp_path / "run"), sets=["target.layer_ids=[1, 50]"])
    with pytest.raises(ConfigError, match=r"^--set target\.spec\.hidden_sise: unknown Qwen3_5TextConfig field"):
        validate_for_up(TINY, str(tmp_path / "run"), sets=["target.spec.hidden_sise=3"])
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- each command


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


COMMANDS = [
    ("check-config", "--file-only"),
    ("up", "--run-dir", "{tmp}/run"),
    ("plan",),
    ("eval", "--drafter", "{tmp}"),
    ("export-untrained", "--out", "{tmp}/out"),
    ("gen-data", "--out", "{tmp}/gen.jsonl"),
    ("bench", "pipeline", "--variants", "forward-only"),
    ("bench", "drafter-step"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]) if c[0] == "bench" else c[0])
@pytest.mark.parametrize(
    "item, message",
    [("training.lr=-1", "--set training.lr: must be a positive number"), ("drafter.num_layrs=2", "--set drafter.num_layrs: unknown key")],
)
def test_every_config_command_refuses_a_bad_set_naming_the_key(tmp_path, command, item, message):
    args = [a.format(tmp=tmp_path) for a in command]
    r = invoke(*args, "--config", TINY, "--set", item)
    assert r.exit_code == 2, r.output
    assert f"error: {message}" in r.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists() and not (tmp_path / "gen.jsonl").exists()


def test_target_forward_bench_refuses_a_bad_set():
    cmd = [sys.executable, "-m", "dflash_ipc.cli", "bench", "target-forward", "--config", str(TINY), "--out", "/nonexistent/x.json"]
    r = subprocess.run([*cmd, "--set", "data.token_budget=0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: --set data.token_budget: must be >= data.max_seq_len" in r.stderr, r.stderr


def test_check_config_and_plan_apply_the_set():
    r = invoke("check-config", "--file-only", "--config", TINY, "--set", "training.lr=1e-3", "--set", "run.name=trial-2")
    assert r.exit_code == 0, r.output
    printed = json.loads(r.stdout)  # stderr: the run-length line
    assert printed["training"]["lr"] == 1e-3 and printed["run"]["name"] == "trial-2"
    r = invoke("plan", "--config", TINY, "--json", "--set", "data.builtin_samples=40", "--set", "run.seed=3")
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output.strip().splitlines()[-1])
    assert stats["seed"] == 3 and sum(b["samples"] for b in stats["buckets"]) == 40


def test_export_untrained_eval_and_gen_data_apply_the_set(tmp_path):
    """The --set values reach what each command builds: the export's shape and recorded template kwargs, eval's
    refusal of a drafter exported with other kwargs, gen-data's prompts."""
    kwargs = "chat_template.kwargs={ style = 'terse' }"
    out = tmp_path / "export"
    r = invoke(
        "export-untrained",
        "--config",
        TINY,
        "--out",
        out,
        "--set",
        "drafter.num_layers=1",
        "--set",
        "drafter.layer_types=[]",
        "--set",
        kwargs,
    )
    assert r.exit_code == 0, r.output
    exported = json.loads((out / "config.json").read_text())
    assert exported["num_hidden_layers"] == 1 and exported["chat_template_kwargs"] == {"style": "terse"}
    ev = ["eval", "--config", TINY, "--drafter", out, "--n", "1", "--max-new", "2", "--json", "--set", "data.builtin_samples=4"]
    r = invoke(*ev)
    assert r.exit_code == 2 and "chat-template kwargs {'style': 'terse'}" in r.output, r.output
    r = invoke(*ev, "--set", kwargs)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["chat_template_kwargs"] == {"style": "terse"}
    gen = tmp_path / "gen.jsonl"
    r = invoke("gen-data", "--config", TINY, "--out", gen, "--max-new", "2", "--json", "--set", "data.builtin_samples=3")
    assert r.exit_code == 0, r.output
    assert len(gen.read_text().splitlines()) == 3


def test_bench_pipeline_variants_load_the_set_under_their_own_overrides(tmp_path, monkeypatch):
    """Each variant's config is the file, then --set, then the variant's overrides (here training.max_steps)."""
    seen = []

    class Stop(Exception):
        pass

    def supervisor(cfg, *_args, **_kwargs):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(pipeline, "Supervisor", supervisor)
    with pytest.raises(Stop):
        pipeline.run_variant(str(TINY), "forward-only", 3, 1.0, print, sets=["training.lr=1e-3", "training.max_steps=99"])
    assert seen[0].training.lr == 1e-3 and seen[0].training.max_steps == 3
