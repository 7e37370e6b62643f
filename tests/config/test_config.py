"""Typed TOML config: every error names the file and the dotted key; valid files load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import toml_text

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

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


def write(tmp_path: Path, content: str | dict, name: str = "run.toml") -> Path:
    """A config file from a dict (tests/conftest.py's writer) or, for syntax cases, raw TOML text."""
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else toml_text(content))
    return p


def load_error(path: Path, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: "), msg  # the file is always named first
    return msg


# --------------------------------------------------------------------------- valid files


VALID = {
    "run": {"name": "t", "handshake_timeout_s": 30},  # an int where a float is expected is fine
    "topology": {"targets": ["cpu", "cpu"], "drafters": ["cpu"]},
    "transport": {"backend": "cpu-shm", "ring_slots": 6, "max_outstanding_per_drafter": 2},
    "data": {"max_seq_len": 512, "bucket_edges": [64, 128, 512], "token_budget": 1024},
    "training": {"kl_weight": 0.5},
    "target": {"capture_last_hidden": True},
}


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


def test_the_repository_ships_configs():
    assert CONFIG_FILES, "no configs/*.toml in the repository"


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
    "data, key, fragment",
    [
        ({"transport": {"ring_slots": "4"}}, "transport.ring_slots", "must be an integer"),
        ({"transport": {"ring_slots": 4.0}}, "transport.ring_slots", "must be an integer"),
        ({"transport": {"ring_slots": True}}, "transport.ring_slots", "must be an integer"),
        ({"run": {"handshake_timeout_s": "slow"}}, "run.handshake_timeout_s", "must be a number"),
        ({"run": {"handshake_timeout_s": False}}, "run.handshake_timeout_s", "must be a number"),
        ({"target": {"capture_last_hidden": 1}}, "target.capture_last_hidden", "true or false"),
        ({"topology": {"targets": "cpu"}}, "topology.targets", "must be a list"),
        ({"topology": {"targets": ["cpu", 3]}}, "topology.targets[1]", "must be a string"),
        ({"transport": {"backend": "shm"}}, "transport.backend", "must be one of"),
        ({"target": {"spec": 3}}, "target.spec", "must be a table"),
        ({"drafter": {"num_layers": 2, "layer_types": ["sliding_attention", "global"]}}, "drafter.layer_types[1]", "must be one of"),
    ],
)
def test_wrong_type_names_dotted_key(tmp_path, data, key, fragment):
    msg = load_error(write(tmp_path, data))
    assert f": {key}: " in msg, msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        ({"transport": {"ring_slots": 1}}, "transport.ring_slots", "must be >= 2 (got 1)"),
        ({"transport": {"ring_slots": 65}}, "transport.ring_slots", "<= 64"),
        ({"transport": {"max_outstanding_per_drafter": 0}}, "transport.max_outstanding_per_drafter", ">= 1"),
        ({"run": {"handshake_timeout_s": 0}}, "run.handshake_timeout_s", "> 0"),
        ({"run": {"handshake_timeout_s": float("nan")}}, "run.handshake_timeout_s", "finite"),
        ({"run": {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 2}}, "run.heartbeat_timeout_s", "3x"),
        ({"run": {"heartbeat_timeout_s": 60, "stall_timeout_s": 5}}, "run.stall_timeout_s", "between heartbeat_timeout_s"),
        ({"run": {"stall_timeout_s": float("inf")}}, "run.stall_timeout_s", "finite"),
        ({"run": {"name": "a/b"}}, "run.name", "without '/'"),
        ({"run": {"metrics_port": 65536}}, "run.metrics_port", "TCP port"),
        ({"run": {"metrics_port": -1}}, "run.metrics_port", "or 0 for no /metrics"),
        ({"topology": {"targets": ["gpu0"]}}, "topology.targets[0]", "not a device"),
        ({"topology": {"drafters": []}}, "topology.drafters", "at least one"),
        ({"training": {"lr": float("inf")}}, "training.lr", "finite"),
        ({"training": {"betas": [0.9]}}, "training.betas", "two numbers"),
        ({"drafter": {"block_size": 1}}, "drafter.block_size", "between 2 and 64"),
        (
            {"data": {"max_seq_len": 512, "bucket_edges": [64, 128, 256], "token_budget": 1024}},
            "data.bucket_edges",
            "last edge must equal data.max_seq_len",
        ),
        ({"data": {"max_seq_len": 512, "bucket_edges": [128, 64, 512], "token_budget": 1024}}, "data.bucket_edges", "strictly increasing"),
        ({"data": {"max_seq_len": 512, "bucket_edges": [64, 512], "token_budget": 256}}, "data.token_budget", "data.max_seq_len"),
    ],
)
def test_impossible_value_names_dotted_key(tmp_path, data, key, fragment):
    msg = load_error(write(tmp_path, data))
    assert f": {key}: " in msg, msg
    assert fragment in msg, msg


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        # cpu shared memory cannot serve processes on GPUs
        (
            {"topology": {"targets": ["cuda:0"], "drafters": ["cuda:1"]}, "transport": {"backend": "cpu-shm"}},
            "transport.backend",
            "cpu-shm needs cpu devices",
        ),
        ({"transport": {"backend": "cuda-ipc"}}, "transport.backend", "needs cuda devices"),
        ({"transport": {"backend": "host-pinned"}}, "transport.backend", "needs cuda devices"),
        ({"training": {"kl_weight": 0.1}}, "training.kl_weight", "target.capture_last_hidden"),
        ({"topology": {"targets": ["cuda:0"], "drafters": ["cpu"]}}, "topology.targets", "mixing cpu and cuda"),
        ({"topology": {"dist_backend": "nccl"}}, "topology.dist_backend", "nccl needs every drafter on a cuda device"),
        ({"drafter": {"num_layers": 3, "layer_types": ["full_attention"]}}, "drafter.layer_types", "exactly drafter.num_layers"),
        # a TCP control plane is only for the off-host (nccl) transport
        ({"run": {"control": "tcp"}}, "run.control", 'set transport.backend = "nccl"'),
        ({"run": {"control": "tcp", "control_host": "0.0.0.0"}, "transport": {"backend": "nccl"}}, "run.control_host", "wildcard"),
        ({"run": {"control_host": "host name"}}, "run.control_host", "one address or host name"),
        ({"run": {"control": "udp"}}, "run.control", "must be one of 'ipc', 'tcp'"),
        # the follow-wait anchor budget starts at max_anchors_per_batch and moves by anchor_chunk
        ({"drafter": {"anchor_budget": "follow-wait", "max_anchors_per_batch": 2048}}, "drafter.anchor_budget", "drafter.anchor_chunk > 0"),
        ({"drafter": {"anchor_budget": "follow-wait", "anchor_chunk": 2048}}, "drafter.anchor_budget", "drafter.max_anchors_per_batch"),
        (
            {"drafter": {"anchor_budget": "follow-wait", "anchor_chunk": 2048, "max_anchors_per_batch": 2048, "max_anchors_auto": 5000}},
            "drafter.max_anchors_auto",
            "multiple of drafter.anchor_chunk (2048)",
        ),
        (
            {"drafter": {"anchor_budget": "follow-wait", "anchor_chunk": 1024, "max_anchors_per_batch": 4096, "max_anchors_auto": 2048}},
            "drafter.max_anchors_auto",
            ">= drafter.max_anchors_per_batch (4096)",
        ),
        ({"drafter": {"anchor_target_wait": 1.5}}, "drafter.anchor_target_wait", "fraction between 0 and 1"),
        ({"drafter": {"anchor_window": 0}}, "drafter.anchor_window", ">= 1 step"),
        ({"drafter": {"anchor_budget": "auto"}}, "drafter.anchor_budget", "'fixed', 'follow-wait'"),
    ],
)
def test_impossible_combination_names_dotted_key(tmp_path, data, key, fragment):
    msg = load_error(write(tmp_path, data))
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


def test_nccl_transport_and_tcp_control_load_on_cpu(tmp_path):
    """nccl is valid on CPU (gloo carries it) and is never what "auto" resolves to."""
    cfg = load_config(write(tmp_path, {"transport": {"backend": "nccl"}, "run": {"control": "tcp", "control_host": "10.0.0.5"}}))
    assert cfg.transport.backend == "nccl" and cfg.resolved_backend() == "nccl"
    assert cfg.run.control == "tcp" and cfg.run.control_host == "10.0.0.5"
    assert load_config(write(tmp_path, {}, name="d.toml")).resolved_backend() == "cpu-shm"


def test_follow_wait_cap_defaults_to_eight_times_the_start(tmp_path):
    drafter = {"anchor_budget": "follow-wait", "anchor_chunk": 512, "max_anchors_per_batch": 1024}
    assert load_config(write(tmp_path, {"drafter": drafter})).drafter.resolved_max_anchors_auto() == 8192
    drafter["max_anchors_auto"] = 4096
    assert load_config(write(tmp_path, {"drafter": drafter})).drafter.resolved_max_anchors_auto() == 4096
