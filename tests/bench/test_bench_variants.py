"""`bench pipeline` variant names -> config overrides, checked against the real config loader."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.bench import pipeline
from dflash_ipc.bench.pipeline import anchor_budget_figures, variant_overrides
from dflash_ipc.config import load_config


def _load(tmp_path, overrides: dict, **sections):
    return load_config(str(write_toml(tmp_path / "c.toml", tiny_cpu_config(**sections))), overrides)


def test_padded_is_forward_only_without_varlen(tmp_path):
    overrides, fwd = variant_overrides("padded", on_cuda=False)
    cfg = _load(tmp_path, overrides)
    assert fwd == -1 and cfg.target.varlen is False and cfg.transport.backend == "cpu-shm"
    base, _ = variant_overrides("forward-only", on_cuda=False)
    assert _load(tmp_path, base).target.varlen == "auto"
    forced, _ = variant_overrides("varlen", on_cuda=False)
    assert _load(tmp_path, forced).target.varlen is True


def test_warmup_variant_cuts_the_target_to_its_first_four_layers(tmp_path):
    """What the CPU bench test no longer runs as a process group of its own: the target it builds."""
    from dflash_ipc.target_spec.hf_config import load_hf_config, text_config

    full = _load(tmp_path, {})
    cfg = _load(tmp_path, pipeline.warmup_overrides(full))
    assert cfg.target.spec["layer_types"] == full.target.spec["layer_types"][:4] and cfg.target.layer_ids == [1, 3]
    assert int(text_config(load_hf_config(cfg.target, vocab_size=1024)).num_hidden_layers) == 4
    assert {k: v for k, v in cfg.target.spec.items() if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in full.target.spec.items() if k not in ("num_hidden_layers", "layer_types")
    }  # the same widths


@pytest.mark.parametrize("name,slots", [("depth-2", 2), ("depth-8", 8), ("depth-16", 16)])
def test_depth_variant_sets_the_ring_depth_only(tmp_path, name, slots):
    """What the CPU bench test no longer runs as a process group of its own (it cost ~19 s)."""
    overrides, fwd = variant_overrides(name, on_cuda=False)
    cfg, base = _load(tmp_path, overrides), _load(tmp_path, variant_overrides("cuda-ipc", on_cuda=False)[0])
    assert fwd == 0 and cfg.transport.ring_slots == slots and cfg.transport.backend == base.transport.backend == "cpu-shm"
    assert cfg.drafter == base.drafter and cfg.data == base.data


@pytest.mark.parametrize("chunk,cap,expected_chunk", [(0, 2048, 2048), (1024, 2048, 1024), (0, 0, 2048)])
def test_anchors_variant_chunks_by_what_one_forward_held(tmp_path, chunk, cap, expected_chunk):
    overrides, fwd = variant_overrides("anchors-6144", on_cuda=True, anchor_chunk=chunk, max_anchors=cap)
    assert fwd == 0 and overrides["transport.backend"] == "cuda-ipc"
    cfg = _load(tmp_path, {k: v for k, v in overrides.items() if k != "transport.backend"})
    assert cfg.drafter.max_anchors_per_batch == 6144 and cfg.drafter.anchor_chunk == expected_chunk


@pytest.mark.parametrize("chunk,cap,start", [(0, 2048, 2048), (1024, 0, 1024), (0, 0, 2048)])
def test_anchors_auto_follows_the_wait_from_the_configured_cap(tmp_path, chunk, cap, start):
    overrides, fwd = variant_overrides("anchors-auto", on_cuda=True, anchor_chunk=chunk, max_anchors=cap)
    assert fwd == 0 and overrides["transport.backend"] == "cuda-ipc"
    cfg = _load(tmp_path, {k: v for k, v in overrides.items() if k != "transport.backend"})
    d = cfg.drafter
    assert d.anchor_budget == "follow-wait" and d.max_anchors_per_batch == start and d.anchor_chunk == (chunk or cap or 2048)
    assert d.resolved_max_anchors_auto() == 8 * start


def test_anchor_budget_figures_report_the_final_count_and_the_wait_there():
    def rec(step, anchors, wait_s):
        return {"step": step, "anchors": anchors, "wait_s": wait_s, "step_s": 1.0}

    recs = [rec(1, 2048, 5.0), rec(2, 2048, 3.0), rec(3, 4096, 9.0), rec(4, 4096, 1.0), rec(5, 4096, 0.0), rec(6, 4096, 0.5)]
    got = anchor_budget_figures(recs)
    # at 4096: steps 4..6 (step 3 may still drain 2048's backlog): 1.5 s waiting in 4.5 s
    assert got == {
        "anchors_final": 4096,
        "anchor_moves": [[1, 2048], [3, 4096]],
        "steps_at_final_anchors": 3,
        "drafter_wait_pct_at_final_anchors": 33.33,
    }
    assert anchor_budget_figures(recs[:1])["drafter_wait_pct_at_final_anchors"] is None


def test_target_modifiers_compose_with_any_variant(tmp_path):
    """forward-only+fp8+eager: the ceiling's overrides plus the target's precision and kernels; the
    config loader takes them (FP8 wants bf16, so the target's dtype is set here as a user would)."""
    overrides, fwd = variant_overrides("forward-only+fp8+eager", on_cuda=False)
    base, base_fwd = variant_overrides("forward-only", on_cuda=False)
    assert fwd == base_fwd == -1
    assert overrides == base | {"target.quantization": "fp8", "target.fuse_elementwise": False}
    cfg = _load(tmp_path, overrides, target={"dtype": "bfloat16"})
    assert cfg.target.quantization == "fp8" and cfg.target.fuse_elementwise is False
    fused, _ = variant_overrides("depth-2+fused", on_cuda=False)
    assert _load(tmp_path, fused).transport.ring_slots == 2 and _load(tmp_path, fused).target.fuse_elementwise is True
    with pytest.raises(ValueError, match=r"unknown modifier 'int4'.*\+fp8"):
        variant_overrides("cuda-ipc+int4", on_cuda=False)


@pytest.mark.parametrize("name", ["anchors-", "anchors-x", "depth-0", "bogus"])
def test_bad_variant_names_are_refused_with_the_valid_forms(name):
    with pytest.raises(ValueError, match="depth-8|anchors-N|variant"):
        variant_overrides(name, on_cuda=False)


def _measured(name: str, exit_code: int, tokens_per_s: float) -> dict:
    """The figures ``run_variant`` reports that the summary reads (the rest of its dict left out)."""
    return {
        "variant": name,
        "exit_code": exit_code,
        "run_dir": f"/tmp/dflash-bench-{name}",
        "tokens_per_s": tokens_per_s,
        "steady_tokens_per_s": tokens_per_s,
        "target_tokens_per_s": tokens_per_s,
        "drafter_busy_tokens_per_s_per_gpu": 2 * tokens_per_s,
    }


@pytest.mark.parametrize("cuda_ipc_exit", [0, 1])
def test_a_variant_whose_up_failed_enters_no_ratio_and_no_topology(tmp_path, monkeypatch, cuda_ipc_exit):
    """On one H200 an OOMed drafter's `up` (exit 1 after one step) once became the topology advice's
    drafter rate and a 0.02 pipeline ratio; a failed run is reported as failed and measures nothing."""
    config = str(write_toml(tmp_path / "c.toml", tiny_cpu_config()))
    rates = {"forward-only": (0, 1000.0), "cuda-ipc": (cuda_ipc_exit, 900.0), "anchors-auto": (0, 880.0)}
    monkeypatch.setattr(pipeline, "run_variant", lambda _config, name, *_: _measured(name, *rates[name]))
    lines: list[str] = []
    summary = pipeline.run_pipeline_bench(config, 4, list(rates), echo=lines.append)
    if cuda_ipc_exit:
        assert summary["failed_variants"] == ["cuda-ipc"]
        assert "dflash-ipc up exited with code 1" in summary["variants"]["cuda-ipc"]["error"]
        assert any(line.startswith("[bench pipeline] cuda-ipc FAILED") for line in lines)
        assert not {"ratio_pipeline_to_forward_only", "topology", "profile", "ratio_anchors-auto_to_cuda_ipc"} & summary.keys()
    else:
        assert "failed_variants" not in summary
        assert summary["ratio_pipeline_to_forward_only"] == 0.9 and summary["ratio_anchors-auto_to_cuda_ipc"] == round(880 / 900, 4)
        assert summary["profile"]["drafter_tokens_per_s"] == 1800.0 and summary["topology"]


def test_each_pipeline_is_compared_with_the_ceiling_of_its_own_target_modifiers(tmp_path, monkeypatch):
    """cuda-ipc+fp8 against forward-only+fp8, cuda-ipc+eager against forward-only+eager: never across
    precisions; a pipeline variant without its ceiling gets no ratio."""
    config = str(write_toml(tmp_path / "c.toml", tiny_cpu_config()))
    rates = {"forward-only+fp8": 2000.0, "cuda-ipc+fp8": 1200.0, "cuda-ipc+eager": 800.0, "forward-only": 1000.0, "cuda-ipc": 900.0}
    monkeypatch.setattr(pipeline, "run_variant", lambda _config, name, *_: _measured(name, 0, rates[name]))
    summary = pipeline.run_pipeline_bench(config, 4, list(rates), echo=lambda _: None)
    assert summary["ratio_pipeline_to_forward_only"] == 0.9 and summary["ratio_pipeline_to_forward_only+fp8"] == 0.6
    assert summary["ratio_pipeline_to_forward_only_steady+fp8"] == 0.6
    assert not any(k.endswith("+eager") for k in summary)


def test_the_variants_fork_server_serves_forking_configs_only_and_a_failed_start_leaves_each_variant_its_own(tmp_path, monkeypatch):
    """bench pipeline's one fork server for all variants (test_bench_pipeline runs it): a config whose `up`
    execs gets no connection; a server that cannot start is said once, not tried again, and every variant
    then starts its own (``client`` answers None: the supervisor's run.launcher decides)."""
    lines: list[str] = []
    shared = pipeline.VariantsForkServer(lines.append)
    assert shared.client(_load(tmp_path, {"run.launcher": "exec"})) is None and lines == []
    tried: list[str] = []

    def refuse(preload, env=None, timeout_s=0.0, listen=None):
        tried.append(listen)
        raise RuntimeError("the fork server (python -m dflash_ipc.runtime.forkserver) ended or was not ready within 1 s")

    monkeypatch.setattr(pipeline.ForkServer, "start", refuse)
    forking = _load(tmp_path, {})
    assert forking.run.launcher == "auto" and not forking.topology.on_cuda
    assert shared.client(forking) is None and shared.client(forking) is None
    assert len(tried) == 1 and lines == [
        "[bench pipeline] no fork server shared by the variants (the fork server (python -m dflash_ipc.runtime.forkserver) "
        "ended or was not ready within 1 s): each starts its own"
    ]
    shared.close()
    assert not Path(tried[0]).parent.exists()  # its private directory goes with it
