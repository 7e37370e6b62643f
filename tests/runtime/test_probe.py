"""The probe process (runtime.probe): its answer is typed, a refusal comes back as the same error,
and a probe that crashes or hangs is named with its stderr. The real refusals through `up` (a
cuda device on this CPU host, a garbage config.json) are in faults/test_bad_configs.py, the
lean supervisor of a whole run in test_up.py (test_full_run_trains_checkpoints_and_exports)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import write_toml

from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.control.protocol import ProtocolError, from_wire, to_wire
from dflash_ipc.runtime.forkserver import ForkServer
from dflash_ipc.runtime.launch import child_env
from dflash_ipc.runtime.preflight import check_machine
from dflash_ipc.runtime.probe import ProbeError, ProbeFailed, ProbeResult, check_and_plan, run_isolated, run_probe

REPO = Path(__file__).resolve().parents[2]
PROBE = [sys.executable, "-m", "dflash_ipc.runtime.probe"]


def tiny_cfg(tmp_path: Path, **patch):
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    raw["data"].update(builtin_samples=100, max_seq_len=256, bucket_edges=[64, 128, 256], token_budget=1024)
    for dotted, value in patch.items():
        section, key = dotted.split(".")
        raw[section][key] = value
    return load_config(write_toml(tmp_path / "c.toml", raw))


def wire_round_trip(result: ProbeResult) -> ProbeResult:
    """What the probe prints and the supervisor reads back."""
    return from_wire(ProbeResult, json.loads(json.dumps(to_wire(result))))


def test_refusal_comes_back_as_the_same_error(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"drafter.mask_token_id": 5000})
    with pytest.raises(ConfigError) as ei:
        check_machine(cfg)
    sent = ProbeError.of(ei.value)
    assert (sent.kind, sent.file, sent.key) == ("config", cfg.source, "drafter.mask_token_id")
    back = wire_round_trip(ProbeResult(error=sent)).error.exception()
    assert type(back) is ConfigError and str(back) == str(ei.value)
    assert (back.source, back.key, back.detail) == (ei.value.source, ei.value.key, ei.value.detail)
    for err in (ConfigError("f.toml: not valid TOML: x"), ValueError("data.jsonl:3: bad"), OSError("disk full")):
        again = wire_round_trip(ProbeResult(error=ProbeError.of(err))).error.exception()
        assert type(again) is type(err) and str(again) == str(err)


def test_answer_is_validated():
    with pytest.raises(ProtocolError, match=r"ProbeResult\.error: kind must be one of"):
        from_wire(ProbeResult, {"error": {"kind": "oops", "message": "m"}})
    with pytest.raises(ProtocolError, match="plan or an error"):
        from_wire(ProbeResult, to_wire(ProbeResult(error=ProbeError("os", "x"))) | {"plan": to_wire(_plan())})
    with pytest.raises(ProtocolError, match=r"n_batches_per_shard"):
        from_wire(ProbeResult, {"plan": to_wire(_plan()) | {"n_batches_per_shard": "3"}})


def _plan():
    from dflash_ipc.runtime.probe import DataPlan

    return DataPlan(3, [1, 2], 10, "10 samples", 0.1)


def test_in_process_plan_makes_the_run_dir_private(tmp_path):
    """torch is loaded here: run_probe runs in-process (no second torch import), same function as the probe."""
    cfg = tiny_cfg(tmp_path)
    run_dir = tmp_path / "run"
    plan = run_probe(cfg, run_dir, 2)
    assert plan.n_batches_total == sum(plan.n_batches_per_shard) > 0 and len(plan.n_batches_per_shard) == 2
    assert plan.summary.startswith(f"{plan.samples} samples")
    assert (run_dir / "data").stat().st_mode & 0o777 == 0o700 and run_dir.stat().st_mode & 0o777 == 0o700
    assert check_and_plan(cfg, None, 0) is None and sorted(p.name for p in run_dir.iterdir()) == ["data"]


def test_crashed_probe_is_named_with_its_stderr(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ProbeFailed) as ei:
        run_isolated([*PROBE, "--config", str(missing)], timeout_s=120)
    msg = str(ei.value)
    assert "the config probe" in msg and "ended (exit code 1) without an answer" in msg, msg
    assert "FileNotFoundError" in msg and str(missing) in msg, msg


def test_a_probe_forked_from_the_fork_server_answers_as_in_process_and_a_crash_keeps_its_stderr(tmp_path, shared_forkserver):
    """run.launcher = forkserver (the CPU default of `up`): the probe's stdout and stderr are pipes
    handed to the forked child; its answer and a crash's message are those of a new Python's. The
    server is the worker's shared one (its preload holds the probe's modules) where there is one."""
    cfg = tiny_cfg(tmp_path)
    probe_module = ["dflash_ipc.runtime.probe"]
    server = ForkServer.connect(shared_forkserver, child_env(), probe_module) if shared_forkserver else ForkServer.start(probe_module)
    try:
        forked = run_probe(cfg, tmp_path / "forked", 2, isolate=True, launcher=server)
        missing = tmp_path / "nowhere" / "config.json"
        with pytest.raises(ProbeFailed) as ei:
            run_isolated([*PROBE, "--config", str(missing)], 120, server)
    finally:
        server.close()
    here = run_probe(cfg, tmp_path / "here", 2, isolate=False)
    assert (forked.n_batches_per_shard, forked.samples, forked.summary) == (here.n_batches_per_shard, here.samples, here.summary)
    assert (tmp_path / "forked" / "data").stat().st_mode & 0o777 == 0o700
    msg = str(ei.value)
    assert "ended (exit code 1) without an answer" in msg and "FileNotFoundError" in msg and str(missing) in msg, msg


def test_probe_that_does_not_answer_in_time_is_killed(tmp_path):
    # 0.3 s: far less than importing torch and transformers takes (seconds), which it does first
    cfg = tiny_cfg(tmp_path)
    with pytest.raises(ProbeFailed, match=r"gave no answer within 0\.3 s and was killed"):
        run_probe(cfg, tmp_path / "run", 2, isolate=True, timeout_s=0.3)
    assert not (tmp_path / "run").exists()
