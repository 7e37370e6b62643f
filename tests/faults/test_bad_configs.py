"""A corpus of bad configs: each is refused before any process starts, naming the file and the
dotted key, and leaves the run directory untouched (not created, not chmodded).

Every case goes through :func:`dflash_ipc.runtime.preflight.validate_for_up`, the one entry
point `dflash-ipc up` calls before it touches the run directory; a representative subset also
runs the real `dflash-ipc up` CLI in a subprocess (exit 2, no traceback, no run directory, no
logs/ or sock/, so no child was spawned). Configs are written from dicts (conftest.write_toml, tomli-w).
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import write_toml

from dflash_ipc.config import ConfigError, TopologyConfig
from dflash_ipc.runtime.preflight import check_devices, validate_for_up

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "dflash_ipc.cli"]
DELETE = object()


def base_config() -> dict[str, Any]:
    """configs/tiny-cpu.toml: a config that passes every check on this machine."""
    return tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())


def apply(raw: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": value}`` sets raw["a"]["b"]["c"] (DELETE removes it)."""
    raw = copy.deepcopy(raw)
    for dotted, value in patch.items():
        *parents, leaf = dotted.split(".")
        table = raw
        for p in parents:
            table = table.setdefault(p, {})
        if value is DELETE:
            table.pop(leaf, None)
        else:
            table[leaf] = value
    return raw


# --------------------------------------------------------------------------- the corpus


def _model_dir(tmp: Path, *, config_json: str | None, weights: bool) -> str:
    d = tmp / "model"
    d.mkdir()
    if config_json is not None:
        (d / "config.json").write_text(config_json)
    if weights:
        (d / "model.safetensors").write_bytes(b"not read by the checks")
    return str(d)


def _empty_dir(tmp: Path) -> Path:
    (tmp / "folder").mkdir()
    return tmp / "folder"


def _llama_config_json() -> str:
    """A small model's config.json that passes every check but the weights'."""
    from transformers import LlamaConfig

    conf = LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    )
    return conf.to_json_string()


@dataclass
class Case:
    name: str
    key: str  # the dotted key the message must name
    fragment: str  # and a phrase saying what is wrong
    patch: dict[str, Any] = field(default_factory=dict)
    # Builds a patch that needs files (a model directory) under tmp_path.
    setup: Callable[[Path], dict[str, Any]] | None = None


CUDA_ON_TWO_GPUS = {"topology.targets": ["cuda:0"], "topology.drafters": ["cuda:1"], "transport.backend": "auto"}

