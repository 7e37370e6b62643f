"""The streaming safetensors writer, read back by the safetensors library itself."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_ipc.drafter.checkpoint.safetensors_stream import write_safetensors


def test_round_trip_every_dtype_and_shape_through_the_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=g)
    tensors = {
        "w.bf16": base.to(torch.bfloat16),
        "w.f16": base.to(torch.float16),
        "w.f32": base,
        "w.f64": base.double(),
        "i64": torch.arange(11),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
        "u8": torch.arange(256, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "view": base[:, 1],  # non-contiguous, shares storage with "w.f32"
        "alias": base,  # the same storage again: written as its own copy
    }
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "step": "7"}, slice_bytes=24)  # many slices per tensor
    back = load_file(str(path))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_cast_on_write_and_refusal_of_an_unnamed_dtype(tmp_path):
    x = torch.randn(3, 4, dtype=torch.float32)
    write_safetensors(tmp_path / "a.safetensors", {"x": x}, dtype=torch.bfloat16)
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["x"], x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "b.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})


@pytest.mark.gpu
def test_streams_cuda_tensors_through_one_host_buffer(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = {"a": torch.randn(1000, 333, device="cuda").to(torch.bfloat16), "b": torch.arange(10**6, device="cuda")}
    write_safetensors(tmp_path / "g.safetensors", t, slice_bytes=1 << 16)
    back = load_file(str(tmp_path / "g.safetensors"))
    assert all(torch.equal(back[k], v.cpu()) for k, v in t.items())
