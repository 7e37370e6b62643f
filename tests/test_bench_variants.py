"""`bench pipeline` variant names -> config overrides, checked against the real config loader."""

from __future__ import annotations

import pytest
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.bench.pipeline import variant_overrides
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


@pytest.mark.parametrize("chunk,cap,expected_chunk", [(0, 2048, 2048), (1024, 2048, 1024), (0, 0, 2048)])
def test_anchors_variant_chunks_by_what_one_forward_held(tmp_path, chunk, cap, expected_chunk):
    overrides, fwd = variant_overrides("anchors-6144", on_cuda=True, anchor_chunk=chunk, max_anchors=cap)
    assert fwd == 0 and overrides["transport.backend"] == "cuda-ipc"
    cfg = _load(tmp_path, {k: v for k, v in overrides.items() if k != "transport.backend"})
    assert cfg.drafter.max_anchors_per_batch == 6144 and cfg.drafter.anchor_chunk == expected_chunk


@pytest.mark.parametrize("name", ["anchors-", "anchors-x", "depth-0", "bogus"])
def test_bad_variant_names_are_refused_with_the_valid_forms(name):
    with pytest.raises(ValueError, match="depth-8|anchors-N|variant"):
        variant_overrides(name, on_cuda=False)