CASES = [
    # run: names, timeouts
    Case("run-name-dotdot", "run.name", "not '.' or '..'", {"run.name": ".."}),
    Case("run-name-dot", "run.name", "not '.' or '..'", {"run.name": "."}),
    Case("run-name-slash", "run.name", "without '/'", {"run.name": "../elsewhere"}),
    Case("handshake-inf", "run.handshake_timeout_s", "finite", {"run.handshake_timeout_s": float("inf")}),
    Case("heartbeat-timeout-nan", "run.heartbeat_timeout_s", "finite", {"run.heartbeat_timeout_s": float("nan")}),
    Case("heartbeat-interval-negative", "run.heartbeat_interval_s", "> 0", {"run.heartbeat_interval_s": -0.5}),
    Case("teardown-negative", "run.teardown_grace_s", ">= 0", {"run.teardown_grace_s": -1}),
    Case("handshake-huge", "run.handshake_timeout_s", "<= 604800", {"run.handshake_timeout_s": 1e12}),
    Case("run-unknown-key", "run.nmae", "did you mean 'name'", {"run.nmae": "x"}),
    Case("run-name-newline", "run.name", "control characters", {"run.name": "a\nb"}),
    Case("run-dir-nul", "run.run_dir", "NUL", {"run.run_dir": "runs/a\0b"}),
    Case("heartbeat-interval-1e-9", "run.heartbeat_interval_s", "at least 0.05 s", {"run.heartbeat_interval_s": 1e-9}),
    # topology: devices
    Case("device-not-a-device", "topology.targets[1]", "not a device", {"topology.targets": ["cpu", "gpu1"]}),
    Case(
        "device-mixed",
        "topology.targets",
        "mixing cpu and cuda",
        {"topology.targets": ["cuda:0"], "topology.drafters": ["cpu"], "transport.backend": "auto"},
    ),
    Case(
        "device-duplicate-drafters",
        "topology.drafters[1]",
        "one GPU per drafter",
        {**CUDA_ON_TWO_GPUS, "topology.drafters": ["cuda:1", "cuda:1"]},
    ),
    Case("device-absent", "topology.targets[0]", "'cuda:99'", {**CUDA_ON_TWO_GPUS, "topology.targets": ["cuda:99"]}),
    Case("kl-without-last-hidden", "training.kl_weight", "capture_last_hidden", {"training.kl_weight": 0.5}),
    # transport, data, training
    Case("ring-slots-one", "transport.ring_slots", ">= 2", {"transport.ring_slots": 1}),
    Case("bucket-edges-vs-seq-len", "data.bucket_edges", "last edge", {"data.max_seq_len": 1024}),
    Case("data-file-missing", "data.paths[0]", "not found", {"data.paths": ["/nonexistent/train.jsonl"]}),
    Case("lr-inf", "training.lr", "finite", {"training.lr": float("inf")}),
    Case("grad-clip-nan", "training.grad_clip", "finite", {"training.grad_clip": float("nan")}),
    Case("unknown-section", "trainer", "unknown section", {"trainer.lr": 1.0}),
    # target: model directory
    Case("model-path-missing", "target.model_path", "not a directory", {"target.model_path": "/nonexistent/model"}),
    Case(
        "model-path-no-config",
        "target.model_path",
        "no config.json",
        setup=lambda tmp: {"target.model_path": _model_dir(tmp, config_json=None, weights=True)},
    ),
    Case(
        "model-path-no-weights",
        "target.model_path",
        "safetensors",
        setup=lambda tmp: {"target.model_path": _model_dir(tmp, config_json="{}", weights=False)},
    ),
    Case(
        "model-path-bad-config-json",
        "target.model_path",
        "cannot be read",
        setup=lambda tmp: {"target.model_path": _model_dir(tmp, config_json="{not json", weights=True)},
    ),
    Case(
        "model-path-garbage-weights",
        "target.model_path",
        "is not a safetensors file",
        setup=lambda tmp: {"target.model_path": _model_dir(tmp, config_json=_llama_config_json(), weights=True)},
    ),
    # target: shape against the model's config
    Case("layer-ids-beyond-model", "target.layer_ids", "outside the target's 6 decoder layers", {"target.layer_ids": [1, 50]}),
    Case("capture-100-layers", "target.num_capture_layers", "6-layer target", {"target.num_capture_layers": 100}),
    Case("layer-ids-negative", "target.layer_ids", ">= 0", {"target.layer_ids": [-1, 2]}),
    Case("spec-typo", "target.spec.hidden_sise", "did you mean 'hidden_size'", {"target.spec.hidden_sise": 64}),
    Case("spec-removed-field", "target.spec.rope_theta", "unknown Qwen3_5TextConfig field", {"target.spec.rope_theta": 1e4}),
    Case(
        "spec-heads-vs-kv", "target.spec.num_attention_heads", "multiple of its num_key_value_heads", {"target.spec.num_key_value_heads": 3}
    ),
    Case(
        "spec-linear-heads",
        "target.spec.linear_num_value_heads",
        "multiple of its linear_num_key_heads",
        {"target.spec.linear_num_value_heads": 3},
    ),
    Case("spec-layer-types-length", "target.spec.layer_types", "lists 6 layer types", {"target.spec.num_hidden_layers": 4}),
    Case("spec-wrong-type", "target.spec.hidden_size", "must be an integer (got str '64')", {"target.spec.hidden_size": "64"}),
    Case("tokenizer-missing", "target.tokenizer", 'neither "builtin" nor a local directory', {"target.tokenizer": "/nonexistent/tok"}),
    # drafter against the target
    Case("mask-token-out-of-vocab", "drafter.mask_token_id", "outside the target's vocabulary [0, 1024)", {"drafter.mask_token_id": 5000}),
    Case("mask-token-negative", "drafter.mask_token_id", "-1", {"drafter.mask_token_id": -7}),
    Case(
        "drafter-heads-vs-kv",
        "drafter.num_attention_heads",
        "multiple of drafter.num_key_value_heads",
        {"drafter.num_attention_heads": 6, "drafter.num_key_value_heads": 4},
    ),
    Case(
        "drafter-kv-vs-target-heads",
        "drafter.num_key_value_heads",
        "does not divide the drafter's 4 attention heads",
        {"drafter.num_key_value_heads": 3},
    ),
    # FP8 target: only in bf16, only on CUDA GPUs of capability >= 8.9
    Case("fp8-float32", "target.quantization", 'set target.dtype = "bfloat16"', {"target.quantization": "fp8", "target.dtype": "float32"}),
    Case("fp8-on-cpu", "target.quantization", "compute capability >= 8.9", {"target.quantization": "fp8", "target.dtype": "bfloat16"}),
    Case("drafter-hidden-size", "drafter.hidden_size", "must equal the target's hidden_size (64)", {"drafter.hidden_size": 128}),
    Case("drafter-odd-head-dim", "drafter.head_dim", "even", {"drafter.head_dim": 15}),
    # the world: over tcp every control socket binds run.control_host (192.0.2.1: TEST-NET-1, on no host)
    Case(
        "control-host-not-here",
        "run.control_host",
        "cannot listen on '192.0.2.1' here",
        {"run.control": "tcp", "run.control_host": "192.0.2.1", "transport.backend": "nccl"},
    ),  # target.spec values: every key against Qwen3_5TextConfig, every number finite and in range
    Case("spec-rms-norm-eps-inf", "target.spec.rms_norm_eps", "finite", {"target.spec.rms_norm_eps": float("inf")}),
    Case("spec-rms-norm-eps-negative", "target.spec.rms_norm_eps", "must be in (0, 1)", {"target.spec.rms_norm_eps": -1e-6}),
    Case("spec-initializer-range-nan", "target.spec.initializer_range", "finite", {"target.spec.initializer_range": float("nan")}),
    Case("spec-initializer-range-zero", "target.spec.initializer_range", "must be in (0, 10]", {"target.spec.initializer_range": 0.0}),
    Case(
        "spec-rope-theta-typo",
        "target.spec.rope_parameters.rope_thetaa",
        "did you mean 'rope_theta'",
        {"target.spec.rope_parameters.rope_thetaa": 1e4},
    ),
    Case(
        "spec-rope-theta-negative", "target.spec.rope_parameters.rope_theta", "(0, inf)", {"target.spec.rope_parameters.rope_theta": -1.0}
    ),
    Case(
        "spec-partial-rotary-zero",
        "target.spec.rope_parameters.partial_rotary_factor",
        "(0, 1]",
        {"target.spec.rope_parameters.partial_rotary_factor": 0.0},
    ),
    Case(
        "spec-mrope-nan",
        "target.spec.rope_parameters.mrope_section[2]",
        "finite",
        {"target.spec.rope_parameters.mrope_section": [2, 1, float("nan")]},
    ),
    Case("spec-hidden-size-float", "target.spec.hidden_size", "must be an integer", {"target.spec.hidden_size": 1e9}),
    Case("spec-layers-zero", "target.spec.num_hidden_layers", ">= 1", {"target.spec.num_hidden_layers": 0}),
    Case("spec-positions-int64", "target.spec.max_position_embeddings", "64-bit", {"target.spec.max_position_embeddings": 2**70}),
    Case("spec-head-dim-odd", "target.spec.head_dim", "even", {"target.spec.head_dim": 15}),
    Case("spec-dropout-one", "target.spec.attention_dropout", "[0, 1)", {"target.spec.attention_dropout": 1.0}),
    Case(
        "spec-layer-type-typo",
        "target.spec.layer_types[5]",
        "did you mean 'full_attention'",
        {"target.spec.layer_types": ["linear_attention"] * 5 + ["full_atention"]},
    ),
    Case("spec-activation-unknown", "target.spec.hidden_act", "did you mean 'swish'", {"target.spec.hidden_act": "swish2"}),
    Case("spec-eos-negative", "target.spec.eos_token_id", ">= 0", {"target.spec.eos_token_id": -3}),
    Case("spec-tie-not-bool", "target.spec.tie_word_embeddings", "must be a bool", {"target.spec.tie_word_embeddings": "no"}),
    # resources: what the rings, models and optimizer state need, before spawn (sizes no machine has)
    Case("rings-token-budget", "data.token_budget", "/dev/shm", {"data.token_budget": 2**40}),
    Case("rings-max-batch-size", "data.max_batch_size", "/dev/shm", {"data.max_batch_size": 2**63 - 1}),
    Case("rings-target-hidden-size", "target.spec.hidden_size", "of shared memory in /dev/shm", {"target.spec.hidden_size": 10**9}),
    Case(
        "drafter-layers-host-memory",
        "drafter.num_layers",
        "of host memory",
        {"drafter.num_layers": 1_000_000, "drafter.layer_types": DELETE},
    ),
    Case("drafter-intermediate-host-memory", "drafter.intermediate_size", "of host memory", {"drafter.intermediate_size": 10**9}),
    Case(
        "target-shape-overflows",
        "target.spec",
        "cannot size the target",
        {"target.spec.hidden_size": 2**31, "target.spec.intermediate_size": 2**40},
    ),
    # configs that name no target, integers past 64 bits, missing held-out files
    Case("max-steps-beyond-int64", "training.max_steps", "does not fit a 64-bit integer", {"training.max_steps": 99999999999999999999}),
    Case("samples-beyond-int64", "data.builtin_samples", "64-bit", {"data.builtin_samples": 2**64}),
    Case("holdout-file-missing", "data.holdout_paths[0]", "not found", {"data.holdout_paths": ["/nonexistent/holdout.jsonl"]}),
    Case("no-target-model", "target.spec", "names no target model", {"target.spec": DELETE}),
    # values that would fail only after spawn, run without bound, or be blamed on another key
    Case("attn-flash-on-cpu", "target.attn_implementation", "CUDA", {"target.attn_implementation": "flash_attention_2"}),
    Case(
        "attn-flex-unsupported",
        "target.attn_implementation",
        "no flex_attention attention for qwen3_5_text",
        {"target.attn_implementation": "flex_attention"},
    ),
    Case("drafter-flex-on-cpu", "drafter.attention", "CUDA", {"drafter.attention": "flex"}),
    Case("seed-int64-max", "run.seed", "2**32 - 1", {"run.seed": 2**63 - 1}),
    Case("seed-negative", "run.seed", "2**32 - 1", {"run.seed": -1}),
    Case("synth-seed-int64-max", "synth.seed", "2**32 - 1", {"synth.seed": 2**63 - 1}),
    Case("spec-pad-beyond-vocab", "target.spec.pad_token_id", "outside the target's vocabulary", {"target.spec.pad_token_id": 1_000_000}),
    Case("spec-eos-beyond-vocab", "target.spec.eos_token_id", "outside the target's vocabulary", {"target.spec.eos_token_id": [1, 10**6]}),
    Case("spec-rope-type-bogus", "target.spec.rope_parameters.rope_type", "'default'", {"target.spec.rope_parameters.rope_type": "bogus"}),
    Case("builtin-samples-huge", "data.builtin_samples", "at most 100000", {"data.builtin_samples": 10**12}),
    Case("num-epochs-huge", "data.num_epochs", "at most 1000", {"data.num_epochs": 10**12}),
    Case("drafter-prefetch-huge", "transport.drafter_prefetch", "at most 64", {"transport.drafter_prefetch": 10**9}),
    Case("cache-dir-is-a-file", "data.cache_dir", "not a directory", {"data.cache_dir": "/etc/passwd"}),
    Case("cache-dir-nul", "data.cache_dir", "NUL", {"data.cache_dir": "cache\0x"}),
    Case("random-init-seed-negative", "target.random_init_seed", "[0, 2**32 - 1]", {"target.random_init_seed": -1}),
    Case("cache-dir-cannot-be-made", "data.cache_dir", "cannot be created", {"data.cache_dir": "/proc/nope/x"}),
    Case("builtin-unknown", "data.paths[0]", "builtin:stdlib-docs", {"data.paths": ["builtin:nope"]}),
    Case("builtin-unknown-holdout", "data.holdout_paths[0]", "no built-in corpus", {"data.holdout_paths": ["builtin:nope"]}),
    Case("slot-tokens-huge", "transport.slot_tokens", "/dev/shm", {"transport.slot_tokens": 10**15}),
    Case("spec-vocab-size-ignored", "target.spec.vocab_size", "tokenizer", {"target.spec.vocab_size": 10}),
    Case(
        "data-path-empty-folder",
        "data.paths[0]",
        "neither *.parquet files nor a saved datasets folder",
        setup=lambda tmp: {"data.paths": [str(_empty_dir(tmp))]},
    ),
]


