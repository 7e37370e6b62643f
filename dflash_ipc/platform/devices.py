"""Devices and dtypes by name: the one table and the one normaliser every role uses."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
}

DeviceLike = torch.device | str | int | None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported dtype {dtype}")


def as_device(device: DeviceLike) -> torch.device:
    """A torch device; an int means that CUDA device, None means the CPU."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def cuda_device(device: DeviceLike) -> torch.device:
    """A CUDA device with an explicit index (``"cuda"`` or None means the current device)."""
    device = as_device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"{device} is not a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def fill_normal_(out: torch.Tensor, std: float, generator: torch.Generator, chunk_elems: int = 1 << 24) -> torch.Tensor:
    """Fill a 2-D ``out`` (any device, any dtype) with N(0, std), drawn in fp32 on the generator's
    device in row chunks of about ``chunk_elems`` elements: bounded memory, and the same numbers
    for the same generator state whatever ``out``'s device and dtype (one draw sequence per seed)."""
    rows, cols = out.shape
    chunk = max(1, chunk_elems // max(1, cols))
    with torch.no_grad():
        for r in range(0, rows, chunk):
            n = min(chunk, rows - r)
            out[r : r + n].copy_(torch.randn(n, cols, generator=generator, device=generator.device, dtype=torch.float32) * std)
    return out


def gpu_memory_text(device: DeviceLike) -> str:
    """This process's GPU memory high-water mark on ``device`` and the device's free memory now,
    for a role's phase lines ("" on CPU): a device shared by several processes is full when
    their peaks add up, and each process sees only its own."""
    device = as_device(device)
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    gib = 2**30
    return (
        f"GPU peak {torch.cuda.max_memory_allocated(device) / gib:.1f} GiB allocated, "
        f"{torch.cuda.max_memory_reserved(device) / gib:.1f} GiB reserved; "
        f"{device} free now {free / gib:.1f} of {total / gib:.1f} GiB"
    )
