"""Typed TOML config: every error names the file and the dotted key; valid files load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_ipc.config import (
    ConfigError,
    DataConfig,
    DFlashConfig,
    RunConfig,
    TargetConfig,
    TopologyConfig,
    TrainingConfig,
    TransportConfig,
    load_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def load_error(path: Path, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: "), msg  # the file is always named first
    return msg


# --------------------------------------------------------------------------- valid files


VALID = """
[run]
name = "t"
handshake_timeout_s = 30        # an int where a float is expected is fine

[topology]
targets = ["cpu", "cpu"]
drafters = ["cpu"]

[transport]
backend = "cpu-shm"
ring_slots = 6
max_outstanding_per_drafter = 2

[data]
max_seq_len = 512
bucket_edges = [64, 128, 512]
token_budget = 1024

[training]
kl_weight = 0.5

[target]
capture_last_hidden = true
"""


def test_valid_file_loads_into_dataclasses(tmp_path):
    path = write(tmp_path, VALID)
    cfg = load_config(path)
    assert isinstance(cfg, DFlashConfig)
    assert isinstance(cfg.run, RunConfig) and isinstance(cfg.topology, TopologyConfig)
    assert isinstance(cfg.transport, TransportConfig) and isinstance(cfg.data, DataConfig)
    assert isinstance(cfg.target, TargetConfig) and isinstance(cfg.training, TrainingConfig)
    assert cfg.source == str(path)
    assert cfg.run.name == "t"
    assert cfg.run.handshake_timeout_s == 30.0 and isinstance(cfg.run.handshake_timeout_s, float)
    assert cfg.topology.targets == ["cpu", "cpu"] and cfg.topology.drafters == ["cpu"]
    assert cfg.transport.backend == "cpu-shm" and cfg.transport.ring_slots == 6
    assert cfg.transport.max_outstanding_per_drafter == 2
    assert cfg.data.bucket_edges == [64, 128, 512] and cfg.data.max_seq_len == 512
    assert cfg.training.kl_weight == 0.5 and cfg.target.capture_last_hidden is True
    # untouched sections keep their defaults
    assert cfg.drafter.num_layers == 5
    assert cfg.resolved_backend() == "cpu-shm"
    assert cfg.topology.resolved_dist_backend() == "gloo"
    assert cfg.ignored_value_warnings() == []
    assert "source" not in cfg.to_dict() and cfg.to_dict()["transport"]["ring_slots"] == 6


def test_empty_file_is_all_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert cfg.transport == TransportConfig() and cfg.data == DataConfig()


def test_overrides_are_validated_with_their_key(tmp_path):
    path = write(tmp_path, VALID)
    assert load_config(path, overrides={"transport.ring_slots": 8}).transport.ring_slots == 8
    msg = load_error(path, overrides={"transport.ring_slots": 1})
    assert "transport.ring_slots" in msg


@pytest.mark.skipif(not CONFIG_FILES, reason="no configs/*.toml in the repository")
@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert isinstance(cfg.ignored_value_warnings(), list)


# --------------------------------------------------------------------------- file-level errors


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    msg = load_error(path)
    assert "not found" in msg


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[transport]\nring_slots = = 4\n")
    msg = load_error(path)
    assert "not valid TOML" in msg


def test_unknown_section_with_suggestion(tmp_path):
    msg = load_error(write(tmp_path, "[transprot]\nring_slots = 4\n"))
    assert "transprot" in msg and "unknown section" in msg and "'transport'" in msg


def test_section_must_be_a_table(tmp_path):
    msg = load_error(write(tmp_path, "run = 3\n"))
    assert ": run: " in msg and "table" in msg


# --------------------------------------------------------------------------- key-level errors


def test_unknown_key_with_suggestion(tmp_path):
    msg = load_error(write(tmp_path, "[transport]\nring_slot = 4\n"))
    assert ": transport.ring_slot: unknown key" in msg
    assert "did you mean 'ring_slots'?" in msg


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    msg = load_error(write(tmp_path, "[run]\nzzzzqqqq = 1\n"))
    assert ": run.zzzzqqqq: unknown key" in msg
    assert "did you mean" not in msg and "handshake_timeout_s" in msg


@pytest.mark.parametrize(
    "toml, key, fragment",
    [
        ('[transport]\nring_slots = "4"\n', "transport.ring_slots", "must be an integer"),
        ("[transport]\nring_slots = 4.0\n", "transport.ring_slots", "must be an integer"),
        ("[transport]\nring_slots = true\n", "transport.ring_slots", "must be an integer"),
        ('[run]\nhandshake_timeout_s = "slow"\n', "run.handshake_timeout_s", "must be a number"),
        ("[run]\nhandshake_timeout_s = false\n", "run.handshake_timeout_s", "must be a number"),
        ("[target]\ncapture_last_hidden = 1\n", "target.capture_last_hidden", "true or false"),
        ('[topology]\ntargets = "cpu"\n', "topology.targets", "must be a list"),
        ('[topology]\ntargets = ["cpu", 3]\n', "topology.targets[1]", "must be a string"),
        ('[transport]\nbackend = "shm"\n', "transport.backend", "must be one of"),
        ("[target]\nspec = 3\n", "target.spec", "must be a table"),
        ('[drafter]\nnum_layers = 2\nlayer_types = ["sliding_attention", "global"]\n', "drafter.layer_types[1]", "must be one of"),
    ],
)
def test_wrong_type_names_dotted_key(tmp_path, toml, key, fragment):
    msg = load_error(write(tmp_path, toml))
    assert f": {key}: " in msg, msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "toml, key, fragment",
    [
        ("[transport]\nring_slots = 1\n", "transport.ring_slots", "must be >= 2 (got 1)"),
        ("[transport]\nring_slots = 65\n", "transport.ring_slots", "<= 64"),
        ("[transport]\nmax_outstanding_per_drafter = 0\n", "transport.max_outstanding_per_drafter", ">= 1"),
        ("[run]\nhandshake_timeout_s = 0\n", "run.handshake_timeout_s", "> 0"),
        ("[run]\nhandshake_timeout_s = nan\n", "run.handshake_timeout_s", "finite"),
        ("[run]\nheartbeat_interval_s = 1\nheartbeat_timeout_s = 2\n", "run.heartbeat_timeout_s", "3x"),
        ('[run]\nname = "a/b"\n', "run.name", "without '/'"),
        ('[topology]\ntargets = ["gpu0"]\n', "topology.targets[0]", "not a device"),
        ("[topology]\ndrafters = []\n", "topology.drafters", "at least one"),
        ("[training]\nlr = inf\n", "training.lr", "finite"),
        ("[training]\nbetas = [0.9]\n", "training.betas", "two numbers"),
        ("[drafter]\nblock_size = 1\n", "drafter.block_size", "between 2 and 64"),
        ("[data]\nmax_seq_len = 512\nbucket_edges = [64, 128, 256]\ntoken_budget = 1024\n", "data.bucket_edges", "last edge must equal data.max_seq_len"),
        ("[data]\nmax_seq_len = 512\nbucket_edges = [128, 64, 512]\ntoken_budget = 1024\n", "data.bucket_edges", "strictly increasing"),
        ("[data]\nmax_seq_len = 512\nbucket_edges = [64, 512]\ntoken_budget = 256\n", "data.token_budget", "data.max_seq_len"),
    ],
)
def test_impossible_value_names_dotted_key(tmp_path, toml, key, fragment):
    msg = load_error(write(tmp_path, toml))
    assert f": {key}: " in msg, msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "toml, key, fragment",
    [
        # cpu shared memory cannot serve processes on GPUs
        ('[topology]\ntargets = ["cuda:0"]\ndrafters = ["cuda:1"]\n[transport]\nbackend = "cpu-shm"\n', "transport.backend", "cpu-shm needs cpu devices"),
        ('[transport]\nbackend = "cuda-ipc"\n', "transport.backend", "needs cuda devices"),
        ('[transport]\nbackend = "host-pinned"\n', "transport.backend", "needs cuda devices"),
        ("[training]\nkl_weight = 0.1\n", "training.kl_weight", "target.capture_last_hidden"),
        ('[topology]\ntargets = ["cuda:0"]\ndrafters = ["cpu"]\n', "topology.targets", "mixing cpu and cuda"),
        ('[topology]\ndist_backend = "nccl"\n', "topology.dist_backend", "nccl needs every drafter on a cuda device"),
        ('[drafter]\nnum_layers = 3\nlayer_types = ["full_attention"]\n', "drafter.layer_types", "exactly drafter.num_layers"),
    ],
)
def test_impossible_combination_names_dotted_key(tmp_path, toml, key, fragment):
    msg = load_error(write(tmp_path, toml))
    assert f": {key}: " in msg, msg
    assert fragment in msg, msg


def test_error_message_shape(tmp_path):
    path = write(tmp_path, "[transport]\nring_slots = 1\n", name="x.toml")
    msg = load_error(path)
    assert re.fullmatch(re.escape(f"{path}: transport.ring_slots: ") + r"must be >= 2 \(got 1\).*", msg), msg


# --------------------------------------------------------------------------- warnings


def test_ignored_value_warnings(tmp_path):
    path = write(
        tmp_path,
        '[target]\nmodel_path = "/models/x"\ncapture_last_hidden = true\n[target.spec]\nhidden_size = 64\n'
        '[data]\npaths = ["a.jsonl"]\nbuiltin_samples = 10\n',
    )
    cfg = load_config(path)
    warnings = cfg.ignored_value_warnings()
    assert any("target.spec" in w and "target.model_path" in w for w in warnings), warnings
    assert any("capture_last_hidden" in w for w in warnings), warnings
    assert any("data.builtin_samples" in w for w in warnings), warnings
    assert cfg.target.spec == {"hidden_size": 64}


def test_no_spec_warning_without_model_path(tmp_path):
    cfg = load_config(write(tmp_path, "[target.spec]\nhidden_size = 64\n"))
    assert not any("target.spec" in w for w in cfg.ignored_value_warnings())