def case_config(tmp_path: Path, case: Case) -> Path:
    patch = dict(case.patch)
    if case.setup is not None:
        patch.update(case.setup(tmp_path))
    return write_toml(tmp_path / f"{case.name}.toml", apply(base_config(), patch))


def test_corpus_is_large_and_base_config_passes(tmp_path):
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)
    cfg, run_dir = validate_for_up(write_toml(tmp_path / "ok.toml", base_config()), str(tmp_path / "run"))
    assert cfg.target.spec["hidden_size"] == 64 and run_dir == tmp_path / "run"
    assert not run_dir.exists()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bad_config_refused_before_spawn(tmp_path, case):
    path = case_config(tmp_path, case)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as ei:
        validate_for_up(path, str(run_dir))
    msg = str(ei.value)
    assert msg.startswith(f"{path}: {case.key}: "), msg
    assert case.fragment in msg, msg
    assert not run_dir.exists()


def test_absent_device_index_named_against_visible_count():
    """cuda:N past the devices visible here, for a host with 2 GPUs (and one with none)."""
    topo = TopologyConfig(targets=["cuda:0"], drafters=["cuda:1", "cuda:2"])
    with pytest.raises(ConfigError, match=r"^f\.toml: topology\.drafters\[1\]: 'cuda:2' but only 2 CUDA device\(s\)"):
        check_devices(topo, 2, "f.toml")
    check_devices(TopologyConfig(targets=["cuda:0"], drafters=["cuda:1"]), 2, "f.toml")
    with pytest.raises(ConfigError, match=r"topology\.targets\[0\]: 'cuda:0' but no CUDA device is visible"):
        check_devices(topo, 0, "f.toml")


