"""Write a safetensors file one slice at a time, so host memory stays bounded.

``safetensors.torch.save_file`` needs every tensor on the CPU at once and then builds the whole
file body as Python bytes: a 27B-shape drafter's 3.6 GB of weights briefly held ~7 GB of host RAM
in the drafter process at each checkpoint and export (docs/BENCHMARKS.md). The format is simple
and stable (https://huggingface.co/docs/safetensors: an 8-byte little-endian header length, a JSON
header of ``{name: {dtype, shape, data_offsets}}`` plus ``__metadata__``, then the raw bytes), so
this writer streams each tensor from its device in slices of at most ``slice_bytes`` (64 MiB)
through one reused host buffer. Reading stays with the ``safetensors`` library, which also checks
what this writes (tests/drafter/test_safetensors_stream.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["write_safetensors"]

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned


def write_safetensors(
    path: Path | str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    slice_bytes: int = 64 << 20,
    hasher: Any = None,
) -> None:
    """Write ``tensors`` (on any device; cast to ``dtype`` when given) to the new file ``path`` and fsync it
    (a file already there, or a link, is refused: FileExistsError).

    Tensors sharing storage are written as separate copies (safetensors' own writer refuses them).
    ``hasher`` (a ``hashlib`` object) is fed every byte written: a digest without reading the file back."""
    names = sorted(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in names:
        t = tensors[name]
        out_dtype = dtype or t.dtype
        if out_dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {out_dtype} has no safetensors name")
        nbytes = t.numel() * out_dtype.itemsize
        header[name] = {"dtype": _DTYPE_NAMES[out_dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % _ALIGN)
    buffer: torch.Tensor | None = None
    with open(path, "xb") as raw:
        f = raw if hasher is None else _Hashing(raw, hasher)
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            flat = tensors[name].detach().reshape(-1)
            if dtype is not None:
                flat = flat.to(dtype)
            step = max(1, slice_bytes // flat.element_size())
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step]
                if part.device.type == "cpu" and part.stride(0) == 1:
                    host = part
                else:
                    need = part.numel() * part.element_size()
                    if buffer is None or buffer.numel() < need:
                        buffer = torch.empty(max(need, min(slice_bytes, offset)), dtype=torch.uint8)
                    host = buffer[:need].view(part.dtype)
                    host.copy_(part)
                f.write(memoryview(host.view(torch.uint8).numpy()))
        raw.flush()
        os.fsync(raw.fileno())


class _Hashing:
    """A file's ``write`` that feeds a hash on the way."""

    def __init__(self, f: BinaryIO, hasher: Any):
        self._f, self._hasher = f, hasher

    def write(self, data: bytes | memoryview) -> int:
        self._hasher.update(data)
        return self._f.write(data)
