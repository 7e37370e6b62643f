"""`bench pipeline` variant names -> config overrides, checked against the real config loader."""

from __future__ import annotations

import pytest
from conftest import tiny_cpu_config, write_toml

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


@pytest.mark.parametrize("name", ["anchors-", "anchors-x", "depth-0", "bogus"])
def test_bad_variant_names_are_refused_with_the_valid_forms(name):
    with pytest.raises(ValueError, match="depth-8|anchors-N|variant"):
        variant_overrides(name, on_cuda=False)