def test_spec_typo_would_have_built_a_different_model(tmp_path):
    """Why spec keys are checked: Qwen3_5TextConfig keeps an unknown key and builds its default shape."""
    from dflash_ipc.target_spec.hf_config import make_hf_config

    conf = make_hf_config({"hidden_sise": 64}, vocab_size=1024)
    assert conf.hidden_size != 64  # the typo was ignored, silently


# --------------------------------------------------------------------------- run directory


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_foreign_run_dir_not_chmodded(tmp_path):
    foreign = tmp_path / "work"
    foreign.mkdir(mode=0o755)
    os.chmod(foreign, 0o755)
    (foreign / "notes.txt").write_text("mine")
    path = write_toml(tmp_path / "c.toml", base_config())
    with pytest.raises(ConfigError, match=r": --run-dir: .* not a dflash-ipc run directory"):
        validate_for_up(path, str(foreign))
    assert _mode(foreign) == 0o755 and sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_run_dir_with_checkpoints_needs_resume(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-000001\n")
    os.chmod(run_dir, 0o750)
    path = write_toml(tmp_path / "c.toml", base_config())
    with pytest.raises(ConfigError, match=r": --run-dir: .* already holds checkpoints; pass --resume"):
        validate_for_up(path, str(run_dir))
    assert _mode(run_dir) == 0o750
    # --resume is the way in, and it checks what it would resume from: a `latest` naming no checkpoint is
    # refused, never a silent start from step 0
    with pytest.raises(ConfigError, match=r"--resume: no usable checkpoint .*/latest points at 'step-000001', which does not exist"):
        validate_for_up(path, str(run_dir), resume=True)


def test_run_dir_from_config_named_by_its_key(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    path = write_toml(tmp_path / "c.toml", apply(base_config(), {"run.run_dir": str(not_a_dir)}))
    with pytest.raises(ConfigError, match=r": run\.run_dir: .* not a directory"):
        validate_for_up(path, None)


def test_non_utf8_config_is_a_clear_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(invalid continuation byte at line 2, byte 17\)"):
        validate_for_up(path, str(tmp_path / "run"))


# --------------------------------------------------------------------------- the real CLI


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def run_up(config: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return cli("up", "--config", str(config), "--run-dir", str(run_dir), *extra, cwd=config.parent, env=env)


# Four refused before the probe (the file alone, or a CUDA device where there is none), five by the machine and model checks.
# Those need torch and transformers, which the supervisor never imports: they are refused by its
# probe process (runtime.probe), each loading torch there (seconds on a busy machine; the rest
# run in-process above). The garbage config.json is parsed by transformers in the probe.
PROBE_CASES = {
    "spec-typo",
    "model-path-bad-config-json",
    "spec-rms-norm-eps-inf",
    "drafter-layers-host-memory",
    "fp8-on-cpu",
}
# device-absent: refused by the supervisor without torch on a machine with no NVIDIA device file (else by the probe).
CLI_CASES = [c for c in CASES if c.name in {"run-name-dotdot", "handshake-inf", "max-steps-beyond-int64", "device-absent", *PROBE_CASES}]


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.name)
def test_cli_up_refuses_before_spawn(tmp_path, case):
    path = case_config(tmp_path, case)
    run_dir = tmp_path / "run"
    proc = run_up(path, run_dir, env={**os.environ, "DFLASH_IPC_DEBUG_IMPORTS": "1"})
    assert proc.returncode == 2, proc.stderr
    # after any warning about the file (model-path-*: target.spec is ignored), before the debug line
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {path}: {case.key}: "), proc.stderr
    assert case.fragment in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()  # the supervisor creates it before anything else: nothing was spawned
    if case.name in PROBE_CASES:  # refused by the probe: the supervisor itself never loaded torch
        assert "imported: neither torch nor transformers" in proc.stderr, proc.stderr


def test_cli_up_run_name_dotdot_leaves_working_dir_alone(tmp_path):
    """run.name = ".." without --run-dir: runs/.. is the working directory; it keeps its mode."""
    work = tmp_path / "work"
    work.mkdir()
    os.chmod(work, 0o755)
    path = write_toml(work / "c.toml", apply(base_config(), {"run.name": ".."}))
    proc = cli("up", "--config", str(path), cwd=work)
    assert proc.returncode == 2 and ": run.name: " in proc.stderr, proc.stderr
    assert _mode(work) == 0o755 and not (work / "runs").exists() and not (work / "logs").exists()


def test_cli_up_existing_run_dir_untouched_when_refused(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-000001\n")
    os.chmod(run_dir, 0o755)
    before = sorted(p.name for p in run_dir.iterdir())
    proc = run_up(write_toml(tmp_path / "c.toml", base_config()), run_dir)
    assert proc.returncode == 2 and "--run-dir" in proc.stderr and "--resume" in proc.stderr, proc.stderr
    assert _mode(run_dir) == 0o755
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no logs/, sock/, run_id, config.json


def test_cli_non_utf8_config(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nname = "caf\xe9"\n')
    for cmd in (["up", "--run-dir", str(tmp_path / "run")], ["check-config"]):
        proc = cli(*cmd, "--config", str(path))
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {path}: not UTF-8 text"), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_cli_check_config_checks_the_model(tmp_path):
    path = write_toml(tmp_path / "c.toml", apply(base_config(), {"target.spec.hidden_sise": 64}))
    proc = cli("check-config", "--config", str(path))
    assert proc.returncode == 2 and ": target.spec.hidden_sise: " in proc.stderr, proc.stderr
    file_only = cli("check-config", "--file-only", "--config", str(path))
    assert file_only.returncode == 0 and json.loads(file_only.stdout)["target"]["spec"]["hidden_sise"] == 64, file_only.stderr


def test_attention_implementations_checked_against_what_is_installed():
    """flash_attention_2 where flash_attn does not import (this CPU machine) is refused before spawn; flex_attention
    is refused for a model class transformers has none for (Qwen3.5) and passes for one it has (Llama); sdpa for a
    family transformers runs without it (gpt-oss) is refused and "auto" picks eager there."""
    from transformers import GptOssConfig, LlamaConfig
    from transformers.utils import is_flash_attn_2_available

    from dflash_ipc.families import family_of
    from dflash_ipc.runtime.family_check import check_attn_implementation
    from dflash_ipc.target_spec.hf_config import make_hf_config, tiny_spec

    qwen = family_of(make_hf_config(tiny_spec(512)))
    if not is_flash_attn_2_available():
        with pytest.raises(ConfigError, match=r"^f\.toml: target\.attn_implementation: needs the flash_attn package"):
            check_attn_implementation("f.toml", "flash_attention_2", qwen)
    with pytest.raises(ConfigError, match=r"target\.attn_implementation: transformers has no flex_attention attention for qwen3_5_text"):
        check_attn_implementation("f.toml", "flex_attention", qwen)
    assert check_attn_implementation("f.toml", "flex_attention", family_of(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1)))
    assert check_attn_implementation("f.toml", "sdpa", qwen) == check_attn_implementation("f.toml", "auto", qwen) == "sdpa"
    gpt_oss = family_of(GptOssConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ConfigError, match=r"no sdpa attention for gpt_oss \(it supports eager, flash_attention_2"):
        check_attn_implementation("f.toml", "sdpa", gpt_oss)
    assert check_attn_implementation("f.toml", "auto", gpt_oss) == "eager"
